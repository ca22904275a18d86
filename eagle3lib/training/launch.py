"""Launching training: `python -m eagle3lib.stages.train` in a subprocess, under torchrun when
train.nproc_per_node * nnodes > 1, its console lines streamed; what the train stage and the data-scaling stage call."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any

from eagle3lib.core.guard import popen_guarded
from eagle3lib.core.manifest import read_manifest
from eagle3lib.trackers.run import check_trackers
from eagle3lib.training.setup import TrainingError


def launch_command(ctx, overrides: dict[str, Any] | None = None) -> list[str]:
    """The command that trains this stage: torchrun when the profile asks for several processes."""
    cfg = ctx.cfg
    args = ["-m", "eagle3lib.stages.train", "--profile", str(ctx.profile.path), "--run-dir", str(ctx.run_dir),
            "--overrides-json", json.dumps(overrides if overrides is not None else ctx.profile.overrides)]
    if ctx.out_dir is not None:
        args += ["--out-dir", str(ctx.out_dir)]
    if cfg.nproc_per_node * cfg.nnodes > 1:
        tr = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={cfg.nproc_per_node}"]
        if cfg.nnodes > 1:  # every node runs this same command; torchrun's rendezvous assigns the ranks
            endpoint = cfg.rdzv_endpoint or os.environ.get("EAGLE3_RDZV_ENDPOINT", "localhost:29400")
            tr += [f"--nnodes={cfg.nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
                   f"--rdzv-id={cfg.rdzv_id}"]
        else:
            tr += ["--standalone"]
        return tr + ["--module", *args[1:]]
    return [sys.executable, *args]


def launch_env(ctx) -> dict[str, str]:
    """The environment of the training processes: one OpenMP pool per process, sized to share the cores."""
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, ctx.cfg.nproc_per_node))))
    return env


def launch(ctx, *, echo=print) -> dict[str, Any]:
    """Run training in a subprocess (torchrun for several processes), streaming its console lines.

    A subprocess even for one process: the notebook kernel stays small and responsive, a crash (out of memory) does
    not take the kernel with it, and one and many processes run exactly the same code. Interrupting the notebook sends
    SIGTERM, so the run saves a checkpoint and the next launch resumes. The processes start in the stage folder, not
    the repository: `python -m` puts its folder on the path, and the repository's top-level `kernels/` must not shadow
    Hugging Face's `kernels` package there (ours is `eagle3lib.kernels`).
    """
    check_trackers(ctx.cfg, ctx.dir)  # a tracker that cannot start fails now, not after torchrun's start-up
    cmd = launch_command(ctx)
    echo("$ " + " ".join(cmd))
    ctx.dir.mkdir(parents=True, exist_ok=True)  # the processes start in it
    proc = popen_guarded(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                         env=launch_env(ctx), cwd=str(ctx.dir))
    tail: list[str] = []
    try:
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail = (tail + [line])[-60:]
            if line.startswith("[train") or "Error" in line or "error" in line:
                echo(line)
        proc.wait()
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()
        raise
    m = read_manifest(ctx.dir) or {}
    if proc.returncode == 0 and ctx.cfg.nnodes > 1 and m.get("status") != "complete":
        echo(f"[train] this node's processes finished; rank 0 ran on another node and wrote the results to its "
             f"{ctx.dir}")  # a RUN_DIR that is not shared between the nodes
        return m
    if proc.returncode != 0 or m.get("status") != "complete":
        msg = m.get("error") or f"exit code {proc.returncode}"
        raise TrainingError(f"training failed: {msg}\n--- last output lines ---\n" + "\n".join(tail[-30:]))
    return m
