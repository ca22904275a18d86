"""The pipeline's stages, in order, and the context a stage notebook opens.

Each stage notebook has the same three parameters (`profile`, `run_dir`, `overrides`) and starts with
`ctx = open_stage("<name>", profile, run_dir, overrides)`: the profile is validated there (so a notebook run by hand or
by papermill directly is checked too), and `ctx.cfg` is the stage's typed section.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3lib.config.profile import Profile, load_profile
from eagle3lib.core.hints import did_you_mean
from eagle3lib.core.paths import NOTEBOOKS_DIR, REPO_ROOT


@dataclass(frozen=True)
class Stage:
    name: str  # run-directory subfolder and --stages name
    notebook: str  # file in notebooks/
    section: str  # profile section holding its parameters
    title: str  # one line for the index page
    always_run: bool = False  # analysis of other stages' outputs: re-run each time, since a skip would show stale curves
    needs: str = ""  # the input it reads from an earlier stage (relative to the run): how a notebook opened without a
    # run_dir finds a run to work on
    make: str = ""  # the command that makes that input, for the message when no run has it
    default: bool = True  # in a run without --stages; False: a stage that costs more than a first run should pay
    # (data_scaling trains the drafter once more per fraction), run by naming it (`make scaling`)
    headline: tuple[str, ...] = ()  # the figures the run index shows first (fnmatch patterns over the manifest's
    # figure names): what a reader opens the run for, not the first keys written


STAGES: tuple[Stage, ...] = (
    Stage("verifier", "00_verifier.ipynb", "verifier_report", "Verifier: what the drafter will imitate",
          headline=("model", "architecture", "attention", "parameters", "num_layers", "aux_layer_ids")),
    Stage("generate", "01_generate.ipynb", "generate", "Generate: the verifier's own responses",
          headline=("samples_ok", "samples_total", "samples_failed", "samples_truncated", "output_tokens",
                    "output_tokens_per_s")),
    Stage("extract", "02_extract.ipynb", "extract", "Extract: hidden states for training", needs="generate/manifest.json",
          make="--stages generate", headline=("samples", "tokens", "bytes", "tokens_per_s", "final_state_top1_agreement")),
    Stage("train", "03_train.ipynb", "train", "Train: the EAGLE-3 drafter", needs="extract/store.json",
          make="--stages generate,extract", headline=("steps", "best_val_tau_est", "val_tau_est", "final_loss",
                                                      "tokens_per_s", "drafter_layer", "stopped_early")),
    Stage("evaluate", "04_evaluate.ipynb", "evaluate", "Evaluate: measured acceptance length",
          needs="train/final/config.json", make="--stages generate,extract,train",
          headline=("tau_vllm_greedy", "tau_lib_greedy", "tau_vllm_sampled", "vllm_speedup", "tau_val_est", "ttt_steps",
                    "k_best_gpu_model")),
    Stage("data_scaling", "data_scaling.ipynb", "data_scaling", "Data scaling: how much data buys how much acceptance",
          needs="train/manifest.json", make="--stages generate,extract,train,evaluate", default=False,
          always_run=True,  # every point it has trained is reused: a rerun costs seconds, and never shows a stale fit
          headline=("ceiling_tau", "target_tau", "samples_needed", "tokens_needed", "points")),
    Stage("recipes", "recipes.ipynb", "recipes", "Recipes: which drafting recipe accepts most, served by vLLM",
          needs="extract/store.json", make="--stages generate,extract", default=False,
          always_run=True,  # every recipe it has trained and measured is reused: a rerun costs seconds
          headline=("best_recipe_*", "recipes", "tau_vllm_greedy_*")),
    Stage("learning_curves", "learning_curves.ipynb", "learning_curves", "Learning curves", always_run=True,
          needs="train/metrics.jsonl", make="--stages generate,extract,train",
          headline=("runs", "step", "best_val_tau_est", "val_tau_est", "loss", "eta_h")),
    Stage("cost_projection", "cost_projection.ipynb", "cost_projection", "Cost projection for the full run",
          always_run=True, needs="train/manifest.json", make="--stages generate,extract,train",
          headline=("samples", "*.total_usd", "*.total_hours", "total_disk_gb")),
    Stage("compare_runs", "compare_runs.ipynb", "compare_runs", "Compare runs side by side", always_run=True,
          needs="train/manifest.json", make="--stages generate,extract,train", headline=("runs", "*.tau_vllm_greedy")),
    Stage("deployment", "deployment.ipynb", "deployment", "Deployment: which K at which concurrency (a GPU model)",
          always_run=True, needs="evaluate/results.json", make="--stages generate,extract,train,evaluate",
          headline=("*.stops_paying_at", "*.best_k_c1", "*.speedup_c1", "cpu_model_over_measured_median",
                    "published_model_over_measured_median")),
)
RUNS_ENV = "EAGLE3LIB_RUNS_DIR"  # where notebooks opened without a run_dir look for runs (default: REPO_ROOT/runs)
FIXTURES = REPO_ROOT / "tests" / "fixtures" / "analysis"
# analysis notebooks opened before any run exists show the shipped fixtures (made by tests/fixtures/analysis/make_fixtures.py)
FIXTURE_OVERRIDES = {
    "learning_curves": {"learning_curves.sources": [str(FIXTURES / "run_a/train/metrics.jsonl"),
                                                    str(FIXTURES / "run_b/train/metrics.jsonl")]},
    "cost_projection": {"cost_projection.manifests_run_dir": str(FIXTURES / "manifests")},
    "compare_runs": {"compare_runs.runs": [str(FIXTURES / "manifests")]},
    # no run yet: the fixtures' evaluate results (a small concurrency grid measured on the demo's drafter)
    "deployment": {"deployment.results_run_dir": str(FIXTURES / "deployment")},
}
STAGE_BY_NAME = {s.name: s for s in STAGES}


def existing_stages() -> list[Stage]:
    """Stages whose notebook is in the repo (stages land one by one; the runner runs what exists)."""
    return [s for s in STAGES if (NOTEBOOKS_DIR / s.notebook).exists()]


def default_stages() -> list[Stage]:
    """What a run without --stages runs."""
    return [s for s in existing_stages() if s.default]


def get_stage(name: str) -> Stage:
    if name not in STAGE_BY_NAME:
        raise ValueError(f"unknown stage '{name}'{did_you_mean(name, STAGE_BY_NAME)}; stages: {', '.join(STAGE_BY_NAME)}")
    return STAGE_BY_NAME[name]


@dataclass
class StageContext:
    stage: Stage
    profile: Profile
    run_dir: Path
    out_dir: Path | None = None  # where it writes instead of RUN_DIR/<stage>/ (a data-scaling point's own train run)

    @property
    def dir(self) -> Path:
        """RUN_DIR/<stage>/: where this stage writes everything."""
        return self.out_dir or self.run_dir / self.stage.name

    @property
    def cfg(self) -> Any:
        return self.profile.section(self.stage.section)

    @property
    def verifier(self) -> Any:
        return self.profile.verifier

    def stage_dir(self, name: str) -> Path:
        """Another stage's folder in the same run (inputs come from earlier stages)."""
        return self.run_dir / get_stage(name).name

    def manifest_params(self) -> dict[str, Any]:
        return stage_params(self.profile, self.stage)


def stage_params(profile: Profile, stage: Stage) -> dict[str, Any]:
    """What a manifest records as a stage's parameters; the runner compares it to decide whether a rerun is stale."""
    params = {"profile": profile.name, stage.section: profile.section(stage.section).model_dump(mode="json")}
    if stage.section == "extract":  # what the store holds depends on it (tokens only when the trainer computes states)
        params["train.hidden_states"] = profile.section("train").hidden_states
    return params


def runs_root() -> Path:
    """Where runs live: $EAGLE3LIB_RUNS_DIR, else REPO_ROOT/runs."""
    return Path(os.environ.get(RUNS_ENV) or REPO_ROOT / "runs")


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


def open_stage(name: str, profile: str | Path, run_dir: str | Path | None, overrides: dict[str, Any] | None = None,
               say=print, out_dir: str | Path | None = None) -> StageContext:
    """The stage's context. `run_dir` "" or None: a run found by `find_run` (a notebook opened as it ships)."""
    stage = get_stage(name)
    if not run_dir:
        run_dir, extra = find_run(stage, say)
        overrides = {**extra, **(overrides or {})}
    prof = load_profile(profile, overrides)  # every section: stages read their neighbours (evaluate reads train.ttt_steps)
    run_dir = Path(run_dir)
    # Relative run dirs are relative to the repo, so a notebook opened in JupyterLab (cwd notebooks/) writes where the
    # CLI does. The runner always passes an absolute path.
    run_dir = (run_dir if run_dir.is_absolute() else REPO_ROOT / run_dir).resolve()
    ctx = StageContext(stage, prof, run_dir, Path(out_dir).resolve() if out_dir else None)
    ctx.dir.mkdir(parents=True, exist_ok=True)
    return ctx
