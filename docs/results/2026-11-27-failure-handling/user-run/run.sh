#!/bin/bash
# The quick start's own run as the benchmark, float32 so that both arms draw the same samples, 3 repeats (arms
# alternating). From this folder: PATH=<repository>/.venv/bin:$PATH bash run.sh
das bench serve --repeats 3 --serve-args "--dtype float32" --markdown user-run.md --json > user-run.json 2> user-run.log
