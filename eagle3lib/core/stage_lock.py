"""One writer per stage folder: the runner holds RUN_DIR/.locks/<stage>.lock while it decides about and runs a stage,
so a second `run` on the same run directory stops with the holder named instead of training (or extracting) beside
the first, interleaving its records and overwriting its outputs. An flock: the kernel releases it when the holder
dies, so a killed run leaves nothing to clean up. The lock lives outside the stage folder because a forced re-run
moves that folder aside."""

from __future__ import annotations

import fcntl
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from eagle3lib.core.manifest import now_iso


class StageLocked(ValueError):
    """Another process is running this stage on this run directory."""


@contextmanager
def stage_lock(run_dir: Path, stage: str) -> Iterator[None]:
    path = Path(run_dir) / ".locks" / f"{stage}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            raise StageLocked(f"{Path(run_dir) / stage}: the {stage} stage is being run by {holder}; one run per stage "
                              f"folder at a time (wait for it, or stop it: a killed run resumes)") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()} since {now_iso()}\n")
        f.flush()
        yield


def running(run_dir: Path, stage: str) -> str | None:
    """"STAGE is running in process PID (lock FILE)" while a live process holds the stage's lock, else None: a stage
    reading another's outputs then says why they are missing or partial, not that they are. A shared lock, released
    at once, is the probe: the holder's record in the file outlives it, the lock does not."""
    path = Path(run_dir) / ".locks" / f"{stage}.lock"
    try:
        f = open(path)
    except FileNotFoundError:
        return None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = f.read().split()
            pid = f"process {holder[1]}" if holder[:1] == ["pid"] and len(holder) > 1 else "another process"
            host = f" on {holder[3]}" if len(holder) > 3 and holder[3] != socket.gethostname() else ""
            return f"{stage} is running in {pid}{host} (lock {path})"
        fcntl.flock(f, fcntl.LOCK_UN)
    return None
