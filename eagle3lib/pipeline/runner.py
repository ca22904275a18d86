"""Run stage notebooks headlessly with papermill, in order, into a run directory.

Per stage, RUN_DIR/<stage>/ gets the executed notebook, its HTML rendering (report.html) and manifest.json; the stage's
own outputs land there too. A stage whose manifest says complete is skipped unless forced. The first failing stage stops
the run, naming the executed notebook that holds the traceback. RUN_DIR/index.html links every stage's report.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from eagle3lib.config.profile import load_profile
from eagle3lib.config.stages import Stage, existing_stages, get_stage, stage_params
from eagle3lib.core.manifest import now_iso, read_manifest, update_manifest
from eagle3lib.core.paths import NOTEBOOKS_DIR, REPO_ROOT
from eagle3lib.pipeline.index import write_index


class StageFailed(RuntimeError):
    pass


def _say(msg: str) -> None:
    print(f"[eagle3lib {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def render_html(nb_path: Path, html_path: Path) -> None:
    """Report-style HTML (outputs only) that can be shared without a Jupyter install."""
    import nbformat
    from nbconvert import HTMLExporter

    nb = nbformat.read(nb_path, as_version=4)
    body, _ = HTMLExporter(exclude_input=True, exclude_input_prompt=True, exclude_output_prompt=True).from_notebook_node(nb)
    html_path.write_text(body)


def _param_diff(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    diffs = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += _param_diff(a, b, f"{prefix}{key}.")
        elif a != b:
            diffs.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return diffs


def run_stage(stage: Stage, profile: str, run_dir: Path, overrides: dict[str, Any], expected_params: dict[str, Any]) -> None:
    import papermill as pm

    stage_dir = run_dir / stage.name
    stage_dir.mkdir(parents=True, exist_ok=True)
    out_nb = stage_dir / stage.notebook
    # Caches that vLLM/inductor would write under $HOME and /tmp go into the run, keeping it self-contained.
    os.environ.setdefault("VLLM_CACHE_ROOT", str(run_dir / ".cache" / "vllm"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(run_dir / ".cache" / "inductor"))
    t0 = time.time()
    error = None
    try:
        pm.execute_notebook(
            str(NOTEBOOKS_DIR / stage.notebook),
            str(out_nb),
            parameters={"profile": profile, "run_dir": str(run_dir), "overrides": overrides},
            cwd=str(REPO_ROOT),
            log_output=True,
            progress_bar=False,
            kernel_name="python3",
        )
    except pm.PapermillExecutionError as e:
        error = f"{e.ename}: {e.evalue}"
    except Exception as e:  # kernel died, notebook unreadable: still a stage failure with a clear message
        error = f"{type(e).__name__}: {e}"
    if out_nb.exists():
        try:
            render_html(out_nb, stage_dir / "report.html")
        except Exception as e:  # a broken rendering must not hide the stage's own result
            _say(f"{stage.name}: could not render HTML ({e})")
    fields = {"notebook": stage.notebook, "report": "report.html", "notebook_wall_s": round(time.time() - t0, 2)}
    if error is None:
        m = read_manifest(stage_dir) or {}
        if m.get("status") != "complete":
            error = f"notebook finished but {stage_dir / 'manifest.json'} does not say complete (status {m.get('status')!r})"
    if error is not None:
        update_manifest(stage_dir, status="failed", error=error, finished_at=now_iso(), params=expected_params, **fields)
        raise StageFailed(f"stage '{stage.name}' failed: {error}\n  traceback: {out_nb}\n  report:    {stage_dir / 'report.html'}")
    update_manifest(stage_dir, **fields)


# What each stage consumes: a stage finished before its input was re-made is stale.
INPUT_STAGE = {"extract": "generate", "train": "extract", "evaluate": "train"}


def stale_reason(run_dir: Path, name: str) -> str | None:
    """Why the complete stage `name` no longer matches its input (None if it does)."""
    upstream = INPUT_STAGE.get(name)
    mine = read_manifest(run_dir / name)
    theirs = read_manifest(run_dir / upstream) if upstream else None
    if not (mine and theirs and mine.get("started_at") and theirs.get("finished_at")):
        return None
    if datetime.fromisoformat(theirs["finished_at"]) > datetime.fromisoformat(mine["started_at"]):
        return f"{upstream} was re-run after it ({theirs['finished_at']})"
    return None


def run_pipeline(
    profile: str,
    run_dir: str | Path,
    stages: list[str] | None = None,
    overrides: dict[str, Any] | None = None,
    force: bool = False,
) -> Path:
    run_dir = Path(run_dir).resolve()
    overrides = overrides or {}
    selected = [get_stage(s) for s in stages] if stages else existing_stages()
    missing = [s.name for s in selected if not (NOTEBOOKS_DIR / s.notebook).exists()]
    if missing:
        raise ValueError(f"stage(s) {', '.join(missing)} have no notebook in {NOTEBOOKS_DIR}")
    # Validate every section before anything runs: a typo fails in a second, not after an hour of generation.
    prof = load_profile(profile, overrides)
    profile_arg = str(prof.path)
    run_dir.mkdir(parents=True, exist_ok=True)
    _say(f"profile {prof.name} ({prof.path}) -> {run_dir}; stages: {', '.join(s.name for s in selected)}")
    for i, stage in enumerate(selected, 1):
        expected = stage_params(prof, stage)
        if force and (run_dir / stage.name).exists():
            shutil.rmtree(run_dir / stage.name)  # --force means from scratch: resumable stages would otherwise resume
        m = read_manifest(run_dir / stage.name)
        stale = stale_reason(run_dir, stage.name)
        if stale and m and m.get("status") == "complete" and not stage.always_run:
            _say(f"[{i}/{len(selected)}] {stage.name}: {stale}: running it again from scratch")
            shutil.rmtree(run_dir / stage.name)
            m = None
        if m and m.get("status") == "complete" and not force and not stage.always_run:
            diffs = _param_diff(m.get("params", {}), expected)
            note = f" (parameters changed: {'; '.join(diffs)}; use --force to re-run)" if diffs else ""
            _say(f"[{i}/{len(selected)}] {stage.name}: complete, skipped{note}")
            continue
        _say(f"[{i}/{len(selected)}] {stage.name}: running {stage.notebook}")
        t0 = time.time()
        try:
            run_stage(stage, profile_arg, run_dir, overrides, expected)
        finally:
            write_index(run_dir)
        _say(f"[{i}/{len(selected)}] {stage.name}: complete in {time.time() - t0:.0f} s")
    index = write_index(run_dir)
    _say(f"done: {index}")
    return index
