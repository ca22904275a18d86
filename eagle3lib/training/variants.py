"""A drafter trained again beside the run's own: the train stage's settings plus some overrides, in a folder of its
own (a data-scaling fraction, a drafting recipe). Resumable like any train run, reused when it finished with the same
settings, started over when the folder holds another recipe's run."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from eagle3lib.config.stages import StageContext, open_stage
from eagle3lib.config.train import TrainConfig
from eagle3lib.core.manifest import read_manifest
from eagle3lib.training.launch import launch

# train settings that do not change the drafter a run trains (TrainConfig.OPERATIONAL): a train stage that also
# logged to TensorBoard, or checkpointed more often, trains the same drafter
BOOKKEEPING = TrainConfig.OPERATIONAL


# what a variant does not inherit from the run's own training: it neither logs to the run's trackers nor writes the
# other checkpoint layouts (bookkeeping above: still the same recipe)
QUIET = {"train.report_to": [], "train.export_layouts": []}


def recipe_of(params: dict[str, Any] | None, ignore: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The train settings of a manifest's params that decide the drafter. A setting the manifest lacks (added to the
    train section after that run) reads as its default: the run trained with what the default does."""
    train = {**TrainConfig().model_dump(mode="json"), **((params or {}).get("train") or {})}
    return {k: v for k, v in train.items() if k not in BOOKKEEPING | ignore}


def finished_with(train_dir: Path, params: dict[str, Any], ignore: frozenset[str] = frozenset()) -> dict[str, Any] | None:
    """train_dir's manifest when it is a complete run of the same profile and recipe, else None."""
    m = read_manifest(train_dir)
    ok = m and m.get("status") == "complete" and m.get("params", {}).get("profile") == params.get("profile")
    return m if ok and recipe_of(m.get("params"), ignore) == recipe_of(params, ignore) else None


def outcome_lines(echo):
    """A variant's console: how its training ended, not every step (the report stays readable; the step lines are in
    its metrics.jsonl)."""
    keep = ("] done:", "best validation", "best served probe", "train.patience", "rror", "resuming from")
    return lambda line: echo(line) if any(k in line for k in keep) else None


def train_variant(ctx: StageContext, out: Path, over: dict[str, Any], what: str,
                  echo=print) -> tuple[dict[str, Any], bool]:
    """(manifest, reused) of the train stage run in `out` with the profile's overrides plus `over`; `what` names it in
    the console line. `out` must be inside the calling stage's own folder: a variant's folder may be deleted (another
    recipe's run there), and a recipe once named "../train" deleted the run's own training."""
    if ctx.dir.resolve() not in out.resolve().parents:
        raise ValueError(f"{what}: its folder {out} is not inside {ctx.dir} (a recipe or fraction name must not be a "
                         "path)")
    tctx = open_stage("train", ctx.profile.path, ctx.run_dir, {**ctx.profile.overrides, **over}, say=lambda _m: None,
                      out_dir=out)
    if m := finished_with(out, tctx.manifest_params()):
        return m, True
    old = read_manifest(out)
    if old and recipe_of(old.get("params")) != recipe_of(tctx.manifest_params()):  # another recipe: not resumed
        shutil.rmtree(out)
        out.mkdir(parents=True)
    echo(f"{ctx.stage.name}: training {what} ({out.relative_to(ctx.run_dir)}/)")
    return launch(tctx, echo=outcome_lines(echo)), False
