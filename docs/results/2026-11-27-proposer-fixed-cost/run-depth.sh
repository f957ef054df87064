#!/bin/bash
# The proposer's cost per step with the suffix index at depth 32 (before) and at the new default K_max + 8 = 16,
# three interleaved repeats each, without and with a 10 ms sleep between steps; then what the index finds at each
# depth. Run from the repository root: bash docs/results/2026-11-27-proposer-fixed-cost/run-depth.sh
set -euo pipefail
here=docs/results/2026-11-27-proposer-fixed-cost
for repeat in 1 2 3; do
  for forward in 0 10; do
    for depth in 32 16; do
      echo "repeat $repeat forward $forward ms depth $depth:"
      .venv/bin/python $here/bench_small.py 1,16,128,240 --forward-ms $forward --max-depth $depth 2>&1 | grep '^batch'
    done
  done
done
for k in 8 16; do
  echo "K = $k:"
  .venv/bin/python $here/depth.py $k 12,16,24,32 tests/fixtures/traces-smollm2.jsonl.gz \
    tests/fixtures/traces-qwen2.5-coder-0.5b.jsonl.gz tests/fixtures/traces-smollm2-66x16.jsonl.gz 2>&1 | grep 'D='
done
