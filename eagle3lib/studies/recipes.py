"""The recipes study (the recipes stage's engine; its entry: eagle3lib/stages/recipes.py): which drafting recipe accepts
most, measured the way it will be served.

Each of `recipes.names` trains a drafter on this run's store (the same data for all): a recipe of train overrides is
the train stage again in RUN_DIR/recipes/<name>/ (resumable, reused when it finished with the same settings; the train
stage's own run when its settings are the recipe's), DFlash its own trainer in RUN_DIR/recipes/dflash/. Then the
verifier alone and every recipe's drafter are served by vLLM, one server at a time, on evaluate's prompts, K and
server settings, each decoding `recipes.modes`: tau (per draft position, per category and context bucket too),
tokens/s and its ratio to the verifier alone, and whether greedy outputs are the verifier's own. Each measurement is a
phase keyed by what it depends on (RUN_DIR/recipes/phases/), so a rerun, or one with a recipe more, measures only
what changed.

Outputs in RUN_DIR/recipes/: recipes.json (rows, the verifier alone, settings), recipes.csv, recipes.png, manifest.json.
"""

from __future__ import annotations

import csv
import io
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from eagle3lib.config.recipes import DFLASH
from eagle3lib.config.stages import StageContext, open_stage
from eagle3lib.core.atomic import write_json_atomic, write_text_atomic
from eagle3lib.core.manifest import StageTimer, timed_stage
from eagle3lib.evaluation.inputs import best_is_chosen
from eagle3lib.evaluation.vllm_tau import measure_served
from eagle3lib.studies.recipe_seeds import pool_rows
from eagle3lib.training.variants import QUIET, finished_with, train_variant
from eagle3lib.vllm.speculative_config import served_as, speculative_config


class RecipesError(RuntimeError):
    pass


def _folder(name: str, seed: int | None) -> str:
    """RUN_DIR/recipes/<folder>: the recipe's name, with the seed when it is not the train section's."""
    return name if seed is None else f"{name}.seed-{seed}"


def _train_chain(ctx: StageContext, name: str, echo, seed: int | None = None) -> dict[str, Any]:
    """A recipe of train overrides (`seed`: train.seed, None = the profile's): (reused or trained) folder, checkpoint
    and the train manifest's figures."""
    over = {**ctx.cfg.overrides(name), **({"train.seed": seed} if seed is not None else {})}
    own = open_stage("train", ctx.profile.path, ctx.run_dir, {**ctx.profile.overrides, **over}, say=lambda _m: None)
    tdir = ctx.stage_dir("train")
    if m := finished_with(tdir, own.manifest_params()):
        source = "the train stage"
    else:
        tdir = ctx.dir / _folder(name, seed)
        m, reused = train_variant(ctx, tdir, {**over, **QUIET}, f"recipe {_folder(name, seed)}", echo)
        source = "reused" if reused else "trained here"
    f, outs = m["figures"], m.get("outputs") or {}
    best = best_is_chosen(m)
    return {"dir": tdir, "checkpoint": tdir / (outs["best"] if best else outs["checkpoint"]), "source": source,
            "val_tau_est": f.get("best_val_tau_est") if best else f.get("val_tau_est"), "train_s": f.get("train_s"),
            "steps": f.get("steps"), "parameters": f.get("drafter_parameters")}


def _train_dflash(ctx: StageContext, model_path: str, k: int, echo, seed: int | None = None) -> dict[str, Any]:
    """DFlash on the run's store, K drafts per block; resumable in RUN_DIR/recipes/dflash/ (dflash.seed-<seed>/), reused
    when finished with the same settings."""
    from eagle3lib.training.dflash_loop import DFlashTrainConfig, train_dflash

    cfg, tcfg = ctx.cfg, ctx.profile.section("train")
    dcfg = DFlashTrainConfig(block=k, num_layers=cfg.dflash_layers, steps=cfg.dflash_steps,
                             val_fraction=tcfg.val_fraction, val_max_samples=tcfg.val_max_samples,
                             seed=tcfg.seed if seed is None else seed)
    out, want = ctx.dir / _folder(DFLASH, seed), {**asdict(dcfg), "verifier": model_path}
    settings = out / "settings.json"  # what this folder trains: a killed run resumes only into the same settings
    m = json.loads((out / "manifest.json").read_text()) if (out / "manifest.json").exists() else None
    if m is not None and settings.exists() and json.loads(settings.read_text()) == want:
        source = "reused"
    else:
        if out.exists() and (m is not None or not settings.exists() or json.loads(settings.read_text()) != want):
            shutil.rmtree(out)  # another configuration's drafter (or a finished one): not resumed
        out.mkdir(parents=True, exist_ok=True)
        write_json_atomic(settings, want)
        echo(f"recipes: training recipe {out.name} ({out.relative_to(ctx.run_dir)}/)")
        # its step lines stay out of the report (as a chain recipe's do); the curve is in dflash/metrics.jsonl
        m = train_dflash(ctx.stage_dir("extract"), model_path, out, dcfg, progress=False)
        f = m["figures"]
        echo(f"[{out.name}] done: {f['steps']} steps in {f['train_s']} s, val_tau_est {f['val_tau_est']:.3f}")
        source = "trained here"
    f = m["figures"]
    return {"dir": out, "checkpoint": out / "final", "source": source, "val_tau_est": f.get("val_tau_est"),
            "train_s": f.get("train_s"), "steps": f.get("steps"), "parameters": f.get("parameters")}


def _measure(ctx: StageContext, ckpt: Path | None, k: int, name: str) -> dict[str, Any]:
    """vLLM's measurement of one drafter (None: the verifier alone), reused from RUN_DIR/recipes/phases/ when it ran
    with the same drafter files, prompts and settings; every prompt alone when several seeds are compared."""
    ecfg, vcfg, cfg = ctx.profile.section("evaluate"), ctx.verifier, ctx.cfg
    if len(cfg.seeds) > 1:
        ecfg = ecfg.model_copy(update={"per_prompt": True})
    log_dir = ctx.dir / "logs" / name
    log_dir.mkdir(parents=True, exist_ok=True)
    return measure_served(ecfg.model_copy(update={"progress": cfg.progress}), vcfg, ckpt, k, log_dir, cfg.modes,
                          f"recipes.names: {name}", keep=(ctx.dir, f"vllm_{name}"))


def _row(ctx: StageContext, name: str, trained: dict[str, Any], res: dict[str, Any], base: dict[str, Any],
         k: int) -> dict[str, Any]:
    ckpt = trained["checkpoint"]
    serving = {key: v for key, v in speculative_config(ckpt, k).items() if key != "model"}
    row: dict[str, Any] = {"recipe": name, "overrides": ctx.cfg.overrides(name), "served_as": served_as(ckpt),
                           "serving": serving, "source": trained["source"],
                           "checkpoint": str(ckpt.relative_to(ctx.run_dir)), "parameters": trained["parameters"],
                           "steps": trained["steps"], "train_s": trained["train_s"],
                           "val_tau_est": trained["val_tau_est"]}
    for m in ctx.cfg.modes:
        r, b = res[m], base[m]
        row[f"tau_vllm_{m}"] = r["tau"]
        row[f"accept_rate_pos_{m}"] = r["accept_rate_pos"]
        row[f"tau_by_category_{m}"] = r["categories"]
        row[f"tau_by_context_{m}"] = r.get("context_buckets") or {}  # evaluate.context_buckets, when set
        row[f"tokens_per_s_{m}"] = r["tokens_per_s"]
        row[f"speedup_{m}"] = r["tokens_per_s"] / b["tokens_per_s"] if r["tokens_per_s"] and b["tokens_per_s"] else None
    if "greedy" in ctx.cfg.modes:
        want, got = base["greedy"]["outputs"], res["greedy"]["outputs"]
        row["greedy_identical_frac"] = sum(got.get(i) == o for i, o in want.items()) / max(len(want), 1)
    return row


def run(ctx: StageContext, echo: Callable[[str], None] = print, plot: Callable[[dict[str, Any]], Any] | None = None
        ) -> dict[str, Any]:
    """The study: returns recipes.json's content; writes it, recipes.csv, recipes.png (`plot`: the result -> a
    matplotlib figure; none without it) and the manifest."""
    return timed_stage(ctx.dir, ctx.manifest_params(), lambda timer: _run(ctx, timer, echo, plot), ctx.input_dir())


def _run(ctx: StageContext, timer: StageTimer, echo: Callable[[str], None],
         plot: Callable[[dict[str, Any]], Any] | None) -> dict[str, Any]:
    from eagle3lib.model.verifier import resolve_model

    t0 = time.time()
    store = ctx.stage_dir("extract") / "store.json"
    if not store.exists():
        raise RecipesError(f"{store}: no hidden-state store to train the recipes on (run --stages generate,extract "
                           "first)")
    ecfg, tcfg = ctx.profile.section("evaluate"), ctx.profile.section("train")
    k = ecfg.served_k(tcfg.ttt_steps)
    model_path = resolve_model(ctx.verifier.model)
    # None: the train section's seed, in the recipe's own folder; a seed of recipes.seeds beside it
    seeds: list[int | None] = [None if s == tcfg.seed else s for s in ctx.cfg.seeds] or [None]
    trained = {(n, s): _train_dflash(ctx, model_path, k, echo, s) if n == DFLASH else _train_chain(ctx, n, echo, s)
               for n in ctx.cfg.names for s in seeds}
    echo(f"recipes: measuring the verifier alone and {len(trained)} drafters through vLLM (K = {k}, "
         f"{', '.join(ctx.cfg.modes)})")
    base = _measure(ctx, None, k, "verifier")
    measured = {(n, s): _measure(ctx, t["checkpoint"], k, _folder(n, s)) for (n, s), t in trained.items()}
    rows = [_row(ctx, n, trained[(n, seeds[0])], measured[(n, seeds[0])], base, k) for n in ctx.cfg.names]
    comparisons = None
    if len(seeds) > 1:
        comparisons = pool_rows(rows, {n: [measured[(n, s)] for s in seeds] for n in ctx.cfg.names},
                                {n: [trained[(n, s)] for s in seeds] for n in ctx.cfg.names}, base, ctx.cfg.modes)
    result = {"rows": rows, "ttt_steps": k, "modes": ctx.cfg.modes, "prompts": base["prompts"],
              "seeds": [tcfg.seed if s is None else s for s in seeds], "comparisons": comparisons,
              "verifier_alone": {f"tokens_per_s_{m}": base[m]["tokens_per_s"] for m in ctx.cfg.modes},
              "settings": {"prompts": ecfg.prompts, "n_prompts": ecfg.n_prompts, "max_tokens": ecfg.max_tokens,
                           "temperature": ecfg.temperature, "concurrency": ecfg.concurrency, "dtype": ctx.verifier.dtype}}
    write_json_atomic(ctx.dir / "recipes.json", result)
    write_text_atomic(ctx.dir / "recipes.csv", _csv(rows))
    outputs = {"results": "recipes.json", "table": "recipes.csv"}
    try:
        if plot is not None:
            import matplotlib.pyplot as plt

            fig = plot(result)
            fig.savefig(ctx.dir / "recipes.png", dpi=110, bbox_inches="tight")
            plt.close(fig)
            outputs["plot"] = "recipes.png"
    except Exception as e:  # a plot must never cost the measurement
        echo(f"recipes: plot not written: {type(e).__name__}: {e}")
    mode = "greedy" if "greedy" in ctx.cfg.modes else ctx.cfg.modes[0]
    scored = [r for r in rows if r[f"tau_vllm_{mode}"] is not None]
    figures: dict[str, Any] = {"recipes": len(rows), "trained_here": sum(r["source"] == "trained here" for r in rows),
                               f"best_recipe_{mode}": max(scored, key=lambda r: r[f"tau_vllm_{mode}"])["recipe"]
                               if scored else None, "wall_s": round(time.time() - t0, 1)}
    for r in rows:
        for m in ctx.cfg.modes:
            figures[f"tau_vllm_{m}_{r['recipe']}"] = r[f"tau_vllm_{m}"]
            if r.get(f"tau_vllm_{m}_interval"):
                figures[f"tau_vllm_{m}_{r['recipe']}_lo"], figures[f"tau_vllm_{m}_{r['recipe']}_hi"] = \
                    r[f"tau_vllm_{m}_interval"]
    if comparisons:
        figures["seeds"] = len(seeds)
        for m in ctx.cfg.modes:
            figures[f"differences_supported_{m}"] = [r["recipe"] for r in rows if (r.get(f"vs_reference_{m}") or
                                                                                    {}).get("supported")]
    timer.finish(figures, outputs)
    return result


CSV_COLUMNS = ["recipe", "served_as", "source", "parameters", "steps", "train_s", "val_tau_est", "tau_vllm_greedy",
               "tau_vllm_sampled", "speedup_greedy", "speedup_sampled", "tokens_per_s_greedy", "tokens_per_s_sampled",
               "greedy_identical_frac"]


def _csv(rows: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, CSV_COLUMNS + ["accept_rate_pos_greedy", "serving"], extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow({**r, "accept_rate_pos_greedy": " ".join(f"{x:.3f}" for x in r.get("accept_rate_pos_greedy") or []),
                    "serving": json.dumps(r["serving"])})
    return buf.getvalue()
