#!/bin/bash
# The validation again after 8a34b98 (the generic prior's prefill price); from this folder:
#   PATH=<repository>/.venv/bin:$PATH bash run-after-prior.sh
set -x
das bench e2e --model smollm2 --arms none,das --samples 8 --prompts reasoning-gym:8 --max-tokens 256 \
    --epochs 3 --temperature 0.8 --profile --rollouts-out validate-run2.jsonl.gz --json > validate-e2e2.json
das bench validate validate-run2.jsonl.gz --json > validate2-profile.json
das bench validate validate-run2.jsonl.gz --cost live --json > validate2-live.json
