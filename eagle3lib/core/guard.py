"""Child processes that do not outlive the process that started them.

A vLLM server or a torchrun job runs in a session of its own, so that one `killpg` stops its whole process tree (vLLM's
engine core and workers, torchrun's ranks). The price: nothing stops that tree when the notebook kernel that started it
dies without running its `finally` blocks (kill -9, SIGTERM to the pipeline, a crashed kernel). An orphaned server keeps
its port, memory and cores; an orphaned training run keeps writing checkpoints into the folder a re-run resumes from.

So the tree gets a guard: a small process that is the session leader, starts the command inside its session, and waits.
When its parent goes away it sends its session SIGTERM (training saves a checkpoint, vLLM shuts down) and, after a grace
period, SIGKILL. Signals sent to the group reach the command directly; the guard ignores them and exits with the
command's exit status, so `Popen.wait()` on the guard returns once the command is really gone.

    python -m eagle3lib.core.guard [--grace-s 120] -- CMD [ARGS...]
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

POLL_S = 0.5  # how often the guard checks its parent: a killed kernel's children are stopped within this
DEFAULT_GRACE_S = 120.0  # SIGTERM -> SIGKILL: a large drafter's final checkpoint write takes about a minute


def popen_guarded(cmd: list[str], grace_s: float = DEFAULT_GRACE_S, **popen_kwargs: Any) -> subprocess.Popen:
    """`subprocess.Popen(cmd)` in a new session behind a guard. `os.killpg(proc.pid, sig)` signals the whole tree, and
    the tree is stopped if this process dies first."""
    guard = [sys.executable, "-m", "eagle3lib.core.guard", "--grace-s", str(grace_s), "--", *cmd]
    return subprocess.Popen(guard, start_new_session=True, **popen_kwargs)


def _stop_session(child: subprocess.Popen, grace_s: float) -> int:
    os.killpg(0, signal.SIGTERM)  # our own group: the guard ignores it
    deadline = time.monotonic() + grace_s
    while child.poll() is None and time.monotonic() < deadline:
        time.sleep(POLL_S)
    if child.poll() is None:
        os.killpg(0, signal.SIGKILL)  # takes the guard with it
    return child.wait()


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    grace_s = DEFAULT_GRACE_S
    if args[:1] == ["--grace-s"]:
        grace_s, args = float(args[1]), args[2:]
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        print("usage: python -m eagle3lib.core.guard [--grace-s S] -- CMD [ARGS...]", file=sys.stderr)
        return 2
    parent = os.getppid()
    # Whoever wants the command stopped signals the whole group (killpg): the command gets it directly. Forwarding it
    # as well would deliver it twice, which makes torchrun and vLLM skip their orderly shutdown.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    # ...but the command itself must not inherit the ignored dispositions.
    child = subprocess.Popen(args, preexec_fn=lambda: [signal.signal(s, signal.SIG_DFL)
                                                       for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)])
    while True:
        try:
            code = child.wait(timeout=POLL_S)
            return 128 - code if code < 0 else code  # killed by signal N: the shell's 128 + N, which callers can name
        except subprocess.TimeoutExpired:
            pass
        if os.getppid() != parent:  # reparented: whoever started us is gone
            return _stop_session(child, grace_s)


if __name__ == "__main__":
    sys.exit(main())
