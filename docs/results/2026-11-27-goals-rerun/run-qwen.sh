#!/bin/bash
# Qwen2.5-Coder-0.5B on the bundled code prompts (mild length tail), float32 so both arms draw the same samples;
# from this folder: PATH=<repository>/.venv/bin:$PATH bash run-qwen.sh
set -x
das bench e2e --model qwen2.5-coder-0.5b --prompts code:6 --samples 8 --max-tokens 512 --epochs 2 \
    --temperature 0.8 --arms none,das --dtype float32 --profile --markdown qwen-code.md --json > qwen-code.json
