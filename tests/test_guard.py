# Run: .venv/bin/python -m pytest tests/test_guard.py -q
"""The guard around vLLM servers and training runs (eagle3lib/core/guard.py), with real processes: a killed parent takes its
guarded tree with it, the command sees one SIGTERM (its orderly shutdown) before any SIGKILL, and killpg on the guard
returns only once the command has exited."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from eagle3lib.core.guard import popen_guarded

# A command with an orderly shutdown: on SIGTERM it records the signal, takes a moment (a checkpoint write), exits 0.
GRACEFUL = textwrap.dedent("""
    import os, signal, sys, time
    log = sys.argv[1]
    def on_term(*_):
        with open(log, "a") as f:
            f.write("TERM\\n")
        time.sleep(0.5)
        with open(log, "a") as f:
            f.write("saved\\n")
        sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    with open(log, "a") as f:
        f.write(f"pid {os.getpid()}\\n")
    while True:
        time.sleep(0.1)
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purposes
    return Path(f"/proc/{pid}/stat").read_text().split(")")[1].split()[0] != "Z"


def _wait_for(pred, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


def _child_pid(log: Path) -> int:
    assert _wait_for(lambda: log.exists() and log.read_text().startswith("pid ")), "the command did not start"
    return int(log.read_text().split()[1])


def test_killed_parent_stops_the_guarded_command(tmp_path):
    log = tmp_path / "child.log"
    script = tmp_path / "graceful.py"
    script.write_text(GRACEFUL)
    # The parent (a stand-in for a notebook kernel) starts a guarded command and is then killed with SIGKILL: no
    # `finally`, no context-manager exit.
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from eagle3lib.core.guard import popen_guarded
        popen_guarded([{sys.executable!r}, {str(script)!r}, {str(log)!r}], grace_s=10)
        time.sleep(600)
    """)])
    pid = _child_pid(log)
    parent.kill()
    parent.wait()
    assert _wait_for(lambda: not _alive(pid)), "the guarded command outlived its parent"
    assert log.read_text().splitlines()[1:] == ["TERM", "saved"]  # one SIGTERM, and time to finish its shutdown


def test_killpg_returns_after_the_command_exits(tmp_path):
    log = tmp_path / "child.log"
    script = tmp_path / "graceful.py"
    script.write_text(GRACEFUL)
    proc = popen_guarded([sys.executable, str(script), str(log)], grace_s=10)
    pid = _child_pid(log)
    os.killpg(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=20) == 0  # the command's own exit status
    assert not _alive(pid)
    assert log.read_text().splitlines()[1:] == ["TERM", "saved"]


def test_exit_status_and_output_pass_through(tmp_path):
    proc = popen_guarded([sys.executable, "-c", "print('hello'); raise SystemExit(3)"], stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=30)
    assert (proc.returncode, out) == (3, "hello\n")
