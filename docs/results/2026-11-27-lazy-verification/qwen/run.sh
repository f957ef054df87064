#!/bin/bash
# 2026-11-27-qwen-reasoning's run (Qwen2.5-Coder-0.5B on reasoning-gym, float32, identical samples in every arm),
# arms none and das only, after lazy keyed verification. From this folder: PATH=<repository>/.venv/bin:$PATH bash run.sh
das bench e2e --model qwen2.5-coder-0.5b --prompts reasoning-gym:6 --samples 8 --epochs 3 --max-tokens 1024 \
    --temperature 0.8 --arms none,das --dtype float32 --sequential --profile --markdown e2e.md --json \
    > e2e.json 2> e2e.log
