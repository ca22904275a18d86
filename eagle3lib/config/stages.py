"""The pipeline's stages, in order, and the context a stage notebook opens.

Each stage notebook has the same three parameters (`profile`, `run_dir`, `overrides`) and starts with
`ctx = open_notebook_stage("<name>", profile, run_dir, overrides)` (eagle3lib/pipeline/notebook_stage.py: finds a run
when opened without one), then this module's `open_stage`: the profile is validated there (so a notebook run by hand or
by papermill directly is checked too), and `ctx.cfg` is the stage's typed section.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3lib.config.contract import ScopedProfile, stage_params
from eagle3lib.config.profile import Profile, load_profile, parse_set
from eagle3lib.config.registry import STAGE_BY_NAME, STAGES, Stage
from eagle3lib.core.hints import did_you_mean
from eagle3lib.core.manifest import StageTimer
from eagle3lib.core.paths import NOTEBOOKS_DIR, REPO_ROOT


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

    def __post_init__(self) -> None:
        # the stage's code reads its own section and, of the others, what its registry row declares (an undeclared
        # read raises at the read: config/contract.py)
        if not isinstance(self.profile, ScopedProfile) or self.profile.stage is not self.stage:
            self.profile = ScopedProfile(getattr(self.profile, "unscoped", self.profile), self.stage)

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
        """What its manifest records as `params`: its own section and its declared reads (config/contract.py)."""
        return stage_params(self.profile, self.stage)

    def input_dir(self) -> Path | None:
        """The folder of the stage whose outputs it consumes (its row's input_stage), None without one."""
        return self.stage_dir(self.stage.input_stage) if self.stage.input_stage else None

    def rank_args(self, overrides: dict[str, Any] | None = None) -> list[str]:
        """The command line of each process the stage starts (`open_rank_stage` reads it back in that process)."""
        args = ["--profile", str(self.profile.path), "--run-dir", str(self.run_dir),
                "--overrides-json", json.dumps(overrides if overrides is not None else self.profile.overrides)]
        return args + (["--out-dir", str(self.out_dir)] if self.out_dir is not None else [])

    def timer(self) -> StageTimer:
        """The stage's StageTimer: running now, with the input id it starts from, its params recorded."""
        return StageTimer(self.dir, self.manifest_params(), input_dir=self.input_dir())


def open_stage(name: str, profile: str | Path, run_dir: str | Path, overrides: dict[str, Any] | None = None,
               say=print, out_dir: str | Path | None = None) -> StageContext:
    """The stage's context in `run_dir` (a notebook opened as it ships, without one, finds a run through
    eagle3lib/pipeline/notebook_stage.py)."""
    stage = get_stage(name)
    if not str(run_dir or "").strip():
        raise ValueError(f"the {name} stage needs a run directory (a notebook opened without one finds a run: "
                         "eagle3lib.pipeline.notebook_stage.open_notebook_stage)")
    prof = load_profile(profile, overrides)  # every section: stages read their neighbours (evaluate reads train.ttt_steps)
    run_dir = Path(run_dir)
    # Relative run dirs are relative to the repo, so a notebook opened in JupyterLab (cwd notebooks/) writes where the
    # CLI does. The runner always passes an absolute path.
    run_dir = (run_dir if run_dir.is_absolute() else REPO_ROOT / run_dir).resolve()
    ctx = StageContext(stage, prof, run_dir, Path(out_dir).resolve() if out_dir else None)
    ctx.dir.mkdir(parents=True, exist_ok=True)
    return ctx


def open_rank_stage(name: str, argv: list[str] | None, what: str) -> StageContext:
    """The context of one torchrun rank: the command line the stage's launcher passes to every process it starts,
    `python -m eagle3lib.stages.<name> --profile P --run-dir R [--overrides-json J] [--set k=v ...] [--out-dir D]`."""
    ap = argparse.ArgumentParser(prog=f"python -m eagle3lib.stages.{name}", description=f"{what} (one rank).")
    ap.add_argument("--profile", default="tiny")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--set", action="append", dest="sets", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--overrides-json", default="{}")
    ap.add_argument("--out-dir", default=None, help=f"write here instead of RUN_DIR/{name} (a data-scaling point)")
    a = ap.parse_args(argv)
    return open_stage(name, a.profile, a.run_dir, {**json.loads(a.overrides_json), **parse_set(a.sets)},
                      out_dir=a.out_dir)
