"""Run stage notebooks headlessly with papermill, in order, into a run directory (RUN_DIR/run.json records the run:
each stage's seconds or "skipped", the shared verifier server's start-up, the status).

Per stage, RUN_DIR/<stage>/ gets the executed notebook, its HTML rendering (report.html) and manifest.json; the stage's
own outputs land there too. A stage whose manifest says complete is skipped unless forced. The first failing stage stops
the run, naming the executed notebook that holds the traceback. RUN_DIR/index.html links every stage's report.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from eagle3lib.config.contract import stage_params
from eagle3lib.config.profile import Profile, load_profile
from eagle3lib.config.stages import STAGES, Stage, default_stages, existing_stages, get_stage
from eagle3lib.core.atomic import write_json_atomic
from eagle3lib.core.manifest import now_iso, read_manifest, update_manifest
from eagle3lib.core.paths import NOTEBOOKS_DIR, REPO_ROOT
from eagle3lib.core.progress import HEADLESS_ENV
from eagle3lib.core.stage_lock import stage_lock
from eagle3lib.core.stop import Interrupted, signals_interrupt, stop_children, wait_thread
from eagle3lib.pipeline.index import write_index
from eagle3lib.pipeline.kernel import ipc_kernel_manager
from eagle3lib.pipeline.plan import decide, plan
from eagle3lib.pipeline.preflight import preflight
from eagle3lib.pipeline.shared_server import SharedServer, SharedServerError


class StageFailed(RuntimeError):
    pass


def _say(msg: str) -> None:
    print(f"[eagle3lib {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def render_html(nb_path: Path, html_path: Path, run_dir: Path) -> None:
    """Report-style HTML (outputs only) that can be shared without a Jupyter install: paths shown relative to the run
    (or the repository), whichever stream printed them (a stage's stderr lines, a torchrun child's output)."""
    import nbformat
    from nbconvert import HTMLExporter

    from eagle3lib.reports.tables import relative_text

    nb = nbformat.read(nb_path, as_version=4)
    # A library's own tqdm.auto bar (transformers' "Loading weights") is an ipywidget in a kernel: its saved state makes
    # nbconvert add a loader that fetches the widget renderer from unpkg.com; a report shows no live widgets. Dropped.
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        if cell.get("outputs"):
            cell.outputs = [o for o in cell.outputs if WIDGET_VIEW not in o.get("data", {})]
    body, _ = HTMLExporter(exclude_input=True, exclude_input_prompt=True, exclude_output_prompt=True).from_notebook_node(nb)
    # the template loads require.js and MathJax from a CDN; a report has no code to run, and must open offline
    body = re.sub(r'<script[^>]*\ssrc="https?://[^"]*"[^>]*>\s*</script>', "", body)
    html_path.write_text(relative_text(body, run_dir.resolve(), run_dir.absolute(), REPO_ROOT))


def run_stage(stage: Stage, profile: str, run_dir: Path, overrides: dict[str, Any], expected_params: dict[str, Any]) -> None:
    import papermill as pm

    stage_dir = run_dir / stage.name
    stage_dir.mkdir(parents=True, exist_ok=True)
    out_nb = stage_dir / stage.notebook
    # Caches that vLLM/inductor would write under $HOME and /tmp go into the run, keeping it self-contained.
    os.environ.setdefault("VLLM_CACHE_ROOT", str(run_dir / ".cache" / "vllm"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(run_dir / ".cache" / "inductor"))
    os.environ[HEADLESS_ENV] = "1"  # progress bars print one summary line each into the report
    t0 = time.time()
    error = None
    outcome: list[BaseException] = []

    def execute() -> None:
        try:
            with tempfile.TemporaryDirectory(prefix="eagle3lib-kernel-") as sockets:
                pm.execute_notebook(
                    str(NOTEBOOKS_DIR / stage.notebook),
                    str(out_nb),
                    parameters={"profile": profile, "run_dir": str(run_dir), "overrides": overrides},
                    cwd=str(REPO_ROOT),
                    log_output=True,
                    progress_bar=False,
                    kernel_name="python3",
                    kernel_manager_class=ipc_kernel_manager(sockets),
                )
        except BaseException as e:
            outcome.append(e)

    # In a thread: nbclient then leaves the signal handlers alone (it installs its own only in the main thread), and
    # Ctrl-C / SIGTERM reach the runner's (core/stop.py), which stops the kernel and everything it started.
    worker = threading.Thread(target=execute, name=f"stage-{stage.name}", daemon=True)
    worker.start()
    try:
        wait_thread(worker)
    except Interrupted as e:
        _say(f"{stage.name}: {e.name}: stopping the stage (kernel, ranks, servers)")
        killed = stop_children()
        worker.join(30)
        update_manifest(stage_dir, status="interrupted", error=f"stopped by {e.name}", finished_at=now_iso(),
                        notebook_wall_s=round(time.time() - t0, 2), killed_pids=killed or None)
        raise
    if outcome:
        e = outcome[0]
        if isinstance(e, pm.PapermillExecutionError):
            error = f"{e.ename}: {e.evalue}"
        elif isinstance(e, Exception):  # kernel died, notebook unreadable: still a stage failure with a clear message
            error = f"{type(e).__name__}: {e}"
        else:
            raise e
    if out_nb.exists():
        try:
            render_html(out_nb, stage_dir / "report.html", run_dir)
        except Exception as e:  # a broken rendering must not hide the stage's own result
            _say(f"{stage.name}: could not render HTML ({e})")
    fields = {"notebook": stage.notebook, "report": "report.html", "notebook_wall_s": round(time.time() - t0, 2)}
    if error is None:
        m = read_manifest(stage_dir) or {}
        if m.get("status") != "complete":
            error = f"notebook finished but {stage_dir / 'manifest.json'} does not say complete (status {m.get('status')!r})"
    if error is not None:
        try:
            update_manifest(stage_dir, status="failed", error=error, finished_at=now_iso(), params=expected_params,
                            **fields)
        except OSError as e:  # a full disk (saving the notebook failed too): the stage's own "complete" must not stand
            if (stage_dir / "manifest.json").exists():  # beside a truncated notebook; a rename needs no space
                os.replace(stage_dir / "manifest.json", stage_dir / "manifest.unconfirmed.json")
            error += f"; the manifest could not be marked failed ({e.strerror}): renamed manifest.unconfirmed.json"
        raise StageFailed(f"stage '{stage.name}' failed: {error}\n  traceback: {out_nb}\n  report:    {stage_dir / 'report.html'}")
    update_manifest(stage_dir, **fields)


SCRATCH_DIRS = {".vllm-cache", ".inductor-cache", "vllm-hidden-scratch"}


def produced_outputs(stage_dir: Path, bookkeeping: frozenset[str]) -> list[Path]:
    """Files of a stage folder that are results (shards, checkpoints, metrics, measurements), not the files its row
    calls bookkeeping (written by every attempt before any result)."""
    out = []
    for p in stage_dir.rglob("*"):
        if not p.is_file() or SCRATCH_DIRS & set(p.relative_to(stage_dir).parts):
            continue
        if p.name in bookkeeping or p.suffix in (".ipynb", ".log") or p.stat().st_size == 0:
            continue
        out.append(p)
    return out


class _SetAside:
    """A stage folder moved out of the way before a from-scratch run (`--force`, or a stale stage): deleted once the
    new run completes, moved back if the new run fails before producing results of its own, kept (and named) if it
    failed after producing some. Nothing finished is deleted before its replacement exists."""

    def __init__(self, stage_dir: Path, bookkeeping: frozenset[str]):
        self.stage_dir, self.bookkeeping = stage_dir, bookkeeping
        self.aside: Path | None = None
        if stage_dir.exists():
            self.aside = stage_dir.parent / f".{stage_dir.name}.previous-{time.strftime('%Y%m%d-%H%M%S')}"
            os.replace(stage_dir, self.aside)

    def completed(self) -> None:
        if self.aside is not None:
            shutil.rmtree(self.aside, ignore_errors=True)

    def failed(self) -> str:
        if self.aside is None:
            return ""
        if self.stage_dir.exists() and produced_outputs(self.stage_dir, self.bookkeeping):
            return f"; the previous outputs are kept in {self.aside}"
        shutil.rmtree(self.stage_dir, ignore_errors=True)
        os.replace(self.aside, self.stage_dir)
        return f"; the previous outputs of {self.stage_dir.name} were restored"


def check_run_dir(run_dir: Path) -> None:
    """The run directory exists (or can be made) and is writable; else a clear error before anything runs."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"--run-dir {run_dir}: exists and is not a directory")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"--run-dir {run_dir}: cannot write there ({e.strerror or e})") from None


def select_stages(stages: list[str] | None) -> list[Stage]:
    """--stages as the stages to run: in pipeline order whatever order it gives (each stage reads the ones before
    it), each once; None = the default stages."""
    if stages is None:
        return default_stages()
    twice = sorted({s for s in stages if stages.count(s) > 1})
    if twice:
        raise ValueError(f"--stages lists {', '.join(twice)} more than once")
    selected = sorted((get_stage(s) for s in stages), key=STAGES.index)
    if not selected:
        raise ValueError("--stages: no stage given (stages: " + ", ".join(s.name for s in existing_stages()) + ")")
    return selected


def run_pipeline(
    profile: str,
    run_dir: str | Path,
    stages: list[str] | None = None,
    overrides: dict[str, Any] | None = None,
    force: bool = False,
    dry_run: bool = False,
) -> Path | None:
    """Run the selected stages into `run_dir`; returns its index.html. `dry_run`: print what each stage would do and
    why (pipeline/plan.py), touch nothing, return None."""
    if not str(run_dir).strip():  # Path("") is the current folder: from the repository root, the checkout itself
        raise ValueError("--run-dir is empty: name the folder every stage writes to (e.g. runs/demo)")
    run_dir = Path(run_dir).resolve()
    overrides = overrides or {}
    selected = select_stages(stages)
    missing = [s.name for s in selected if not (NOTEBOOKS_DIR / s.notebook).exists()]
    if missing:
        raise ValueError(f"stage(s) {', '.join(missing)} have no notebook in {NOTEBOOKS_DIR}")
    # Validate every section before anything runs: a typo fails in a second, not after an hour of generation.
    prof = load_profile(profile, overrides)
    profile_arg = str(prof.path)
    decisions = plan(selected, run_dir, prof, force)
    if dry_run:
        print(f"profile {prof.name} ({prof.path}) -> {run_dir}: what a run would do")
        for stage, d in decisions:
            print(d.line(stage.name))
        return None
    will_run = [s.name for s, d in decisions if d.action != "skip"]
    preflight(prof, will_run)  # against the verifier's own config, before any server starts or folder is made
    check_run_dir(run_dir)
    _say(f"profile {prof.name} ({prof.path}) -> {run_dir}; stages: {', '.join(s.name for s in selected)}")
    shared = SharedServer(prof, run_dir, will_run, say=_say)
    record: dict[str, Any] = {"profile": prof.name, "started_at": now_iso(), "stages": {}, "status": "running"}
    t_run = time.time()
    try:
        with signals_interrupt(_say):
            for i, stage in enumerate(selected, 1):
                t0 = time.time()
                record["stages"][stage.name] = "running"
                record["stages"][stage.name] = _run_one(i, stage, selected, prof, profile_arg, run_dir, overrides,
                                                        force, shared) or round(time.time() - t0, 1)
            record["status"] = "complete"
    except Interrupted as e:
        record["status"], record["error"] = "interrupted", f"stopped by {e.name}"
        record["stages"] = {k: ("interrupted" if v == "running" else v) for k, v in record["stages"].items()}
        raise
    except BaseException as e:
        record["status"], record["error"] = "failed", f"{type(e).__name__}: {e}"
        raise
    finally:
        shared.stop()
        record.update(finished_at=now_iso(), wall_s=round(time.time() - t_run, 1), shared_server_start_s=shared.start_s)
        write_json_atomic(run_dir / "run.json", record)
    index = write_index(run_dir)
    _say(f"done: {index}")
    return index


def _run_one(i: int, stage: Stage, selected: list[Stage], prof: Profile, profile_arg: str, run_dir: Path,
             overrides: dict[str, Any], force: bool, shared: SharedServer) -> str | None:
    """Run (or skip) one stage; returns "skipped" when it was skipped."""
    with stage_lock(run_dir, stage.name):
        return _run_locked(i, stage, selected, prof, profile_arg, run_dir, overrides, force, shared)


def _run_locked(i: int, stage: Stage, selected: list[Stage], prof: Profile, profile_arg: str, run_dir: Path,
                overrides: dict[str, Any], force: bool, shared: SharedServer) -> str | None:
    expected = stage_params(prof, stage)
    stage_dir = run_dir / stage.name
    check_writable(stage_dir)
    d = decide(stage, run_dir, prof, force)  # a damaged manifest raises here, naming it (unless forced)
    from_scratch, repaired = None, None
    step = f"[{i}/{len(selected)}] {stage.name}"
    if d.action == "skip":
        _say(f"{step}: complete, skipped")
        return "skipped"
    if d.action == "again":  # from scratch: resumable stages would otherwise resume
        if not force:
            _say(f"{step}: {d.why}: running it again from scratch")
        from_scratch = _SetAside(stage_dir, stage.bookkeeping)
    elif d.action == "repair":
        # resumed, not redone: the stage sets what is damaged aside and makes only what is missing again. A store's
        # repair makes the same data again (the same states of the same records): the stages after it keep theirs.
        # Others (a regenerated shard, a drafter trained again) are new outputs for the stages after.
        _say(f"{step}: {d.why}")
        repaired = read_manifest(stage_dir) if stage.store else None
    _say(f"[{i}/{len(selected)}] {stage.name}: running {stage.notebook}")
    t0 = time.time()
    try:
        try:
            shared.before(stage.name)
        except SharedServerError as e:
            raise StageFailed(str(e)) from None
        run_stage(stage, profile_arg, run_dir, overrides, expected)
        shared.after(stage.name)
    except StageFailed as e:
        if from_scratch is not None:
            raise StageFailed(f"{e}{from_scratch.failed()}") from None
        raise
    except BaseException as e:
        why = f" by {e.name}" if isinstance(e, Interrupted) else ""
        _say(f"{stage.name}: interrupted{why}{from_scratch.failed() if from_scratch is not None else ''}")
        raise
    finally:
        write_index(run_dir)
    if from_scratch is not None:
        from_scratch.completed()
    if repaired is not None:
        keep_data_time(stage_dir, repaired)
    _say(f"[{i}/{len(selected)}] {stage.name}: complete in {time.time() - t0:.0f} s")


def check_writable(stage_dir: Path) -> None:
    """A stage folder the stage cannot write to (read-only permissions, an immutable folder, a read-only mount) fails
    here, naming it, instead of in a traceback from the stage's first write. A probe file, not os.access: root passes
    os.access on read-only permissions and mounts alike."""
    if stage_dir.exists() and not stage_dir.is_dir():
        raise ValueError(f"{stage_dir}: a file where the stage's folder belongs; move it away (nothing was run)")
    if not stage_dir.is_dir():
        return

    try:
        with tempfile.TemporaryFile(dir=stage_dir):
            pass
    except OSError as e:
        raise ValueError(f"{stage_dir}: the stage cannot write to its folder ({e.strerror}); make it writable "
                         f"(chmod -R u+w {stage_dir}) or use another --run-dir") from None


def keep_data_time(stage_dir: Path, before: dict[str, Any]) -> None:
    """After a repair (the damaged part made again from the same inputs) the stage's data is what it was: its output
    id and completion time stay the original ones, so the stages downstream are not counted stale and redone."""
    kept = {k: before[k] for k in ("output_id", "completed_at") if before.get(k)}
    if kept:
        update_manifest(stage_dir, **kept, repaired_at=now_iso())
