"""Stopping a run on Ctrl-C or SIGTERM: the signal becomes an exception in the runner, and every process the run
started (the stage's Jupyter kernel, torchrun and its ranks, vLLM servers) is stopped with it.

Why the runner does it itself: the kernel runs in a session of its own (jupyter_client starts kernels with
start_new_session), so a terminal's Ctrl-C never reaches it or its children, and nbclient's own SIGINT / SIGTERM
handler only schedules a kernel shutdown the busy kernel does not act on. A stage then ran on for hours after Ctrl-C.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType


class Interrupted(KeyboardInterrupt):
    """The run was asked to stop by a signal (a KeyboardInterrupt, so no `except Exception` swallows it)."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(signal.Signals(signum).name)

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # what a shell reports for a process a signal stopped: 130 (SIGINT), 143 (SIGTERM)


@contextmanager
def signals_interrupt(say: Callable[[str], None]) -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM raise Interrupted in the main thread (the first one; later ones while the
    run stops are said and ignored, so the clean-up is not itself interrupted)."""
    stopping = False

    def handler(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        if stopping:
            say(f"{signal.Signals(signum).name}: already stopping (the stage's processes get a few seconds to exit)")
            return
        stopping = True
        raise Interrupted(signum)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def stop_children(grace_s: float = 10.0) -> list[int]:
    """SIGTERM to every process this one started (children of children too, whatever their session), SIGKILL to those
    still alive after `grace_s`. Returns the pids that had to be killed."""
    import psutil

    procs = psutil.Process(os.getpid()).children(recursive=True)
    for p in procs:
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    # processes started while the others exited (a rank's helper) are caught by a second look
    alive += [p for p in psutil.Process(os.getpid()).children(recursive=True) if p not in alive]
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)
    return [p.pid for p in alive]


def wait_thread(thread: threading.Thread, poll_s: float = 0.2) -> None:
    """Join `thread` in short waits, so a signal handler in the main thread runs within `poll_s`."""
    while thread.is_alive():
        thread.join(poll_s)
