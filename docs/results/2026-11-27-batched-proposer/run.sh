#!/bin/bash
# The proposer's cost per step at a batch of 240 before (ff29178: per-request Python around native calls) and after
# (one native call each for the batch's commits and drafts), three interleaved repeats of each.
# Run from the repository root: bash docs/results/2026-11-27-batched-proposer/run.sh
set -euo pipefail
here=docs/results/2026-11-27-batched-proposer
before=$(mktemp -d)/before
git worktree add -q "$before" ff29178
trap 'git worktree remove --force "$before"' EXIT
cp "$(.venv/bin/python -c 'import das.drafter._suffix_index as m; print(m.__file__)')" "$before/drafter/"
for repeat in 1 2 3; do
  for mode in das --uniform; do
    echo "repeat $repeat $mode before: $(.venv/bin/python $here/before.py "$before" \
      "$before/docs/results/2026-11-27-straggler/bench_propose.py" 80 $mode | tail -1)"
    echo "repeat $repeat $mode after:  $(.venv/bin/python docs/results/2026-11-27-straggler/bench_propose.py 80 \
      $mode | tail -1)"
  done
done
