#!/bin/bash
# The goals of issue 19 re-run on this machine with today's code (2026-11-27); from this folder:
#   PATH=<repository>/.venv/bin:$PATH bash run.sh
set -x
T=../../../tests/fixtures
for t in traces-smollm2 traces-qwen2.5-coder-0.5b traces-smollm2-66x16; do
  das bench drafter --traces $T/$t.jsonl.gz --arms das,arctic-d24,arctic-d64 --repeats 1 --json > drafter-$t.json
done
das bench e2e --model smollm2 --arms none,das --samples 8 --prompts reasoning-gym:8 --max-tokens 256 \
    --epochs 3 --temperature 0.8 --profile --rollouts-out validate-run.jsonl.gz --json > validate-e2e.json
das bench validate validate-run.jsonl.gz --json > validate-profile.json
das bench validate validate-run.jsonl.gz --cost live --json > validate-live.json
das bench e2e --model smollm2 --prompts reasoning-gym:16 --samples 8 --epochs 2 --max-tokens 64 \
    --temperature 0.8 --ignore-eos --arms none,das --repeats 2 --profile --markdown never-a-loss-cb.md --json \
    > never-a-loss-cb.json
