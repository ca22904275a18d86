"""The library's measurement: plain and speculative decoding of every prompt with the HF verifier and the drafter
(eagle3lib/model/speculative.py), one sequence at a time, interleaved per prompt so background load slows both alike."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from eagle3lib.config.evaluate import EvaluateConfig
from eagle3lib.config.verifier import VerifierConfig
from eagle3lib.vllm.measure import EvalPrompt


def library_device(cfg: EvaluateConfig):
    """The torch device the library measures on (evaluate.device)."""
    import torch

    from eagle3lib.model.hf_extract import pick_device

    return torch.device(pick_device(cfg.device))


def measure_library(cfg: EvaluateConfig, vcfg: VerifierConfig, model_path: str, ckpt: Path, prompts: list[EvalPrompt],
                    k: int, eos: list[int]) -> dict[str, Any]:
    """Plain decoding and speculative decoding (greedy, sampled) of every prompt with the HF verifier, interleaved per
    prompt so that background load slows both alike. Returns per-prompt records (JSON-ready)."""
    import torch

    dev = library_device(cfg)
    threads = torch.get_num_threads()
    if dev.type == "cpu" and cfg.cpu_threads:
        torch.set_num_threads(cfg.cpu_threads)
    try:
        return _library_runs(cfg, vcfg, model_path, ckpt, prompts, k, eos, dev)
    finally:
        torch.set_num_threads(threads)
        import gc

        gc.collect()  # the models are gone with _library_runs' frame
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the vLLM servers measured next need the GPU memory


def _library_runs(cfg: EvaluateConfig, vcfg: VerifierConfig, model_path: str, ckpt: Path, prompts: list[EvalPrompt],
                  k: int, eos: list[int], dev) -> dict[str, Any]:
    import torch

    from eagle3lib.core.progress import progress_bar
    from eagle3lib.model.checkpoint import load_drafter
    from eagle3lib.model.speculative import EagleDrafter, Verifier, plain_decode, speculative_decode
    from eagle3lib.model.verifier import load_hf_model

    model = load_hf_model(model_path, cfg.lib_dtype, device_map=cfg.device_map,
                          trust_remote_code=vcfg.trust_remote_code)
    if cfg.device_map is None:
        model.to(dev)
    ddev = model.get_input_embeddings().weight.device
    drafter, _ = load_drafter(ckpt, device=ddev, verifier_path=model_path, dtype=getattr(torch, cfg.lib_dtype))
    verifier = Verifier(model)
    eagle = EagleDrafter(drafter, sample=cfg.draft_sampling == "probabilistic")
    base_mode = "greedy" if "greedy" in cfg.modes else "sampled"
    base_t = 0.0 if base_mode == "greedy" else cfg.temperature
    # warm-up (allocator, first-call overheads), untimed
    w = prompts[0].token_ids
    plain_decode(verifier, w, min(8, cfg.max_tokens), eos=eos)
    speculative_decode(verifier, eagle, w, min(8, cfg.max_tokens), k, eos=eos)
    records = []
    bar = progress_bar(prompts, desc="library", unit="prompt", mininterval=5.0, disable=not cfg.progress)
    for i, p in enumerate(bar):
        rec: dict[str, Any] = {"id": p.id, "category": p.category, "prompt_tokens": len(p.token_ids)}
        plain = plain_decode(verifier, p.token_ids, cfg.max_tokens, eos=eos, temperature=base_t,
                             generator=torch.Generator().manual_seed(cfg.seed * 1_000_003 + i))
        rec["plain"] = asdict(plain)
        for mode in cfg.modes:
            t = 0.0 if mode == "greedy" else cfg.temperature
            r = speculative_decode(verifier, eagle, p.token_ids, cfg.max_tokens, k, eos=eos, temperature=t,
                                   generator=torch.Generator().manual_seed(cfg.seed * 1_000_003 + i))
            rec[mode] = asdict(r)
        if "greedy" in cfg.modes:
            rec["greedy_equals_plain"] = rec["greedy"]["tokens"] == plain.tokens
        records.append(rec)
    return {"records": records, "baseline_mode": base_mode, "device": str(dev), "dtype": cfg.lib_dtype,
            "threads": torch.get_num_threads()}


def per_prompt_rows(lib: dict[str, Any], modes: list[str]) -> list[dict[str, Any]]:
    """One row per prompt: lengths, tau per mode, and the plain vs speculative wall clock."""
    rows = []
    for r in lib["records"]:
        row = {"id": r["id"], "category": r["category"], "prompt_tokens": r["prompt_tokens"],
               "output_tokens": len(r["plain"]["tokens"]), "plain_seconds": r["plain"]["seconds"]}
        for mode in modes:
            x = r[mode]
            row[f"tau_{mode}"] = 1 + x["accepted"] / x["rounds"] if x["rounds"] else None
            row[f"{mode}_seconds"] = x["seconds"]
        rows.append(row)
    return rows


def summarize_library(lib: dict[str, Any], modes: list[str], k: int, edges: list[int] | None = None) -> dict[str, Any]:
    """Pooled figures per mode, per category and, with context-length `edges`, per context bucket."""
    from eagle3lib.data.context_buckets import library_buckets
    from eagle3lib.model.speculative import DecodeResult, summarize_runs

    recs = lib["records"]
    cats = sorted({r["category"] for r in recs})
    out: dict[str, Any] = {"baseline_mode": lib["baseline_mode"], "device": lib["device"], "dtype": lib["dtype"]}
    for mode in modes:
        def pooled(sel: list[dict[str, Any]], mode=mode) -> dict[str, Any]:
            return summarize_runs([DecodeResult(**r[mode]) for r in sel], k)

        out[mode] = {**pooled(recs), "categories": {c: pooled([r for r in recs if r["category"] == c]) for c in cats}}
        if edges:
            out[mode]["context_buckets"] = library_buckets(recs, mode, edges, k)
    plain_s = sum(r["plain"]["seconds"] for r in recs)
    plain_tok = sum(len(r["plain"]["tokens"]) for r in recs)
    base = out[lib["baseline_mode"]]
    out["plain"] = {"seconds": plain_s, "output_tokens": plain_tok, "tokens_per_s": plain_tok / plain_s if plain_s else None,
                    "forwards": sum(r["plain"]["forwards"] for r in recs)}
    out["spec_tokens_per_s"] = base["output_tokens"] / base["seconds"] if base["seconds"] else None
    out["speedup"] = plain_s / base["seconds"] if base["seconds"] else None
    if "greedy" in modes:
        out["greedy_equals_plain_frac"] = sum(bool(r.get("greedy_equals_plain")) for r in recs) / len(recs)
    return out
