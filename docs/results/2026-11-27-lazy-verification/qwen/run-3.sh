#!/bin/bash
# run.sh with 3 repeats (fresh engines each; the tables show medians). From this folder:
# PATH=<repository>/.venv/bin:$PATH bash run-3.sh
das bench e2e --model qwen2.5-coder-0.5b --prompts reasoning-gym:6 --samples 8 --epochs 3 --max-tokens 1024 \
    --temperature 0.8 --arms none,das --dtype float32 --sequential --profile --repeats 3 --markdown e2e-3.md \
    --json > e2e-3.json 2> e2e-3.log
