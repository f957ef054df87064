#!/bin/bash
# Qwen2.5-Coder-0.5B on reasoning-gym (issue 19's Qwen goal), one repeat, float32 so that every arm draws the same
# samples; one engine alive at a time. From this folder: PATH=<repository>/.venv/bin:$PATH bash run.sh
das bench e2e --model qwen2.5-coder-0.5b --prompts reasoning-gym:6 --samples 8 --epochs 3 --max-tokens 1024 \
    --temperature 0.8 --arms none,das,suffix-t --dtype float32 --sequential --profile --markdown e2e.md --json \
    > e2e.json 2> e2e.log
