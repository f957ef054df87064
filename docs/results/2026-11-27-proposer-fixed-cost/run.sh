#!/bin/bash
# The proposer's cost per step at batches of 1-240, before (0d66b38: per-request Python gathers and a Python loop
# over the length curves) and after (per-request columns, one vectorised lookup of every curve), three interleaved
# repeats each, without and with a 10 ms sleep between steps. Run from the repository root:
#   bash docs/results/2026-11-27-proposer-fixed-cost/run.sh
set -euo pipefail
here=docs/results/2026-11-27-proposer-fixed-cost
before=$(mktemp -d)/before
git worktree add -q "$before" 0d66b38
trap 'git worktree remove --force "$before"' EXIT
cp "$(.venv/bin/python -c 'import das.drafter._suffix_index as m; print(m.__file__)')" "$before/drafter/"
for repeat in 1 2 3; do
  for forward in 0 10; do
    echo "repeat $repeat forward $forward ms before:"
    .venv/bin/python docs/results/2026-11-27-batched-proposer/before.py "$before" $here/bench_small.py \
      1,16,128,240 --forward-ms $forward 2>&1 | grep '^batch'
    echo "repeat $repeat forward $forward ms after:"
    .venv/bin/python $here/bench_small.py 1,16,128,240 --forward-ms $forward 2>&1 | grep '^batch'
  done
done
