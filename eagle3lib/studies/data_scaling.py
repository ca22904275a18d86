"""The data-scaling study (the data_scaling stage's engine; its entry: eagle3lib/stages/data_scaling.py): how much data
buys how much acceptance, and what a target acceptance costs.

For each of `data_scaling.fractions` the drafter is trained again with the train stage's recipe on that nested share
of the training split (train.train_fraction; the held-out split is the same for all), in
RUN_DIR/data_scaling/fraction-<f>/ (a complete train run each: resumable, skipped when done with the same settings).
Each point is scored by its estimated tau at the validation chosen on the other half of the validation samples
(cross-fitted, eagle3lib/analysis/scaling_points.py: the best of many validations scored on the samples that chose
it is biased upward), with a standard error and the curve's band from resampling the validation samples; the largest
`vllm_points` also by vLLM. The curve (eagle3lib/analysis/scaling.py) is fitted to the estimates, since every point
has one and they share one held-out split, and inverted for the target tau, whose cost on every hardware row is the
cost_projection section's model with the samples the curve asks for. A run trained before per-sample counts were
kept (no train/val_samples.jsonl) is scored as before, by its best validation, and says so (`scored_on`).

Outputs in RUN_DIR/data_scaling/: fit.json (points, curve, band, target, cost), cost_for_target.csv, manifest.json.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np

from eagle3lib.analysis.scaling import ScalingFit, explain, fit_scaling, tau_standard_error
from eagle3lib.analysis.scaling_points import load_counts, score_points
from eagle3lib.config.stages import StageContext, open_stage
from eagle3lib.core.atomic import write_json_atomic, write_text_atomic
from eagle3lib.core.manifest import StageTimer, read_manifest, timed_stage
from eagle3lib.evaluation.inputs import best_is_chosen
from eagle3lib.training.metrics import read_metrics
from eagle3lib.training.variants import QUIET, finished_with, train_variant


class DataScalingError(RuntimeError):
    pass


def _point_overrides(ctx: StageContext, fraction: float) -> dict[str, Any]:
    cfg, tcfg = ctx.cfg, ctx.profile.section("train")
    epochs = (cfg.epochs or tcfg.epochs) / (fraction if cfg.schedule == "steps" else 1.0)
    return {"train.train_fraction": fraction, "train.epochs": epochs,
            "train.patience": cfg.patience, **QUIET}


def point_dir(ctx: StageContext, fraction: float) -> Path:
    """RUN_DIR/data_scaling/fraction-<f>/: a fraction's own train run, and its vLLM measurement."""
    return ctx.dir / f"fraction-{fraction:g}"


def train_point(ctx: StageContext, fraction: float, echo=print) -> tuple[Path, dict[str, Any], bool]:
    """(train folder, its manifest, reused) of one fraction: the train stage's own run for 1.0 when it ran with the
    same settings, a finished point from an earlier run of this stage, or a new (or resumed) training run."""
    over = _point_overrides(ctx, fraction)
    own = open_stage("train", ctx.profile.path, ctx.run_dir, {**ctx.profile.overrides, **over}, say=lambda _m: None)
    # patience only ends a run sooner: the train stage's full-length run scored every validation a patient one would
    if fraction == 1.0 and (m := finished_with(ctx.stage_dir("train"), own.manifest_params(), frozenset({"patience"}))):
        return ctx.stage_dir("train"), m, True
    out = point_dir(ctx, fraction)
    m, reused = train_variant(ctx, out, over, f"on {fraction:g} of the training split", echo)
    return out, m, reused


def _point(ctx: StageContext, fraction: float, train_dir: Path, m: dict[str, Any], reused: bool,
           k: int) -> dict[str, Any]:
    f, outs = m["figures"], m.get("outputs") or {}
    best_step = f.get("best_step")
    vals = [r for r in read_metrics(train_dir / "metrics.jsonl") if r.get("kind") == "val"]
    best_rec = next((r for r in vals if r["step"] == best_step), vals[-1] if vals else {})
    ckpt = train_dir / (outs["best"] if best_is_chosen(m) else outs["checkpoint"])  # the drafter evaluate measures
    return {"fraction": fraction, "dir": str(train_dir.relative_to(ctx.run_dir)),
            "checkpoint": str(ckpt.relative_to(ctx.run_dir)), "reused": reused,
            "train_samples": f["train_samples"], "train_tokens": f.get("train_tokens") or f["tokens_seen"] / f["epochs"],
            "steps": f["steps"], "epochs": f["epochs"], "train_s": f.get("train_s"),
            "val_tau_est": f.get("best_val_tau_est") or f.get("val_tau_est"),
            "val_tau_se": tau_standard_error(best_rec, k, best_rec.get("positions") or best_rec.get("tokens") or 1),
            "best_step": best_step, "still_improving": f.get("still_improving"), "tau_vllm_greedy": None,
            "scored_on": "the best validation, on the samples that chose it"}


def _data_rates(ctx: StageContext) -> dict[str, float]:
    """Samples per second of this run's generate and extract stages (those that measured one)."""
    out = {}
    for stage in ("generate", "extract"):
        rate = ((read_manifest(ctx.stage_dir(stage)) or {}).get("figures") or {}).get("samples_per_s")
        if rate:
            out[stage] = float(rate)
    return out


def _cross_fit(ctx: StageContext, points: list[dict[str, Any]], draws: int, seed: int, echo) -> np.ndarray | None:
    """Score every point on the validation samples that did not choose it, with resampled scores [draws, points];
    None (the points keep their best validation's estimate) when a point's run kept no per-sample counts."""
    counts = [load_counts(ctx.run_dir / p["dir"], [r["step"] for r in read_metrics(ctx.run_dir / p["dir"] / "metrics.jsonl")
                                                   if r.get("kind") == "val"]) for p in points]
    if not points or any(c is None for c in counts):
        missing = [p["dir"] for p, c in zip(points, counts, strict=True) if c is None]
        if missing:
            echo(f"data_scaling: {', '.join(missing)} kept no per-sample validation counts (trained before they "
                 "were kept): points scored by their best validation, on the samples that chose it (biased upward)")
        return None
    scored = score_points(counts, draws, seed)
    for p, tau, se, chosen in zip(points, scored.tau, scored.se, scored.chosen, strict=True):
        p.update({"val_tau_best": p["val_tau_est"], "val_tau_est": tau, "val_tau_se": se, "chosen_steps": list(chosen),
                  "scored_on": f"cross-fitted: chosen on half of the {scored.samples} validation samples, scored on "
                               "the other half, both ways"})
    return scored.draws


def _vllm_tau(ctx: StageContext, point: dict[str, Any], k: int) -> tuple[float | None, str]:
    """vLLM's greedy tau for a point's drafter: the evaluate stage's when it measured this checkpoint, else measured
    here (and kept in the point's folder, keyed by the checkpoint, so a rerun does not start a server again)."""
    from eagle3lib.evaluation.vllm_tau import measure_greedy_tau

    ckpt = (ctx.run_dir / point["checkpoint"]).resolve()
    ev = read_manifest(ctx.stage_dir("evaluate"))
    if ev and ev.get("status") == "complete" and (ev.get("outputs") or {}).get("checkpoint"):
        if Path(ev["outputs"]["checkpoint"]).resolve() == ckpt and (ev.get("figures") or {}).get("tau_vllm_greedy"):
            return ev["figures"]["tau_vllm_greedy"], "evaluate stage"
    ecfg, vcfg = ctx.profile.section("evaluate"), ctx.verifier
    pdir = point_dir(ctx, point["fraction"])
    res = measure_greedy_tau(ecfg, vcfg, ckpt, k, pdir, keep=(pdir, "vllm_greedy"))
    return res["tau"], "measured here"


def _target_cost(ctx: StageContext, fit: ScalingFit, target: float, epochs: float) -> tuple[dict[str, Any], Any]:
    """The cost of the samples the curve asks for, on every hardware row (the cost_projection section's model)."""
    from eagle3lib.analysis.cost import project, resolve_path

    ccfg = ctx.profile.section("cost_projection")
    need = fit.needed(target)
    out: dict[str, Any] = {**need, "target_tau": target, "samples": None,
                           "tokens_per_sample": ccfg.avg_tokens_per_sample}
    out["above_ceiling"] = need["tokens"] is not None and not math.isfinite(need["tokens"])
    for key in ("tokens", "tokens_lo", "tokens_hi"):  # fit.json is strict JSON: no Infinity
        if out[key] is not None and not math.isfinite(out[key]):
            out[key] = None
    if out["tokens"] is None:
        return out, None
    out["samples"] = max(1, math.ceil(need["tokens"] / ccfg.avg_tokens_per_sample))
    run_dir = resolve_path(ccfg.manifests_run_dir) if ccfg.manifests_run_dir else ctx.run_dir
    try:
        cp = project(ccfg.model_copy(update={"samples": out["samples"], "epochs": epochs}), run_dir,
                     ctx.profile.section("train").ttt_steps)
    except ValueError as e:  # a stage the projection reads has not run: the curve stands without its cost
        out["cost_error"] = str(e)
        return out, None
    return out, cp.totals()


def run(ctx: StageContext, echo=print) -> dict[str, Any]:
    """The stage: returns fit.json's content; writes fit.json, cost_for_target.csv and the manifest."""
    return timed_stage(ctx.dir, ctx.manifest_params(), lambda timer: _run(ctx, timer, echo), ctx.input_dir())


def _run(ctx: StageContext, timer: StageTimer, echo) -> dict[str, Any]:
    cfg, tcfg = ctx.cfg, ctx.profile.section("train")
    k, t0 = tcfg.ttt_steps, time.time()
    if cfg.fractions and not (ctx.stage_dir("extract") / "store.json").exists():
        raise DataScalingError(f"{ctx.stage_dir('extract') / 'store.json'}: no hidden-state store to train the "
                               "fractions on (run --stages generate,extract first, or set data_scaling.fractions: [] "
                               "to show reference points only)")
    points = []
    for fraction in cfg.fractions:
        tdir, m, reused = train_point(ctx, fraction, echo)
        points.append(_point(ctx, fraction, tdir, m, reused, k))
    rates = _data_rates(ctx)
    for p in points:  # what the point cost here: its samples generated and extracted at this run's rates, its training
        p["data_s_here"] = p["train_samples"] * sum(1 / r for r in rates.values()) if len(rates) == 2 else None
        p["hours_here"] = (p["data_s_here"] + (p["train_s"] or 0)) / 3600 if p["data_s_here"] is not None else None
    resampled = _cross_fit(ctx, points, cfg.bootstrap_draws, tcfg.seed, echo)
    for p in points[::-1][: cfg.vllm_points]:
        p["tau_vllm_greedy"], p["tau_vllm_source"] = _vllm_tau(ctx, p, k)
    refs = [{**r.model_dump(), "tokens": r.samples * r.tokens_per_sample} for r in cfg.reference_points]
    xs = [p["train_tokens"] for p in points] + ([r["tokens"] for r in refs] if cfg.fit_reference_points else [])
    ys = [p["val_tau_est"] for p in points] + ([r["tau"] for r in refs] if cfg.fit_reference_points else [])
    ses = [p["val_tau_se"] for p in points]
    if resampled is not None and cfg.fit_reference_points and refs:  # measured elsewhere: the same in every draw
        resampled = np.hstack([resampled, np.tile([r["tau"] for r in refs], (len(resampled), 1))])
    fit = fit_scaling(xs, ys, cap=k + 1.0, sigma_floor=float(np.median(ses)) if ses else 0.0,
                      draws=cfg.bootstrap_draws, seed=tcfg.seed, resampled=resampled)
    largest = max(points, key=lambda p: p["train_tokens"]) if points else None
    target = cfg.target_tau or round((largest["val_tau_est"] if largest else max(ys, default=2.0)) + 0.2, 2)
    epochs = cfg.epochs or tcfg.epochs
    need, cost = _target_cost(ctx, fit, target, epochs)
    tokens_per_sample = (largest["train_tokens"] / largest["train_samples"]) if largest else \
        (refs[0]["tokens_per_sample"] if refs else 1.0)
    text = explain(fit, target, ctx.profile.section("cost_projection").avg_tokens_per_sample, cap=k + 1.0)
    if fit.curve is None:
        text += (" It needs at least three data sizes: train on nested fractions of the data (data_scaling.fractions,"
                 " e.g. [0.25, 0.5, 1.0]); with schedule: steps each fraction below 1 costs up to one more full "
                 "training run (train.patience stops the small ones sooner), with schedule: epochs its share of one.")
    curve = None
    if fit.curve is not None:
        grid = np.geomspace(min(xs) / 2, max(xs) * 8, 60)
        lo, hi = fit.band(grid)
        curve = {"c": fit.curve.c, "t50": fit.curve.t50, "b": fit.curve.b, "sigma": fit.sigma,
                 "grid_tokens": grid.tolist(), "tau": fit.curve.tau(grid).tolist(), "band_lo": lo.tolist(),
                 "band_hi": hi.tolist(), **dict(zip(("ceiling_lo", "ceiling_hi"), fit.ceiling_range(), strict=True))}
    result = {"points": points, "reference_points": refs, "curve": curve, "no_curve_reason": fit.reason,
              "target": need, "explanation": text, "ttt_steps": k, "epochs": epochs,
              "run_tokens_per_sample": tokens_per_sample}
    outputs = {"fit": "fit.json"}
    write_json_atomic(ctx.dir / "fit.json", result)
    if cost is not None:
        write_text_atomic(ctx.dir / "cost_for_target.csv", cost.write_csv())
        outputs["cost_for_target"] = "cost_for_target.csv"
        result["cost"] = cost
    figures: dict[str, Any] = {  # the run index shows the first ones
        "ceiling_tau": curve["c"] if curve else None, "target_tau": target, "samples_needed": need["samples"],
        "tokens_needed": need["tokens"], "target_above_ceiling": need.get("above_ceiling"),
        "target_unreachable_frac": need["unreachable_frac"],
        "points": len(points), "points_trained_here": sum(not p["reused"] for p in points),
        "largest_still_improving": largest["still_improving"] if largest else None,
        "ceiling_tau_lo": curve["ceiling_lo"] if curve else None, "ceiling_tau_hi": curve["ceiling_hi"] if curve else None,
        "reference_points": len(refs), "wall_s": round(time.time() - t0, 1)}
    for p in points:
        figures[f"val_tau_est_{p['fraction']:g}"] = p["val_tau_est"]
        if p["tau_vllm_greedy"] is not None:
            figures[f"tau_vllm_greedy_{p['fraction']:g}"] = p["tau_vllm_greedy"]
        if p["hours_here"] is not None:  # generate + extract of its samples + its training, on this machine
            figures[f"hours_here_{p['fraction']:g}"] = round(p["hours_here"], 3)
    timer.finish(figures, outputs)
    return result
