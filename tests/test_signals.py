# .venv/bin/python -m pytest -q tests/test_signals.py
"""What Ctrl-C and SIGTERM do to a run (eagle3lib/core/stop.py): the stage stops within seconds, kernel, torchrun and
its ranks included, nothing the run started is left running, the stage's manifest and run.json say interrupted, what a
forced stage set aside is named, the exit status is the signal's, and the same command resumes from the checkpoint.

A real runner on a real training (the tests' tiny store, torchrun with 2 processes), stopped the two ways users stop
it: SIGTERM to the runner alone (`timeout`, `scancel`, `docker stop`), SIGINT to its process group (Ctrl-C in a
terminal; the kernel runs in a session of its own, which the terminal's Ctrl-C never reached)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from train_fixtures import cached_store, make_run_dir

from eagle3lib.core.manifest import StageTimer

pytestmark = pytest.mark.slow

# a training far longer than the test: it is always stopped mid-way, after its first checkpoints
ENDLESS = ["--set", "train.epochs=1000", "--set", "train.ckpt_every=2", "--set", "train.log_every=1",
           "--set", "train.nproc_per_node=2", "--set", "train.report_to=[]"]


def _start(run: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "eagle3lib", "run", "--profile", "tiny", "--run-dir", str(run),
                             "--stages", "train", *ENDLESS, *extra], stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _checkpoints(run: Path) -> set[Path]:
    return set((run / "train" / "checkpoints").glob("step_*"))


def _wait_for_checkpoint(run: Path, proc: subprocess.Popen, timeout_s: float = 240) -> list[psutil.Process]:
    """Every process the runner has started once the training has written a new checkpoint (its ranks are running)."""
    t0, before = time.time(), _checkpoints(run)
    while not _checkpoints(run) - before:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.time() - t0 < timeout_s, "no checkpoint written"
        time.sleep(0.5)
    return psutil.Process(proc.pid).children(recursive=True)


def _stopped(proc: subprocess.Popen, started: list[psutil.Process], t_signal: float) -> tuple[int, str, float]:
    err = proc.communicate(timeout=90)[1]
    took = time.time() - t_signal
    alive = [p.pid for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"left running: {alive}\n{err[-3000:]}"
    return proc.returncode, err, took


@pytest.fixture
def reaper():
    """Whatever a failing test leaves running is killed (each run is its own process group)."""
    procs: list[subprocess.Popen] = []
    yield procs.append
    for proc in procs:
        for p in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)] if proc.poll() is None else []:
            p.kill()


def test_sigterm_and_ctrl_c_stop_the_stage_and_everything_it_started(tiny_verifier, tmp_path, reaper):
    run = make_run_dir(tmp_path / "run", cached_store(tiny_verifier, 300))
    # a finished earlier training: a forced re-run sets it aside, and an interrupted one must say where it is
    old = run / "train"
    (old / "final").mkdir(parents=True)
    (old / "final" / "model.safetensors").write_text("the earlier drafter")
    StageTimer(old, {"profile": "tiny"}).finish({"steps": 7})

    proc = _start(run, "--force")
    reaper(proc)
    started = _wait_for_checkpoint(run, proc)
    assert sum("eagle3lib.stages.train" in " ".join(p.cmdline()) for p in started) >= 2  # torchrun and its ranks
    t_signal = time.time()
    os.kill(proc.pid, signal.SIGTERM)  # the runner alone, as `timeout` sends it
    code, err, took = _stopped(proc, started, t_signal)
    assert code == 143 and took < 45, (code, took, err[-3000:])
    assert "interrupted by SIGTERM" in err and "Traceback" not in err, err[-3000:]
    aside = list(run.glob(".train.previous-*"))
    assert len(aside) == 1 and f"the previous outputs are kept in {aside[0]}" in err
    assert (aside[0] / "final" / "model.safetensors").read_text() == "the earlier drafter"
    m = json.loads((run / "train" / "manifest.json").read_text())
    assert m["status"] == "interrupted" and m["error"] == "stopped by SIGTERM"
    record = json.loads((run / "run.json").read_text())
    assert record["status"] == "interrupted" and record["stages"]["train"] == "interrupted"

    proc = _start(run)  # the same command without --force: resumes from the last checkpoint
    reaper(proc)
    started = _wait_for_checkpoint(run, proc)
    t_signal = time.time()
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the runner's whole process group
    code, err, took = _stopped(proc, started, t_signal)
    assert code == 130 and took < 45, (code, took, err[-3000:])
    assert "interrupted by SIGINT" in err and "Traceback" not in err, err[-3000:]
    log = (run / "train" / "train.log").read_text()
    assert "resuming from" in log, log[-2000:]
    assert json.loads((run / "train" / "manifest.json").read_text())["status"] == "interrupted"
