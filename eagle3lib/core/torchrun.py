"""Running a stage's processes: `python -m MODULE ...` in a subprocess, under torchrun when the stage's
nproc_per_node * nnodes > 1 (eagle3lib/config/launch.py), its console lines streamed. Train and extract use it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable

from eagle3lib.core.guard import popen_guarded


def torchrun_command(cfg, module: str, args: list[str]) -> list[str]:
    """`python -m module args`, or torchrun running it when `cfg` asks for several processes."""
    if cfg.nproc_per_node * cfg.nnodes > 1:
        tr = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={cfg.nproc_per_node}"]
        if cfg.nnodes > 1:  # every node runs this same command; torchrun's rendezvous assigns the ranks
            endpoint = cfg.rdzv_endpoint or os.environ.get("EAGLE3_RDZV_ENDPOINT", "localhost:29400")
            tr += [f"--nnodes={cfg.nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
                   f"--rdzv-id={cfg.rdzv_id}"]
        else:
            tr += ["--standalone"]
        return [*tr, "--module", module, *args]
    return [sys.executable, "-m", module, *args]


def torchrun_env(nproc_per_node: int) -> dict[str, str]:
    """One OpenMP pool per process, sized to share the node's cores."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, nproc_per_node))))
    return env


def run_streamed(cmd: list[str], cwd: str, env: dict[str, str], show: Callable[[str], bool],
                 echo=print) -> tuple[int, list[str]]:
    """Run `cmd`, echoing the lines `show` accepts; returns (exit code, the last 60 lines). Interrupting (a notebook's
    stop button) sends SIGTERM to the whole group, so the processes save what they did and the next launch resumes."""
    echo("$ " + " ".join(cmd))
    proc = popen_guarded(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env, cwd=cwd)
    tail: list[str] = []
    try:
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail = (tail + [line])[-60:]
            if show(line):
                echo(line)
        proc.wait()
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()
        raise
    return proc.returncode, tail
