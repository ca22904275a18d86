"""The evaluate stage: the trained drafter's acceptance length measured by real speculative decoding, beside the
training-time estimate.

Three numbers for the same drafter, per draft position and overall (tau = tokens per verifier step, bonus included):
  estimate   from the train stage's conditional accuracies a_i: tau_est = 1 + sum_{k<=K} prod_{i<=k} a_i (train, val)
  library    eagle3lib.model.speculative: the HF verifier + the drafter, one sequence at a time, greedy and sampled; also
             the wall-clock speedup over plain KV-cached decoding with the same verifier (interleaved per prompt)
  vLLM       the verifier served with the drafter as its EAGLE-3 speculator; tau from the spec-decode counters on
             /metrics (deltas per category), throughput with and without the drafter at the same concurrency
All use the same prompts (token ids rendered once with the chat template), the same max_tokens and K.

Outputs in RUN_DIR/evaluate/: manifest.json (flat figures), results.json (every table), comparison.png, the two
servers' logs, and phases/*.json: each measurement phase is kept once complete (keyed by everything it depends on),
so a rerun after a failure resumes at the phase that failed.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

from eagle3lib.analysis.deployment import k_sweep_model
from eagle3lib.core.atomic import write_json_atomic
from eagle3lib.core.manifest import StageTimer, now_iso, update_manifest
from eagle3lib.evaluation.concurrency_grid import concurrency_grid, grid_figures, sweep_measurements
from eagle3lib.evaluation.drafters import checked_drafters, compare_drafters
from eagle3lib.evaluation.inputs import (
    EvaluateError,
    check_drafter,
    eos_ids,
    prompts_in_training,
    resolve_checkpoint,
    select_prompts,
)
from eagle3lib.evaluation.k_sweep import k_sweep
from eagle3lib.evaluation.library import library_device, measure_library, per_prompt_rows, summarize_library
from eagle3lib.evaluation.per_prompt import add_spread, lib_outputs, lib_rows
from eagle3lib.evaluation.phases import fingerprint, load_phase, save_phase
from eagle3lib.evaluation.results import (
    build_figures,
    comparison_rows,
    disagreements,
    same_frac,
    training_estimate,
    without_outputs,
)
from eagle3lib.evaluation.same_dist import same_distribution_estimate
from eagle3lib.evaluation.servers import Servers, pass_settings
from eagle3lib.evaluation.turns import later_turn_conversations, verifier_answer
from eagle3lib.trackers.run import log_evaluation
from eagle3lib.vllm.endpoint import ServerError
from eagle3lib.vllm.measure import ServingError, measure_vllm
from eagle3lib.vllm.server import has_cuda
from eagle3lib.vllm.spec_metrics import MetricsError
from eagle3lib.vllm.speculative_config import served_as, speculative_config


def _as_input_error(fn, *args, **kwargs):
    """A server given in the profile that cannot be reached or measured is bad input of this stage (the message names
    the key, e.g. evaluate.spec_server_url)."""
    try:
        return fn(*args, **kwargs)
    except (ServerError, MetricsError, ServingError) as e:
        raise EvaluateError(str(e)) from None


def run(ctx) -> dict[str, Any]:
    """The stage: returns {"figures", "results", "outputs"}; writes manifest.json, results.json, comparison.png."""
    cfg, vcfg = ctx.cfg, ctx.verifier
    timer = StageTimer(ctx.dir, ctx.manifest_params())
    try:
        return _run(ctx, cfg, vcfg, timer)
    except BaseException as e:
        update_manifest(ctx.dir, status="failed", error=f"{type(e).__name__}: {e}", finished_at=now_iso())
        raise


def _run(ctx, cfg, vcfg, timer) -> dict[str, Any]:
    from eagle3lib.model.checkpoint import CheckpointError, check_servable, read_config
    from eagle3lib.model.verifier import load_config, load_tokenizer, resolve_model

    out_dir: Path = ctx.dir
    t_start = time.time()
    ckpt, train_m, notes = resolve_checkpoint(cfg, ctx.stage_dir("train"))
    model_path = resolve_model(vcfg.model)
    vconf = load_config(model_path, vcfg.trust_remote_code)
    try:
        dcfg = read_config(ckpt)
        check_drafter(ckpt, dcfg, vconf, model_path, has_cuda())  # trained for this verifier, servable here?
        check_servable(ckpt)  # and loadable by vLLM, before any server starts
    except CheckpointError as e:
        raise EvaluateError(str(e)) from None
    others = checked_drafters(cfg.drafters, vconf, model_path, has_cuda())  # the same, for evaluate.drafters
    k = cfg.ttt_steps or ctx.profile.section("train").ttt_steps
    k_trained = int(dcfg.ttt_steps)
    if k > k_trained:
        msg = (f"K={k} is larger than the {k_trained} draft steps this drafter was trained for "
               f"({ckpt / 'config.json'}: speculators_config...speculative_tokens): positions {k_trained + 1}..{k} are untrained extrapolation")
        warnings.warn(msg, stacklevel=2)
        notes.append(msg)
    tok = load_tokenizer(model_path, vcfg.trust_remote_code)
    servers = Servers(cfg, vcfg, model_path, out_dir)

    def base_endpoint():
        """The verifier alone (the base server), opened on first use: it answers the first turns of multi-turn
        questions before anything is measured."""
        if "base" not in servers.endpoints and "base" not in servers.threads:
            _as_input_error(servers.open, "base", None, background=False)
        return servers.get("base")

    def later(multi):
        return later_turn_conversations(multi, lambda m: verifier_answer(base_endpoint(), m, cfg), cfg,
                                        out_dir / "later_turns.json")

    try:
        prompts, pstats, hashes = select_prompts(cfg, tok, vcfg.max_model_len, k, later if cfg.vllm else None)
    except BaseException:
        servers.close_all()
        raise
    eos = eos_ids(tok, model_path)
    if pstats["later_turns_not_measured"]:
        notes.append(f"{pstats['later_turns_not_measured']} multi-turn questions (MT-Bench / Spec-Bench): only their first "
                     "turn is measured (their later turns follow the verifier's own answers, generated by a vLLM "
                     "server: evaluate.vllm is off)")
    seen = prompts_in_training(ctx, hashes)
    if seen:
        notes.append(f"{seen} of {len(prompts)} evaluation prompts are also training prompts (generate.dataset)")
    lib_prompts = prompts[: cfg.lib_max_prompts] if cfg.lib_max_prompts else prompts
    base_key = {"ckpt": fingerprint(ckpt), "verifier": [vcfg.model, model_path], "ttt_steps": k,
                "prompts": [[p.id, p.token_ids] for p in prompts], "max_tokens": cfg.max_tokens,
                "temperature": cfg.temperature, "modes": cfg.modes, "seed": cfg.seed, "eos": eos}
    results: dict[str, Any] = {"ttt_steps": k, "ttt_steps_trained": k_trained, "checkpoint": str(ckpt), "verifier": vcfg.model,
                               "verifier_path": model_path, "tolerance": cfg.tolerance, "eos_token_ids": eos,
                               "prompts": {"source": cfg.prompts, "used": len(prompts), "used_lib": 0,
                                           "seen_in_training": seen, **pstats},
                               "estimate": training_estimate((train_m or {}).get("figures"), k), "warnings": notes,
                               "phases": {}}
    if train_m is None and not cfg.checkpoint:
        notes.append("no train manifest: no training-time estimate")

    lib_key = {**base_key, "n": len(lib_prompts), "dtype": cfg.lib_dtype, "device": str(library_device(cfg)),
               "device_map": cfg.device_map, "draft_sampling": cfg.draft_sampling, "threads": cfg.cpu_threads}
    vkey = {**base_key, "concurrency": cfg.concurrency, "dtype": vcfg.dtype, "server_args": cfg.server_args,
            "extra_server_args": vcfg.extra_server_args, "warmup": cfg.warmup_requests}
    if cfg.context_buckets:  # vLLM's passes run per bucket group (the library's buckets come from its records)
        vkey["context_buckets"] = cfg.context_buckets
    if cfg.per_prompt:  # every prompt alone
        vkey["per_prompt"] = True
    spec_cfg = speculative_config(ckpt, k)
    keys = {w: {**vkey, "which": w, "url": servers.key_url(w)} for w in ("spec", "base")}
    cached = {w: load_phase(out_dir, f"vllm_{w}", keys[w]) if cfg.vllm else None for w in ("spec", "base")}
    lib_raw = load_phase(out_dir, "library", lib_key) if cfg.library else None
    try:
        # given URLs are checked now (an unreachable server fails before the library's minutes of work); local servers
        # start in the background while the library measures (CPU), or one at a time after it (GPU memory)
        overlap = cfg.overlap_startup if cfg.overlap_startup is not None else not has_cuda()
        if cfg.vllm:
            for w in ("spec", "base"):
                opened = w in servers.endpoints or w in servers.threads  # the base server may answer later turns
                if cached[w] is None and (overlap or servers.url(w)[0]) and not opened:
                    _as_input_error(servers.open, w, spec_cfg if w == "spec" else None, background=True)
        if cfg.library:
            t0 = time.time()
            reused = lib_raw is not None
            if not reused:
                lib_raw = measure_library(cfg, vcfg, model_path, ckpt, lib_prompts, k, eos)
                save_phase(out_dir, "library", lib_key, lib_raw)
            results["phases"]["library"] = {"seconds": round(time.time() - t0, 1), "reused": reused}
            results["lib"] = summarize_library(lib_raw, cfg.modes, k, cfg.context_buckets)
            results["lib_per_prompt"] = per_prompt_rows(lib_raw, cfg.modes)
            add_spread(results["lib"], cfg.modes, lib_rows(lib_raw, cfg.modes), lib_outputs(lib_raw), eos)
            results["prompts"]["used_lib"] = len(lib_prompts)
            if "greedy" in cfg.modes and results["lib"]["greedy_equals_plain_frac"] < 1.0:
                notes.append(f"library greedy speculative output differs from plain greedy decoding on "
                             f"{1 - results['lib']['greedy_equals_plain_frac']:.0%} of prompts (numerical near-ties)")
        if cfg.vllm:
            v: dict[str, Any] = {}
            for w in ("spec", "base"):
                t0 = time.time()
                res = cached[w]
                if res is None:
                    if w not in servers.endpoints and w not in servers.threads:
                        _as_input_error(servers.open, w, spec_cfg if w == "spec" else None, background=False)
                    ep = servers.get(w)
                    res = _as_input_error(measure_vllm, pass_settings(cfg), ep, prompts, k, w, servers.url(w)[1])
                    res["server"]["external"] = servers.url(w)[0] is not None
                    res["server"]["shared"] = servers.key_url(w) == "shared"
                    res["server"]["start_seconds"] = servers.start_seconds.get(w)
                    servers.close(w)  # the next server measures alone
                    save_phase(out_dir, f"vllm_{w}", keys[w], res)
                results["phases"][f"vllm_{w}"] = {"seconds": round(time.time() - t0, 1), "reused": cached[w] is not None}
                if w == "spec":
                    v.update({m: res[m] for m in cfg.modes})
                    v["spec_server"] = res["server"]
                    for m in cfg.modes:
                        if res[m].get("other_traffic"):
                            o = res[m]["other_traffic"]
                            notes.append(f"{servers.url(w)[1]}: while the {m} pass ran, the server's counters also moved "
                                         f"by {o['other_requests']} requests and {o['other_prompt_tokens']} prompt "
                                         "tokens that were not this evaluation's: another client shares it, so vLLM's "
                                         f"{m} tau is not reported. Measure on a server nobody else uses")
                else:
                    v["base"] = {m: res[m] for m in cfg.modes}
                    v["base_server"] = res["server"]
            if cfg.per_prompt:
                add_spread(v, cfg.modes, {m: list(v[m].get("per_prompt", {}).values()) for m in cfg.modes},
                           {m: v[m]["outputs"] for m in cfg.modes}, eos)
            if "greedy" in cfg.modes:
                v["greedy_same_output_frac_spec_base"] = same_frac(v["greedy"]["outputs"],
                                                                    v["base"]["greedy"]["outputs"])
                if lib_raw is not None:
                    lib_out = {r["id"]: r["greedy"]["tokens"] for r in lib_raw["records"]}
                    results["greedy_same_output_frac_lib_vllm"] = same_frac(lib_out, v["greedy"]["outputs"])
            results["vllm"] = v
            base_out = ((v.get("base") or {}).get("greedy") or {}).get("outputs")
            if cfg.library and base_out:  # the estimator on the evaluation's distribution (evaluation/same_dist.py)
                t0 = time.time()
                decay = ctx.profile.section("train").decay
                skey = {**base_key, "outputs": base_out, "decay": decay}
                est = load_phase(out_dir, "same_dist_est", skey)
                reused = est is not None
                if not reused:
                    est = same_distribution_estimate(vcfg, model_path, ckpt, prompts, base_out, k, decay)
                    save_phase(out_dir, "same_dist_est", skey, est)
                results["estimate"]["same_dist_est"] = est
                results["phases"]["same_dist_est"] = {"seconds": round(time.time() - t0, 1), "reused": reused}
            if others:
                servers.close_all()  # each drafter's server measures alone
                own_estimate = ((train_m or {}).get("figures") or {}).get("val_tau_est")
                results["drafters"] = compare_drafters(cfg, vcfg, model_path, others, prompts, k, out_dir, vkey,
                                                       (f"this run ({ckpt.name})", v["greedy"], own_estimate))
                results["drafters"][0]["served_as"] = served_as(ckpt)
            measured = None
            if cfg.concurrency_sweep:
                servers.close_all()  # each K's server measures alone
                t0 = time.time()
                grid = concurrency_grid(cfg, vcfg, model_path, ckpt, prompts, k, out_dir, vkey,
                                        {w: servers.url(w)[0] for w in ("base", "spec")})
                results["concurrency_grid"] = grid
                results["phases"]["concurrency_grid"] = {"seconds": round(time.time() - t0, 1)}
                measured = sweep_measurements(grid, cfg.concurrency)  # the K sweep's rows, when the grid has them
            if cfg.ttt_steps_sweep:
                servers.close_all()  # each K's server measures alone
                t0 = time.time()
                base_tps = ((v.get("base") or {}).get("greedy") or {}).get("tokens_per_s")
                main = (k, v["greedy"]) if "greedy" in cfg.modes and v["greedy"].get("tau") is not None else None
                if measured is not None:
                    main, base_tps = None, measured.pop(0)["tokens_per_s"]
                results["k_sweep"] = k_sweep(cfg, vcfg, model_path, ckpt, prompts, out_dir, vkey, base_tps,
                                             k_sweep_model(ctx.profile, ckpt, cfg.concurrency), main, measured)
                results["phases"]["k_sweep"] = {"seconds": round(time.time() - t0, 1)}
    finally:
        servers.close_all()
    results["table"] = comparison_rows(results)
    figures = {**build_figures(results), **grid_figures(results.get("concurrency_grid"))}
    notes.extend(disagreements(figures, results, cfg))
    figures["warnings"] = len(notes)
    figures["wall_s"] = round(time.time() - t_start, 1)
    write_json_atomic(out_dir / "results.json", without_outputs(results))
    outputs = {"results": "results.json", "checkpoint": str(ckpt)}
    try:
        from eagle3lib.reports.evaluate import plot_comparison

        fig = plot_comparison(results)
        fig.savefig(out_dir / "comparison.png", dpi=110, bbox_inches="tight")
        import matplotlib.pyplot as plt

        plt.close(fig)
        outputs["plot"] = "comparison.png"
    except Exception as e:  # a plot must never cost the measurement
        notes.append(f"comparison plot not written: {type(e).__name__}: {e}")
    for name in ("vllm_spec.log", "vllm_base.log"):
        if (out_dir / name).exists():
            outputs[name.removesuffix(".log") + "_log"] = name
    if train_m is not None:  # the table also goes to the training run's trackers, when it has some
        steps = int((train_m.get("figures") or {}).get("steps") or 0)
        values = {k_: float(v_) for k_, v_ in figures.items() if k_.startswith("tau_") and isinstance(v_, int | float)
                  and not isinstance(v_, bool)}
        notes.extend(log_evaluation(ctx.profile.section("train"), ctx.stage_dir("train"), "evaluate",
                                    results["table"], values, steps))
    timer.finish({k_: v_ for k_, v_ in figures.items() if v_ is None or isinstance(v_, int | float | bool)}, outputs)
    update_manifest(out_dir, warnings=notes)
    return {"figures": figures, "results": results, "outputs": outputs}
