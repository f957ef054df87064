"""Our vLLM general plugin's exit hook (service/engine/vllm/plugin.py, `skip_collection_at_exit`): in a process vLLM
started (a multiprocessing child, as an engine core is) the garbage collector's objects are frozen once the other
exit handlers ran; in any other process (a trainer's, `das serve`'s engine actor) nothing changes."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
from pathlib import Path

# Registered before the hook, so run after it (exit handlers run last in, first out): what the collector holds
# frozen when the interpreter's finalization begins.
REPORT = """
import atexit, gc, sys
atexit.register(lambda: open(sys.argv[1], "w").write(str(gc.get_freeze_count())))
from das.service.engine.vllm.plugin import skip_collection_at_exit
skip_collection_at_exit()
skip_collection_at_exit()  # once per process
"""


def _child(report: str) -> None:
    sys.argv = ["child", report]
    exec(REPORT, {"__name__": "__child__"})


def test_a_process_vllm_started_freezes_its_objects_at_exit_and_any_other_process_does_not(tmp_path: Path) -> None:
    child = multiprocessing.get_context("spawn").Process(target=_child, args=(str(tmp_path / "child"),))
    child.start()
    child.join(120)
    assert child.exitcode == 0
    assert int((tmp_path / "child").read_text()) > 1000  # the modules' objects, frozen before finalization
    done = subprocess.run([sys.executable, "-c", REPORT, str(tmp_path / "main")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "main").read_text() == "0"
