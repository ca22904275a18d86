"""When does the drafter pay, and with how many tokens: `evaluate.concurrency_sweep` measures output tokens/s and time
per output token for every (K, concurrency), K = 0 being the verifier alone, then derives the K schedule per batch size
and serves it.

Why a grid: speculation wins most at batch 1. A verification round checks K + 1 tokens per request; while decoding is
memory-bound (small batches) those extra tokens ride on weights that are read anyway, but as the batch grows the step
becomes compute-bound and every rejected draft token is paid for. So the best K falls with the batch size, down to 0
(no speculation) where the drafter's own steps cost more than the tokens they save. vLLM 0.32 can follow such a schedule
(`speculative_config.num_speculative_tokens_per_batch_size`, a list of inclusive (first batch size, last batch size,
K) ranges, looked up by the number of requests scheduled in a step; vllm/v1/spec_decode/dynamic/utils.py).

One server per K (vLLM fixes the speculator per server), reused across the concurrencies; the same prompts at every
point. A pass sends at least 8 x concurrency requests (the prompts cycled), so the batch holds `concurrency` requests
for most of it rather than draining at once; one group, no category boundaries (those would drain the batch too).
Each K's passes are one measurement phase, kept once complete (a rerun resumes at the first K not measured).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from eagle3lib.config.evaluate import EvaluateConfig
from eagle3lib.config.verifier import VerifierConfig
from eagle3lib.evaluation.phases import load_phase, save_phase
from eagle3lib.evaluation.results import same_frac
from eagle3lib.vllm.k_schedule import fastest_k, schedule_ranges
from eagle3lib.vllm.measure import run_pass, warmup
from eagle3lib.vllm.serving import served
from eagle3lib.vllm.speculative_config import speculative_config


def grid_prompts(prompts, concurrency: int):
    """The pass's requests: every prompt once, cycled to at least 8 x concurrency; one group ("all")."""
    n = max(len(prompts), 8 * concurrency)
    return [replace(prompts[i % len(prompts)], id=f"{prompts[i % len(prompts)].id}#{i // len(prompts)}",
                    category="all") for i in range(n)]


def schedule_extra(schedule: list[list[int]] | None) -> dict[str, Any]:
    """What a K schedule adds to vLLM's --speculative-config (K itself is its largest value, the ceiling vLLM clamps
    each range to)."""
    return {"num_speculative_tokens_per_batch_size": [list(r) for r in schedule]} if schedule else {}


def scheduled_config(ckpt: Path, k: int, schedule: list[list[int]] | None = None) -> dict[str, Any]:
    """vLLM's --speculative-config for drafter `ckpt` at K, with a schedule when given."""
    return {**speculative_config(ckpt, k), **schedule_extra(schedule)}


def measure_row_set(cfg: EvaluateConfig, ep, prompts, concurrencies: list[int], counters: bool,
                    label: str) -> dict[int, dict[str, Any]]:
    """One server's greedy passes, evaluate.grid_repeats per concurrency, the fastest kept (every pass's tokens/s beside
    it; on a shared machine a stall, another process or the client's own CPU time only ever slows a pass): tokens/s, time per output token, tau and acceptance per position (speculative servers), and
    the outputs (for the greedy-identical check)."""
    warmup(ep, prompts, cfg.warmup_requests, min(16, cfg.max_tokens), 0.0, cfg.request_timeout_s)
    out = {}
    for c in concurrencies:
        passes = []
        for i in range(cfg.grid_repeats):
            res = run_pass(ep, grid_prompts(prompts, c), temperature=0.0, max_tokens=cfg.max_tokens, concurrency=c,
                           request_timeout_s=cfg.request_timeout_s, connect_timeout_s=cfg.connect_timeout_s,
                           counters=counters, label=f"{label} c={c} ({i + 1}/{cfg.grid_repeats})", progress=cfg.progress)
            passes.append(res)
        res = max(passes, key=lambda r: r["tokens_per_s"] or 0.0)  # the fastest: interference only slows a pass
        out[c] = {key: res.get(key) for key in ("requests", "seconds", "output_tokens", "tokens_per_s", "tpot_ms",
                                                "tau", "rounds", "draft_tokens", "accept_rate_pos", "outputs")}
        out[c]["tokens_per_s_passes"] = [r["tokens_per_s"] for r in passes]
    return out


def _phase(cfg: EvaluateConfig, vcfg: VerifierConfig, model_path, out_dir, prompts, name: str, key: dict[str, Any],
           url: str | None, ckpt: Path | None = None, k: int | None = None,
           schedule: list[list[int]] | None = None) -> dict[int, dict[str, Any]]:
    """One server's rows (`ckpt` None: the verifier alone), kept as a phase; `url` a given server, else one started."""
    cached = load_phase(out_dir, name, key)
    if cached is not None:
        return {int(c): row for c, row in cached.items()}
    with served(vcfg, model_path, out_dir / f"{name}.log", ckpt, k, url=url, spec_extra=schedule_extra(schedule),
                server_args=cfg.server_args, connect_timeout_s=cfg.connect_timeout_s) as ep:
        rows = measure_row_set(cfg, ep, prompts, sorted(cfg.concurrency_sweep), ckpt is not None, name)
    save_phase(out_dir, name, key, {str(c): row for c, row in rows.items()})
    return rows


def serve_command(model: str, ckpt: Path, schedule: list[list[int]]) -> str:
    """The `vllm serve` line that deploys the schedule."""
    spec = scheduled_config(ckpt, max(k for *_, k in schedule), schedule)
    return f"vllm serve {model} --speculative-config '{json.dumps(spec)}'"


def grid_rows(measured: dict[int, dict[int, dict[str, Any]]], base: int = 0) -> list[dict[str, Any]]:
    """One row per (K, concurrency): K = 0 is the verifier alone; speedup against it at the same concurrency; the
    greedy outputs' agreement with it."""
    rows = []
    for k in sorted(measured):
        for c, r in sorted(measured[k].items()):
            b = measured[base].get(c) or {}
            row = {"ttt_steps": k, "concurrency": c, "tokens_per_s": r["tokens_per_s"], "tpot_ms": r["tpot_ms"],
                   "speedup": r["tokens_per_s"] / b["tokens_per_s"] if b.get("tokens_per_s") else None,
                   "tau": r.get("tau"), "greedy_same_output_frac": same_frac(r.get("outputs") or {},
                                                                             b.get("outputs") or {})}
            for i, rate in enumerate(r.get("accept_rate_pos") or [], 1):
                row[f"accept_rate_pos_{i}"] = rate
            rows.append(row)
    return rows


def schedule_comparison(rows: list[dict[str, Any]], sched: dict[int, dict[str, Any]],
                        base: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The served schedule against every fixed K: per concurrency its tokens/s over the best fixed K's; over the grid,
    the geometric mean of each policy's tokens/s relative to the best fixed K at each concurrency (1.0 = best
    everywhere), the schedule's beside every fixed K's; and its greedy outputs against the verifier alone's."""
    by = {(r["ttt_steps"], r["concurrency"]): r["tokens_per_s"] for r in rows}
    cs = sorted({r["concurrency"] for r in rows})
    ks = sorted({r["ttt_steps"] for r in rows})
    best = {c: max(by[(k, c)] for k in ks if by.get((k, c))) for c in cs}

    def geo(values: list[float]) -> float:
        prod = 1.0
        for v in values:
            prod *= v
        return prod ** (1.0 / len(values))

    per_c = [{"concurrency": c, "tokens_per_s": sched[c]["tokens_per_s"], "best_fixed_tokens_per_s": best[c],
              "vs_best_fixed": sched[c]["tokens_per_s"] / best[c], "tau": sched[c].get("tau"),
              "drafted_per_round": (sched[c]["draft_tokens"] / sched[c]["rounds"]) if sched[c].get("rounds") else 0.0,
              "greedy_same_output_frac": same_frac(sched[c].get("outputs") or {}, base[c].get("outputs") or {})}
             for c in cs]
    overall = {f"k{k}": geo([by[(k, c)] / best[c] for c in cs]) for k in ks}
    overall["schedule"] = geo([row["vs_best_fixed"] for row in per_c])
    return {"per_concurrency": per_c, "grid_score": overall,
            "schedule_beats_every_fixed_k": all(overall["schedule"] >= v for k, v in overall.items() if k != "schedule")}


def sweep_measurements(grid: dict[str, Any], concurrency: int) -> dict[int, dict[str, Any]] | None:
    """The grid's rows at evaluate.concurrency as the K sweep's measurements per K (0: the verifier alone), so the
    sweep needs no server of its own; None when the grid has no point there."""
    rows = {r["ttt_steps"]: r for r in grid["rows"] if r["concurrency"] == concurrency}
    if not rows:
        return None
    return {k: {"tau": r["tau"], "tokens_per_s": r["tokens_per_s"],
                "accept_rate_pos": [r[f"accept_rate_pos_{i}"] for i in range(1, k + 1)]} for k, r in rows.items()}


def concurrency_grid(cfg: EvaluateConfig, vcfg: VerifierConfig, model_path: str, ckpt: Path, prompts, ttt_steps: int,
                     out_dir: Path, vkey: dict[str, Any], urls: dict[str, str | None]) -> dict[str, Any]:
    """The grid over K in (evaluate.ttt_steps_sweep or the main K) and 0, at every evaluate.concurrency_sweep point;
    then the schedule derived from it (or evaluate.ttt_steps_schedule), served and measured at the same points. `urls`: a given server for "base"
    (K = 0) and "spec" (the main K), used instead of starting one."""
    ks = sorted(set(cfg.ttt_steps_sweep or [ttt_steps]))
    key = {**vkey, "concurrency_sweep": sorted(cfg.concurrency_sweep), "grid_repeats": cfg.grid_repeats}
    measured = {0: _phase(cfg, vcfg, model_path, out_dir, prompts, "grid_k0", {**key, "which": "grid_k0",
                                                                                 "url": urls.get("base")},
                          urls.get("base"))}
    for k in ks:
        url = urls.get("spec") if k == ttt_steps else None
        measured[k] = _phase(cfg, vcfg, model_path, out_dir, prompts, f"grid_k{k}", {**key, "which": f"grid_k{k}",
                                                                                      "k": k, "url": url},
                             url, ckpt, k)
    rows = grid_rows(measured)
    best = fastest_k(rows)
    out: dict[str, Any] = {"ks": ks, "concurrencies": sorted(cfg.concurrency_sweep), "rows": rows,
                           "best_k": {str(c): k for c, k in sorted(best.items())}, "schedule": None}
    derived = None if all(k == 0 for k in best.values()) else schedule_ranges(best)
    out["derived_schedule"] = derived
    sched = [list(r) for r in cfg.ttt_steps_schedule] if cfg.ttt_steps_schedule else derived
    if sched is None:
        out["note"] = "the verifier alone was fastest at every concurrency: no schedule to serve"
        return out
    out["schedule_source"] = "evaluate.ttt_steps_schedule" if cfg.ttt_steps_schedule else "derived from the grid"
    top = max(k for *_, k in sched)
    on_schedule = _phase(cfg, vcfg, model_path, out_dir, prompts, "grid_schedule",
                         {**key, "which": "grid_schedule", "schedule": sched}, None, ckpt, top, sched)
    out.update({"schedule": sched, "serve_command": serve_command(vcfg.served_model_name or vcfg.model, ckpt, sched),
                "speculative_config": scheduled_config(ckpt, top, sched),
                **schedule_comparison(rows, on_schedule, measured[0])})
    return out


def grid_figures(grid: dict[str, Any] | None) -> dict[str, Any]:
    """The manifest's flat figures: speedup and time per output token per (K, concurrency), the K measured best at
    each concurrency, and the schedule against the fixed Ks."""
    if not grid:
        return {}
    f: dict[str, Any] = {}
    for r in grid["rows"]:
        kc = f"k{r['ttt_steps']}_c{r['concurrency']}"
        f[f"grid_tokens_per_s_{kc}"] = r["tokens_per_s"]
        f[f"grid_tpot_ms_{kc}"] = r["tpot_ms"]
        if r["ttt_steps"]:
            f[f"grid_speedup_{kc}"] = r["speedup"]
            f[f"grid_tau_{kc}"] = r["tau"]
    for c, k in grid["best_k"].items():
        f[f"grid_best_k_c{c}"] = k
    for row in grid.get("per_concurrency") or []:
        f[f"schedule_vs_best_fixed_c{row['concurrency']}"] = row["vs_best_fixed"]
    for name, score in (grid.get("grid_score") or {}).items():
        f[f"grid_score_{name}"] = score
    if grid.get("schedule"):
        f["schedule_beats_every_fixed_k"] = grid["schedule_beats_every_fixed_k"]
    return f
