"""How many tokens to draft per step: `evaluate.ttt_steps_sweep` measures greedy acceptance, the acceptance per draft
position and tokens/s at each K through vLLM (one speculative server per K: num_speculative_tokens is fixed per
server), on the evaluation's prompts, beside the verifier alone; the K of the main measurement reuses it.

Two recommendations, kept apart because one machine cannot show the other's economics:
  measured here   the K with the highest measured tokens/s over the verifier alone (on 2 CPU cores a drafter step
                  costs about as much as a verifier step, so this is rarely what a GPU wants);
  GPU model       speedup(K) from eagle3lib/analysis/decode_time.py (a MODEL: bytes and FLOPs of the verifier checking
                  K + 1 tokens per request, MoE experts counted, and of the drafter's K forwards, fc once per round)
                  with the measured tau(K), on the deployment section's first hardware row at evaluate.concurrency:
                  an estimate to plan with, labelled as such, never a measurement. The deployment stage draws it over
                  every concurrency and hardware row.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from eagle3lib.config.evaluate import EvaluateConfig
from eagle3lib.config.verifier import VerifierConfig
from eagle3lib.evaluation.spec_pass import measure_spec


def sweep_rows(measured: dict[int, dict[str, Any]], base_tokens_per_s: float | None,
               gpu_model: Callable[[int, float], float] | None) -> list[dict[str, Any]]:
    """One row per K: tau, acceptance per position, tokens/s, measured speedup here, modelled GPU speedup."""
    rows = []
    for k in sorted(measured):
        r = measured[k]
        tps = r.get("tokens_per_s")
        row = {"ttt_steps": k, "tau": r.get("tau"), "tokens_per_s": tps,
               "speedup_here": tps / base_tokens_per_s if tps and base_tokens_per_s else None,
               "gpu_speedup_model": gpu_model(k, r["tau"]) if gpu_model and r.get("tau") else None}
        for i, rate in enumerate(r.get("accept_rate_pos") or [], 1):
            row[f"accept_rate_pos_{i}"] = rate
        rows.append(row)
    return rows


def recommend(rows: list[dict[str, Any]]) -> dict[str, int | None]:
    """The K with the best measured speedup here, and the K with the best modelled GPU speedup."""
    def best(col: str) -> int | None:
        ok = [r for r in rows if r.get(col) is not None]
        return max(ok, key=lambda r: r[col])["ttt_steps"] if ok else None

    return {"k_best_here": best("speedup_here"), "k_best_gpu_model": best("gpu_speedup_model")}


def k_sweep(cfg: EvaluateConfig, vcfg: VerifierConfig, model_path: str, ckpt: Path, prompts, out_dir: Path,
            vkey: dict[str, Any], base_tokens_per_s: float | None,
            gpu_model: tuple[Callable[[int, float], float], str] | None,
            main: tuple[int, dict[str, Any]] | None = None, measured: dict[int, dict[str, Any]] | None = None
            ) -> dict[str, Any]:
    """Every K of evaluate.ttt_steps_sweep measured on its own server, except the main measurement's K (`main`: its K
    and its greedy pass, same drafter, prompts and settings), which is reused: a server start fewer, minutes for a
    large verifier. `measured`: the passes already made per K (the concurrency grid's at evaluate.concurrency), used
    instead of any server. `gpu_model`: (speedup of K drafts at tau, what it models), or None. Returns the rows and
    both recommendations."""
    given = measured is not None
    measured = dict(measured or {})
    for k in sorted(set(cfg.ttt_steps_sweep)):
        if k in measured:
            continue
        if main is not None and k == main[0]:
            measured[k] = main[1]
            continue
        measured[k] = measure_spec(cfg, vcfg, model_path, ckpt, prompts, k, out_dir, f"vllm_spec_k{k}",
                                   {**vkey, "which": f"spec_k{k}", "k": k})
    rows = sweep_rows(measured, base_tokens_per_s, gpu_model[0] if gpu_model else None)
    return {"rows": rows, "gpu_model": gpu_model[1] if gpu_model else None, "reused_main_k": main[0] if main is not None and main[0] in measured else None,
            "from_concurrency_grid": given,
            **recommend(rows)}
