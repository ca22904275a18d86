"""The end of a training run: the last step checkpoint (with resume state, so a longer rerun continues), final/ (the
vLLM-loadable drafter) and the layouts train.export_layouts asks for, the figures and the manifest."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from eagle3lib.core.manifest import completion, update_manifest
from eagle3lib.model.checkpoint import save_drafter
from eagle3lib.training import distributed as dist
from eagle3lib.training.best import SELECTION
from eagle3lib.training.checkpoints import save_step
from eagle3lib.training.figures import run_figures
from eagle3lib.training.metrics import read_metrics
from eagle3lib.training.states import states_figures

if TYPE_CHECKING:
    from eagle3lib.training.loop import Trainer


def finish(t: Trainer, log: Callable[[str], None]) -> dict[str, Any]:
    """Final checkpoint (with resume state, so a longer rerun continues), the vLLM-loadable export, the figures."""
    cfg = t.cfg
    if t.saved_step != t.progress.step:
        t.last_ckpt = save_step(t, t.progress.step)  # the last step (or where train.patience stopped)
    state = dist.model_state(t.module)
    online = states_figures(t.states, lambda x: dist.all_reduce_(x.to(t.device)).cpu()) if t.states else {}
    if t.rank != 0:
        return {}
    final_dir = save_drafter(state, t.dcfg, t.out_dir / "final")
    exports = {f"checkpoint_{lay}": save_drafter(state, t.dcfg, t.out_dir / f"final-{lay}", layout=lay).name
               for lay in cfg.export_layouts}
    last_train, last_val, best_val = t.last_train, t.last_val, t.best_val
    if not last_train or not last_val or (t.best.step and best_val is None):  # resumed: the records are in the file
        recs = read_metrics(t.out_dir / "metrics.jsonl")
        last_train = last_train or next((r for r in reversed(recs) if r.get("kind") == "train"), {})
        last_val = last_val or next((r for r in reversed(recs) if r.get("kind") == "val"), {})
        best_val = best_val or next((r for r in recs if r.get("kind") == "val" and r["step"] == t.best.step), {})
    figures = {**run_figures(t, last_train, last_val, best_val), "hidden_states": cfg.hidden_states, **online,
               "memory_model_gb": t.memory_model_gb}
    outputs = {"checkpoint": str(final_dir.relative_to(t.out_dir)), "metrics": "metrics.jsonl",
               "draft_vocab": "draft_vocab.safetensors",
               "last_step_checkpoint": str(t.last_ckpt.relative_to(t.out_dir))}
    if t.best.step and (t.out_dir / "best" / SELECTION).exists():
        outputs["best"] = "best"
    outputs.update({**exports, **t.trackers.outputs()})
    t.trackers.summary(figures, t.progress.step)
    if t.trackers.errors:
        figures["tracker_errors"] = len(t.trackers.errors)
    m = (t.timer.finish(figures, outputs) if t.timer else
         update_manifest(t.out_dir, **completion(figures=figures, outputs=outputs)))
    update_manifest(t.out_dir, resume_from=None, error=None, tracker_errors=t.trackers.errors or None)
    log(f"done: {t.progress.step} steps, tau_est {figures['tau_est']}, val_tau_est {figures['val_tau_est']}; "
        f"checkpoint {final_dir.name}/")
    if t.best.step:
        what = "validation" if t.best.by == "estimate" else "served probe"
        log(f"best {what}: step {t.best.step} (epoch {t.best.epoch:.2f}), {t.best.score_name.removeprefix('best_')} "
            f"{t.best.val_tau_est:.3f}: train/best/" + (
                "; still improving at the last validation: more epochs or more data may raise it further"
                if t.best.still_improving else ""))
    return m
