"""One das serve per state directory (service/state_dir_lock.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from das.service.state_dir_lock import StateDirInUse, lock_state_dir


def test_a_second_lock_on_one_state_dir_is_refused_naming_the_holder(tmp_path: Path) -> None:
    held = lock_state_dir(tmp_path / "state")
    with pytest.raises(StateDirInUse, match=r"in use by another das serve \(pid \d+"):
        lock_state_dir(tmp_path / "state")
    held.close()
    lock_state_dir(tmp_path / "state").close()  # free once the holder let go


def test_the_lock_is_held_across_processes_and_freed_when_its_holder_dies(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from das.service.state_dir_lock import lock_state_dir; "
                               f"h = lock_state_dir(Path({str(tmp_path)!r})); print('held', flush=True); "
                               "time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(StateDirInUse, match=f"pid {holder.pid}"):
            lock_state_dir(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    lock_state_dir(tmp_path).close()  # the kernel dropped the dead holder's lock


def test_das_serve_on_a_state_dir_in_use_refuses_to_start_with_a_clear_message(tmp_path: Path) -> None:
    held = lock_state_dir(tmp_path)  # as a running das serve holds it
    try:
        das = Path(sys.executable).with_name("das")
        done = subprocess.run([str(das), "serve", "--stub-engine", "--port", "1", "--state-dir", str(tmp_path)],
                              capture_output=True, text=True, timeout=120, env={"COLUMNS": "300", "PATH": ""})
    finally:
        held.close()
    assert done.returncode == 2, done.stdout + done.stderr
    said = " ".join((done.stdout + done.stderr).split())
    assert f"--state-dir {tmp_path} is in use by another das serve (pid " in said, said
