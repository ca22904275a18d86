"""The pipeline's stages, in order, and the context a stage notebook opens.

Each stage notebook has the same three parameters (`profile`, `run_dir`, `overrides`) and starts with
`ctx = open_stage("<name>", profile, run_dir, overrides)`: the profile is validated there (so a notebook run by hand or
by papermill directly is checked too), and `ctx.cfg` is the stage's typed section.
"""

from __future__ import annotations

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


STAGES: tuple[Stage, ...] = (
    Stage("verifier", "00_verifier.ipynb", "verifier_report", "Verifier: what the drafter will imitate"),
    Stage("generate", "01_generate.ipynb", "generate", "Generate: the verifier's own responses"),
    Stage("extract", "02_extract.ipynb", "extract", "Extract: hidden states for training"),
    Stage("train", "03_train.ipynb", "train", "Train: the EAGLE-3 drafter"),
    Stage("evaluate", "04_evaluate.ipynb", "evaluate", "Evaluate: measured acceptance length"),
    Stage("learning_curves", "learning_curves.ipynb", "learning_curves", "Learning curves", always_run=True),
    Stage("cost_projection", "cost_projection.ipynb", "cost_projection", "Cost projection for the full run", always_run=True),
)
STAGE_BY_NAME = {s.name: s for s in STAGES}


def existing_stages() -> list[Stage]:
    """Stages whose notebook is in the repo (stages land one by one; the runner runs what exists)."""
    return [s for s in STAGES if (NOTEBOOKS_DIR / s.notebook).exists()]


def get_stage(name: str) -> Stage:
    if name not in STAGE_BY_NAME:
        raise ValueError(f"unknown stage '{name}'{did_you_mean(name, STAGE_BY_NAME)}; stages: {', '.join(STAGE_BY_NAME)}")
    return STAGE_BY_NAME[name]


@dataclass
class StageContext:
    stage: Stage
    profile: Profile
    run_dir: Path

    @property
    def dir(self) -> Path:
        """RUN_DIR/<stage>/: where this stage writes everything."""
        return self.run_dir / self.stage.name

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
    return {"profile": profile.name, stage.section: profile.section(stage.section).model_dump(mode="json")}


def open_stage(name: str, profile: str | Path, run_dir: str | Path, overrides: dict[str, Any] | None = None) -> StageContext:
    stage = get_stage(name)
    prof = load_profile(profile, overrides)  # every section: stages read their neighbours (evaluate reads train.ttt_steps)
    run_dir = Path(run_dir)
    # Relative run dirs are relative to the repo, so a notebook opened in JupyterLab (cwd notebooks/) writes where the
    # CLI does. The runner always passes an absolute path.
    run_dir = (run_dir if run_dir.is_absolute() else REPO_ROOT / run_dir).resolve()
    (run_dir / stage.name).mkdir(parents=True, exist_ok=True)
    return StageContext(stage, prof, run_dir)
