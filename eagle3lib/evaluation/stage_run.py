"""The evaluate stage's run, phase by phase (eagle3lib/stages/evaluate.py calls them in this order):

  prepare        checkpoint and verifier checked, prompts rendered, the phases' keys, the servers (none started yet)
  open_servers   given URLs checked at once; local servers started in the background while the library measures (CPU)
  library        eagle3lib's own speculative decoding (HF verifier + drafter)
  served         vLLM with the drafter (spec) and alone (base), every mode; greedy outputs compared
  same_dist      the training estimator on the evaluation's own greedy answers
  other_drafters evaluate.drafters served side by side
  sweeps         the concurrency grid and the K sweep
  finish         figures, results.json, the plot, the trackers, the manifest

Each measurement is a phase kept in RUN_DIR/evaluate/phases/ once complete, keyed by everything it depends on
(eagle3lib/evaluation/phases.py), so a rerun after a failure resumes at the phase that failed.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3lib.config.evaluate import EvaluateConfig
from eagle3lib.config.stages import StageContext
from eagle3lib.config.verifier import VerifierConfig
from eagle3lib.core.atomic import write_json_atomic
from eagle3lib.core.manifest import StageTimer, update_manifest
from eagle3lib.evaluation.concurrency_grid import concurrency_grid, grid_figures, sweep_measurements
from eagle3lib.evaluation.draft_sampling import draft_sampling, sampling_figures
from eagle3lib.evaluation.drafters import checked_drafters, compare_drafters
from eagle3lib.evaluation.inputs import (
    EvaluateError,
    check_drafter,
    prompts_in_training,
    resolve_checkpoint,
    select_prompts,
)
from eagle3lib.evaluation.interleaved_speed import interleaved_speed
from eagle3lib.evaluation.k_sweep import k_sweep
from eagle3lib.evaluation.library import library_device, measure_library, per_prompt_rows, summarize_library
from eagle3lib.evaluation.per_prompt import add_spread, lib_outputs, lib_rows
from eagle3lib.evaluation.phases import fingerprint, load_phase, measurement_key, save_phase
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
from eagle3lib.model.verifier import eos_ids
from eagle3lib.trackers.run import log_evaluation
from eagle3lib.vllm.endpoint import ServerError
from eagle3lib.vllm.measure import EvalPrompt, ServingError, measure_vllm
from eagle3lib.vllm.server import has_cuda
from eagle3lib.vllm.spec_metrics import MetricsError
from eagle3lib.vllm.speculative_config import served_as

WHICH = ("spec", "base")  # the drafter's server, the verifier alone's


def as_input_error(fn, *args, **kwargs):
    """A server given in the profile that cannot be reached or measured is bad input of this stage (the message names
    the key, e.g. evaluate.spec_server_url)."""
    try:
        return fn(*args, **kwargs)
    except (ServerError, MetricsError, ServingError) as e:
        raise EvaluateError(str(e)) from None


@dataclass
class Evaluation:
    """What the phases share: the inputs decided once, the servers, and the results as they fill."""
    ctx: StageContext
    cfg: EvaluateConfig
    vcfg: VerifierConfig
    ckpt: Path  # the drafter measured (train/best or final, or evaluate.checkpoint)
    train_m: dict[str, Any] | None  # the train stage's manifest (None: no training-time estimate)
    model_path: str
    k: int  # drafted tokens per round (evaluate.ttt_steps or train.ttt_steps)
    prompts: list[EvalPrompt]
    lib_prompts: list[EvalPrompt]  # the first evaluate.lib_max_prompts of them
    eos: list[int]
    servers: Servers
    others: list[Any]  # evaluate.drafters, checked
    base_key: dict[str, Any]  # what every measurement depends on
    vkey: dict[str, Any]  # ... and every vLLM measurement
    results: dict[str, Any]
    notes: list[str]  # warnings for the report and the manifest
    t_start: float = field(default_factory=time.time)
    lib_raw: dict[str, Any] | None = None  # the library's records (None: not measured)
    cached: dict[str, Any] = field(default_factory=dict)  # vLLM phases already complete, by server

    @property
    def out_dir(self) -> Path:
        return self.ctx.dir

    def vllm_key(self, which: str) -> dict[str, Any]:
        return {**self.vkey, "which": which, "url": self.servers.key_url(which)}


    def open(self, which: str, background: bool) -> None:
        """Open a server once (the base server may be open already: it answers later turns)."""
        if which not in self.servers.endpoints and which not in self.servers.threads:
            spec = which == "spec"
            as_input_error(self.servers.open, which, self.ckpt if spec else None, self.k if spec else None,
                           background=background)


def prepare(ctx: StageContext, t_start: float) -> Evaluation:
    from eagle3lib.model.checkpoint import CheckpointError, check_servable, read_config
    from eagle3lib.model.verifier import load_config, load_tokenizer, resolve_model

    cfg: EvaluateConfig = ctx.cfg
    vcfg: VerifierConfig = ctx.verifier
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
    k = cfg.served_k(ctx.profile.section("train").ttt_steps)
    k_trained = int(dcfg.ttt_steps)
    if k > k_trained:
        msg = (f"K={k} is larger than the {k_trained} draft steps this drafter was trained for ({ckpt / 'config.json'}: "
               f"speculators_config...speculative_tokens): positions {k_trained + 1}..{k} are untrained extrapolation")
        warnings.warn(msg, stacklevel=2)
        notes.append(msg)
    tok = load_tokenizer(model_path, vcfg.trust_remote_code)
    servers = Servers(cfg, vcfg, model_path, ctx.dir)

    def base_endpoint():
        """The verifier alone (the base server), opened on first use: it answers the first turns of multi-turn
        questions before anything is measured."""
        if "base" not in servers.endpoints and "base" not in servers.threads:
            as_input_error(servers.open, "base", None, None, background=False)
        return servers.get("base")

    def later(multi):
        return later_turn_conversations(multi, lambda m: verifier_answer(base_endpoint(), m, cfg), cfg,
                                        ctx.dir / "later_turns.json")

    try:
        prompts, pstats, hashes = select_prompts(cfg, tok, vcfg.max_model_len, k, later if cfg.vllm else None)
    except BaseException:
        servers.close_all()
        raise
    eos = eos_ids(tok, model_path)
    if pstats["later_turns_not_measured"]:
        notes.append(f"{pstats['later_turns_not_measured']} multi-turn questions (MT-Bench / Spec-Bench): only their "
                     "first turn is measured (their later turns follow the verifier's own answers, generated by a vLLM "
                     "server: evaluate.vllm is off)")
    gen = ctx.profile.section("generate")
    seen = prompts_in_training(gen.dataset, gen.turns, hashes)
    if seen:
        notes.append(f"{seen} of {len(prompts)} evaluation prompts are also training prompts (generate.dataset)")
    if train_m is None and not cfg.checkpoint:
        notes.append("no train manifest: no training-time estimate")
    base_key = {"ckpt": fingerprint(ckpt), "verifier": [vcfg.model, model_path], "ttt_steps": k,
                "prompts": [[p.id, p.token_ids] for p in prompts], "max_tokens": cfg.max_tokens,
                "temperature": cfg.temperature, "modes": cfg.modes, "seed": cfg.seed, "eos": eos}
    vkey = measurement_key(pass_settings(cfg), prompts, ckpt, k, vcfg, model_path, cfg.server_args, seed=cfg.seed)
    results: dict[str, Any] = {
        "ttt_steps": k, "ttt_steps_trained": k_trained, "checkpoint": str(ckpt), "verifier": vcfg.model,
        "verifier_path": model_path, "tolerance": cfg.tolerance, "eos_token_ids": eos,
        "prompts": {"source": cfg.prompts, "used": len(prompts), "used_lib": 0, "seen_in_training": seen, **pstats},
        "estimate": training_estimate((train_m or {}).get("figures"), k), "warnings": notes, "phases": {}}
    lib_prompts = prompts[: cfg.lib_max_prompts] if cfg.lib_max_prompts else prompts
    return Evaluation(ctx, cfg, vcfg, ckpt, train_m, model_path, k, prompts, lib_prompts, eos, servers, others,
                      base_key, vkey, results, notes, t_start)


def open_servers(ev: Evaluation) -> None:
    """Given URLs are checked now (an unreachable server fails before the library's minutes of work); local servers
    start in the background while the library measures (CPU), or one at a time after it (GPU memory)."""
    cfg = ev.cfg
    ev.cached = {w: load_phase(ev.out_dir, f"vllm_{w}", ev.vllm_key(w)) if cfg.vllm else None for w in WHICH}
    overlap = cfg.overlap_startup if cfg.overlap_startup is not None else not has_cuda()
    if cfg.vllm:
        for w in WHICH:
            if ev.cached[w] is None and (overlap or ev.servers.url(w)[0]):
                ev.open(w, background=True)


def library(ev: Evaluation) -> None:
    cfg, results = ev.cfg, ev.results
    lib_key = {**ev.base_key, "n": len(ev.lib_prompts), "dtype": cfg.lib_dtype, "device": str(library_device(cfg)),
               "device_map": cfg.device_map, "draft_sampling": cfg.draft_sampling, "threads": cfg.cpu_threads}
    t0 = time.time()
    ev.lib_raw = load_phase(ev.out_dir, "library", lib_key)
    reused = ev.lib_raw is not None
    if not reused:
        ev.lib_raw = measure_library(cfg, ev.vcfg, ev.model_path, ev.ckpt, ev.lib_prompts, ev.k, ev.eos)
        save_phase(ev.out_dir, "library", lib_key, ev.lib_raw)
    results["phases"]["library"] = {"seconds": round(time.time() - t0, 1), "reused": reused}
    results["lib"] = summarize_library(ev.lib_raw, cfg.modes, ev.k, cfg.context_buckets)
    results["lib_per_prompt"] = per_prompt_rows(ev.lib_raw, cfg.modes)
    add_spread(results["lib"], cfg.modes, lib_rows(ev.lib_raw, cfg.modes), lib_outputs(ev.lib_raw), ev.eos)
    results["prompts"]["used_lib"] = len(ev.lib_prompts)
    if "greedy" in cfg.modes and results["lib"]["greedy_equals_plain_frac"] < 1.0:
        ev.notes.append(f"library greedy speculative output differs from plain greedy decoding on "
                        f"{1 - results['lib']['greedy_equals_plain_frac']:.0%} of prompts (numerical near-ties)")


def speed(ev: Evaluation) -> None:
    """The speedup with the two servers interleaved (eagle3lib/evaluation/interleaved_speed.py), before the passes
    that measure each server alone."""
    cfg = ev.cfg
    key = {**ev.vkey, "urls": [ev.servers.key_url(w) for w in WHICH], "speed_repeats": cfg.speed_repeats}
    t0 = time.time()
    res = load_phase(ev.out_dir, "speed", key)
    reused = res is not None
    if res is None:
        if has_cuda() and not all(ev.servers.url(w)[0] for w in WHICH):
            ev.notes.append("evaluate.speed_repeats: not measured: two local servers of the verifier cannot share its "
                            "GPUs; give evaluate.spec_server_url and base_server_url on separate GPUs to interleave")
            return
        for w in WHICH:
            ev.open(w, background=True)
        res = as_input_error(interleaved_speed, cfg, {w: ev.servers.get(w) for w in WHICH}, ev.prompts)
        save_phase(ev.out_dir, "speed", key, res)
    ev.results["vllm_speed"] = res
    ev.results["phases"]["vllm_speed"] = {"seconds": round(time.time() - t0, 1), "reused": reused}


def served(ev: Evaluation) -> None:
    """The spec and base servers, one after the other (each measures alone), every mode."""
    cfg, servers, notes = ev.cfg, ev.servers, ev.notes
    v: dict[str, Any] = {}
    for w in WHICH:
        t0 = time.time()
        res = ev.cached[w]
        if res is None:
            ev.open(w, background=False)
            res = as_input_error(measure_vllm, pass_settings(cfg), servers.get(w), ev.prompts, ev.k, w,
                                 servers.url(w)[1])
            res["server"]["external"] = servers.url(w)[0] is not None
            res["server"]["shared"] = servers.key_url(w) == "shared"
            res["server"]["start_seconds"] = servers.start_seconds.get(w)
            servers.close(w)  # the next server measures alone
            save_phase(ev.out_dir, f"vllm_{w}", ev.vllm_key(w), res)
        ev.results["phases"][f"vllm_{w}"] = {"seconds": round(time.time() - t0, 1), "reused": ev.cached[w] is not None}
        if w == "spec":
            v.update({m: res[m] for m in cfg.modes})
            v["spec_server"] = res["server"]
            for m in cfg.modes:
                if res[m].get("other_traffic"):
                    o = res[m]["other_traffic"]
                    notes.append(f"{servers.url(w)[1]}: while the {m} pass ran, the server's counters also moved by "
                                 f"{o['other_requests']} requests and {o['other_prompt_tokens']} prompt tokens that were "
                                 f"not this evaluation's: another client shares it, so vLLM's {m} tau is not reported. "
                                 "Measure on a server nobody else uses")
        else:
            v["base"] = {m: res[m] for m in cfg.modes}
            v["base_server"] = res["server"]
    if cfg.per_prompt:
        add_spread(v, cfg.modes, {m: list(v[m].get("per_prompt", {}).values()) for m in cfg.modes},
                   {m: v[m]["outputs"] for m in cfg.modes}, ev.eos)
    if "greedy" in cfg.modes:
        v["greedy_same_output_frac_spec_base"] = same_frac(v["greedy"]["outputs"], v["base"]["greedy"]["outputs"])
        if ev.lib_raw is not None:
            lib_out = {r["id"]: r["greedy"]["tokens"] for r in ev.lib_raw["records"]}
            ev.results["greedy_same_output_frac_lib_vllm"] = same_frac(lib_out, v["greedy"]["outputs"])
    ev.results["vllm"] = v


def same_dist(ev: Evaluation) -> None:
    """The estimator on the evaluation's distribution (eagle3lib/evaluation/same_dist.py), on the base server's greedy
    answers; needs the library's HF verifier, so it runs only with evaluate.library."""
    base_out = (((ev.results.get("vllm") or {}).get("base") or {}).get("greedy") or {}).get("outputs")
    if not (ev.cfg.library and base_out):
        return
    t0 = time.time()
    decay = ev.ctx.profile.section("train").decay
    skey = {**ev.base_key, "outputs": base_out, "decay": decay}
    est = load_phase(ev.out_dir, "same_dist_est", skey)
    reused = est is not None
    if not reused:
        est = same_distribution_estimate(ev.vcfg, ev.model_path, ev.ckpt, ev.prompts, base_out, ev.k, decay)
        save_phase(ev.out_dir, "same_dist_est", skey, est)
    ev.results["estimate"]["same_dist_est"] = est
    ev.results["phases"]["same_dist_est"] = {"seconds": round(time.time() - t0, 1), "reused": reused}


def other_drafters(ev: Evaluation) -> None:
    if not ev.others:
        return
    ev.servers.close_all()  # each drafter's server measures alone
    own_estimate = ((ev.train_m or {}).get("figures") or {}).get("val_tau_est")
    ev.results["drafters"] = compare_drafters(ev.cfg, ev.vcfg, ev.model_path, ev.others, ev.prompts, ev.k, ev.out_dir,
                                              ev.vkey, (f"this run ({ev.ckpt.name})", ev.results["vllm"]["greedy"],
                                                        own_estimate))
    ev.results["drafters"][0]["served_as"] = served_as(ev.ckpt)


def sweeps(ev: Evaluation, k_model: Any) -> None:
    """The concurrency grid (K x concurrency) and the K sweep; the sweep reuses the grid's rows when it has them.
    `k_model`: the deployment model's prediction per K beside the measurement (analysis.deployment.k_sweep_model)."""
    cfg, results, v = ev.cfg, ev.results, ev.results["vllm"]
    measured = None
    if cfg.concurrency_sweep:
        ev.servers.close_all()  # each K's server measures alone
        t0 = time.time()
        grid = concurrency_grid(cfg, ev.vcfg, ev.model_path, ev.ckpt, ev.prompts, ev.k, ev.out_dir, ev.vkey,
                                {w: ev.servers.url(w)[0] for w in ("base", "spec")})
        results["concurrency_grid"] = grid
        results["phases"]["concurrency_grid"] = {"seconds": round(time.time() - t0, 1)}
        measured = sweep_measurements(grid, cfg.concurrency)  # the K sweep's rows, when the grid has them
    if cfg.ttt_steps_sweep:
        ev.servers.close_all()  # each K's server measures alone
        t0 = time.time()
        base_tps = ((v.get("base") or {}).get("greedy") or {}).get("tokens_per_s")
        main = (ev.k, v["greedy"]) if "greedy" in cfg.modes and v["greedy"].get("tau") is not None else None
        if measured is not None:
            main, base_tps = None, measured.pop(0)["tokens_per_s"]
        results["k_sweep"] = k_sweep(cfg, ev.vcfg, ev.model_path, ev.ckpt, ev.prompts, ev.out_dir, ev.vkey, base_tps,
                                     k_model, main, measured)
        results["phases"]["k_sweep"] = {"seconds": round(time.time() - t0, 1)}


def sampling(ev: Evaluation) -> None:
    """Sampled tau by draft sample method (and block verification), each on its own server (vLLM's default drafting on
    a given spec server), every prompt alone, with the library's tau beside it
    (eagle3lib/evaluation/draft_sampling.py)."""
    ev.servers.close_all()  # each configuration's server measures alone
    t0 = time.time()
    block = draft_sampling(ev.cfg, ev.vcfg, ev.model_path, ev.ckpt, ev.prompts, ev.k, ev.eos, ev.out_dir, ev.vkey,
                           ev.servers.url("spec")[0])
    ev.results["draft_sampling"] = block
    ev.results["phases"]["draft_sampling"] = {"seconds": round(time.time() - t0, 1)}
    for name, why in block["unserved"].items():
        ev.notes.append(f"evaluate.draft_sample_methods: {name} is not served by this vLLM here ({why}); on a GPU: "
                        f"{block['gpu_command']}")


def finish(ev: Evaluation, timer: StageTimer, plot: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    """Figures, results.json, comparison.png (`plot`: results -> a matplotlib figure), the training run's trackers, the
    manifest."""
    results, notes, out_dir = ev.results, ev.notes, ev.out_dir
    results["table"] = comparison_rows(results)
    figures = {**build_figures(results), **grid_figures(results.get("concurrency_grid")),
               **sampling_figures(results.get("draft_sampling"))}
    notes.extend(disagreements(figures, results, ev.cfg))
    figures["warnings"] = len(notes)
    figures["wall_s"] = round(time.time() - ev.t_start, 1)
    write_json_atomic(out_dir / "results.json", without_outputs(results))
    outputs = {"results": "results.json", "checkpoint": str(ev.ckpt)}
    try:
        fig = plot(results)
        fig.savefig(out_dir / "comparison.png", dpi=110, bbox_inches="tight")
        import matplotlib.pyplot as plt

        plt.close(fig)
        outputs["plot"] = "comparison.png"
    except Exception as e:  # a plot must never cost the measurement
        notes.append(f"comparison plot not written: {type(e).__name__}: {e}")
    for name in ("vllm_spec.log", "vllm_base.log"):
        if (out_dir / name).exists():
            outputs[name.removesuffix(".log") + "_log"] = name
    if ev.train_m is not None:  # the table also goes to the training run's trackers, when it has some
        steps = int((ev.train_m.get("figures") or {}).get("steps") or 0)
        values = {k_: float(v_) for k_, v_ in figures.items() if k_.startswith("tau_") and isinstance(v_, int | float)
                  and not isinstance(v_, bool)}
        notes.extend(log_evaluation(ev.ctx.profile.section("train"), ev.ctx.stage_dir("train"), "evaluate",
                                    results["table"], values, steps))
    timer.finish({k_: v_ for k_, v_ in figures.items() if v_ is None or isinstance(v_, int | float | bool)}, outputs)
    update_manifest(out_dir, warnings=notes)
    return {"figures": figures, "results": results, "outputs": outputs}
