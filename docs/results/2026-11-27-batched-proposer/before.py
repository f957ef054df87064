"""Runs a script against the package checked out in BEFORE (the proposer before the batched step) instead of the
editable install: python before.py BEFORE SCRIPT [ARGS...]. BEFORE needs the native module copied into its
drafter/ (run.sh does it; the module is a superset of the old one)."""
import runpy
import sys
import tempfile
from pathlib import Path

before, script = Path(sys.argv[1]).resolve(), sys.argv[2]
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__]
root = Path(tempfile.mkdtemp())
(root / "das").symlink_to(before)
sys.path.insert(0, str(root))
sys.argv = sys.argv[2:]
runpy.run_path(script, run_name="__main__")
