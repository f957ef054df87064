"""`lock_state_dir`: one `das serve` per state directory. Two gateways on one `--state-dir` would each snapshot the
history over the other's and journal batches the other never ran, so the second refuses to start.

An exclusive `fcntl.flock` on `<state_dir>/serve.lock`, held for the life of the process: the kernel drops it when
the process ends, however it ends (no stale lock after a crash or SIGKILL). The file holds the holder's pid, for the
message. flock locks are per open file, so one process may not take the lock twice either.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

LOCK_NAME = "serve.lock"


class StateDirInUse(RuntimeError):
    """Another process holds the state directory's lock."""


def lock_state_dir(state_dir: Path) -> IO[str]:
    """Creates `state_dir` if needed and takes its lock; returns the open lock file, which must stay open (and
    referenced) while the service runs. StateDirInUse names the holder if another process has it."""
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / LOCK_NAME
    handle = path.open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise StateDirInUse(f"--state-dir {state_dir} is in use by another das serve (pid {holder}; lock file "
                            f"{path}): two services on one state directory would overwrite each other's history "
                            f"snapshots and batch journal. Stop that one, or give this one another --state-dir"
                            ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle
