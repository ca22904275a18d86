"""Running a stage's processes: `python -m MODULE ...` in a subprocess, under torchrun when the stage's
nproc_per_node * nnodes > 1 (eagle3lib/config/launch.py), its console lines streamed. Train and extract use it."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from eagle3lib.core.guard import popen_guarded
from eagle3lib.core.manifest import read_manifest
from eagle3lib.core.paths import RUN_CWD_ENV, run_cwd


class Launch(Protocol):
    """How many processes to start and how they meet (config/launch.py's TorchrunConfig is one)."""

    nproc_per_node: int
    nnodes: int
    rdzv_endpoint: str | None
    rdzv_id: str


def torchrun_command(cfg: Launch, module: str, args: list[str]) -> list[str]:
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
    """One OpenMP pool per process, sized to share the node's cores; the profile's relative paths resolved as here."""
    env = dict(os.environ)
    env[RUN_CWD_ENV] = str(run_cwd())  # they start in their stage folder: the profile's paths stay where they were
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, nproc_per_node))))
    return env


def run_streamed(cmd: list[str], cwd: str, env: dict[str, str], show: Callable[[str], bool],
                 echo=print, log_path: str | Path | None = None) -> tuple[int, list[str]]:
    """Run `cmd`, echoing the lines `show` accepts and appending every line to `log_path`; returns (exit code, the last
    400 lines: room for every rank's traceback, so the first one to fail is still in it). Interrupting (a notebook's
    stop button) sends SIGTERM to the whole group, so the processes save what they did and the next launch resumes."""
    echo("$ " + " ".join(cmd))
    proc = popen_guarded(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, env=env, cwd=cwd)
    tail: list[str] = []
    # line-buffered: a run stopped by a signal (its kernel killed before this closes the file) keeps every line
    log = open(log_path, "a", encoding="utf-8", buffering=1) if log_path else None  # noqa: SIM115 (closed below)
    try:
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail = (tail + [line])[-400:]
            if log:
                log.write(line + "\n")
            if show(line):
                echo(line)
        proc.wait()
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()
        raise
    finally:
        if log:
            log.close()
    return proc.returncode, tail


# A rank's own one-line error ("[train] error: ..."), else the last exception line of a traceback (torchrun prefixes
# each rank's lines with "[rankN]:"), else nothing: torchrun's ChildFailedError report is ~30 lines of its own
_OWN_ERROR = re.compile(r"^(?:\[rank\d+\]:\s*)?\[(?:train|extract)[^\]]*\] error: (.+)$")
_KILLED = re.compile(r"exitcode\s*:\s*-(\d+)")
_EXCEPTION = re.compile(r"^(?:\[rank\d+\]:\s*)?((?:[\w.]+\.)?\w*(?:Error|Exception|Interrupt)\b.*)$")


def run_stage_processes(cfg: Launch, module: str, args: list[str], stage_dir: Path, prefix: str, what: str,
                        error: type[Exception], echo: Callable[[str], None] = print) -> dict:
    """A stage's processes (`python -m module args`, under torchrun when `cfg` asks for several), started in its folder,
    their `[prefix...]` lines echoed and every line kept in STAGE_DIR/<prefix>.log; returns the manifest rank 0 wrote.
    Raises `error` ("<what> failed: ...") naming the line that says why when they fail or leave no complete manifest. On a node of a
    multi-node run whose RUN_DIR is not shared, rank 0 wrote the manifest elsewhere: its manifest as found is returned.

    They start in the stage folder, not the repository: `python -m` puts its folder on the path, and the repository's
    top-level `kernels/` must not shadow Hugging Face's `kernels` package there (ours is `eagle3lib.kernels`)."""
    stage_dir.mkdir(parents=True, exist_ok=True)
    log = stage_dir / f"{prefix}.log"
    code, tail = run_streamed(torchrun_command(cfg, module, args), str(stage_dir), torchrun_env(cfg.nproc_per_node),
                              lambda line: line.startswith(f"[{prefix}"), echo, log)
    m = read_manifest(stage_dir) or {}
    if code == 0 and cfg.nnodes > 1 and m.get("status") != "complete":
        echo(f"[{prefix}] this node's processes finished; rank 0 ran on another node and wrote the results to its "
             f"{stage_dir}")
        return m
    if code != 0 or m.get("status") != "complete":
        raise error(f"{what} failed: {m.get('error') or failure_cause(tail) or f'exit code {code}'} (every process's "
                    f"output: {log})")
    return m


def failure_cause(tail: list[str]) -> str | None:
    """The one line that says why a torchrun process failed, from the last lines of its output."""
    # torch.distributed errors come last: a rank that fails takes the others' collectives down with it, so theirs
    # ("Connection closed by peer") are echoes of the cause, not the cause
    for pattern, collective in ((_OWN_ERROR, False), (_EXCEPTION, False), (_EXCEPTION, True)):
        for line in reversed(tail):  # the last one: a chained exception's outermost
            m = pattern.match(line.strip())
            if m and "ChildFailedError" not in line and collective == _is_collective(line):
                return m.group(1)
    for line in reversed(tail):  # no rank said why: torchrun's report names the signal that ended one (its own exit is 1)
        m = _KILLED.search(line)
        if m:
            n = int(m.group(1))
            why = " (the kernel's out-of-memory killer, or a kill by hand)" if n == signal.SIGKILL else ""
            return f"a rank was killed by {signal.Signals(n).name}{why}" if n in signal.valid_signals() else None
    return None


def _is_collective(line: str) -> bool:
    s = re.sub(r"^\[rank\d+\]:\s*", "", line.strip())
    return s.startswith("torch.distributed") or "DistBackendError" in s or "DistNetworkError" in s
