"""A stage notebook opened as it ships, in JupyterLab, without a run directory: it finds a run to work on.

    ctx = open_notebook_stage("train", profile, run_dir, overrides)   # the first code cell of every stage notebook

With a run directory (the runner always passes one) this is `config.stages.open_stage`. Without one: the newest run
under runs/ ($EAGLE3LIB_RUNS_DIR) that has the stage's input, else, for the analysis notebooks, the fixtures shipped
in tests/fixtures/analysis (made by tests/fixtures/analysis/make_fixtures.py), else runs/interactive; a stage whose
input no run has says which command makes it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3lib.config.registry import Stage
from eagle3lib.config.stages import StageContext, get_stage, open_stage
from eagle3lib.core.paths import REPO_ROOT, runs_root

FIXTURES = REPO_ROOT / "tests" / "fixtures" / "analysis"
# analysis notebooks opened before any run exists show the shipped fixtures
FIXTURE_OVERRIDES = {
    "learning_curves": {"learning_curves.sources": [str(FIXTURES / "run_a/train/metrics.jsonl"),
                                                    str(FIXTURES / "run_b/train/metrics.jsonl")]},
    "cost_projection": {"cost_projection.manifests_run_dir": str(FIXTURES / "manifests")},
    "compare_runs": {"compare_runs.runs": [str(FIXTURES / "manifests")]},
    # no run yet: the fixtures' evaluate results (a small concurrency grid measured on the demo's drafter)
    "deployment": {"deployment.results_run_dir": str(FIXTURES / "deployment")},
}


def find_run(stage: Stage, say=print) -> tuple[Path, dict[str, Any]]:
    """A run for a notebook opened without a run_dir: the newest run under runs/ that has the stage's input (or any
    run, for stages without one), else the shipped fixtures (analysis notebooks) or runs/interactive. Says which;
    raises naming the command that makes the input when a stage has nothing to read. Returns (run_dir, overrides)."""
    root = runs_root()
    runs = [d for d in root.iterdir() if d.is_dir() and not d.name.startswith(".")] if root.is_dir() else []
    with_input = [d for d in runs if not stage.needs or (d / stage.needs).exists()]
    if with_input:  # newest by the input's own time: the run whose earlier stage finished last
        run = max(with_input, key=lambda d: (d / stage.needs if stage.needs else d).stat().st_mtime)
        why = f"the newest run under runs/ with {stage.needs}" if stage.needs else "the newest run under runs/"
        say(f"run_dir: runs/{run.name} ({why}; set run_dir to choose another)")
        return run, {}
    interactive = root / "interactive"
    if stage.name in FIXTURE_OVERRIDES:
        say(f"run_dir: runs/interactive; no run under runs/ has {stage.needs} yet, so this shows the shipped fixtures "
            f"({FIXTURES.relative_to(REPO_ROOT)}); `make demo` makes a real run")
        return interactive, FIXTURE_OVERRIDES[stage.name]
    if stage.needs:
        raise ValueError(f"no run under runs/ has {stage.needs}, which the {stage.name} stage reads; make one with "
                         f"`python -m eagle3lib run --profile tiny --run-dir runs/interactive {stage.make}` (or `make "
                         "demo`), or set run_dir to a run that has it")
    say("run_dir: runs/interactive (no run under runs/ yet)")
    return interactive, {}


def open_notebook_stage(name: str, profile: str | Path, run_dir: str | Path | None,
                        overrides: dict[str, Any] | None = None, say=print) -> StageContext:
    """The stage's context for its notebook: in `run_dir`, or ("" / None) in a run found by `find_run`."""
    if not run_dir:
        run_dir, extra = find_run(get_stage(name), say)
        overrides = {**extra, **(overrides or {})}
    return open_stage(name, profile, run_dir, overrides, say=say)
