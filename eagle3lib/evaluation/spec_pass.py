"""One greedy pass through a speculative vLLM server started for it: the unit of the K sweep and of drafters measured
side by side (each drafter and each K needs its own server: vLLM fixes the speculator and num_speculative_tokens per
server). Kept as a measurement phase keyed by everything it depends on, so a rerun reuses it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle3lib.config.evaluate import EvaluateConfig
from eagle3lib.config.verifier import VerifierConfig
from eagle3lib.evaluation.phases import load_phase, save_phase
from eagle3lib.vllm.measure import prompt_bucket, run_pass, warmup
from eagle3lib.vllm.serving import served


def measure_spec(cfg: EvaluateConfig, vcfg: VerifierConfig, model_path: str, ckpt: Path, prompts, k: int, out_dir: Path, name: str,
                 key: dict[str, Any]) -> dict[str, Any]:
    """Greedy tau, acceptance per position and per category, and tokens/s of drafter `ckpt` drafting k tokens per
    step; the server logs to RUN_DIR/evaluate/<name>.log and stops after."""
    cached = load_phase(out_dir, name, key)
    if cached is not None:
        return cached
    with served(vcfg, model_path, out_dir / f"{name}.log", ckpt, k, server_args=cfg.server_args) as ep:
        warmup(ep, prompts, cfg.warmup_requests, min(16, cfg.max_tokens), 0.0, cfg.request_timeout_s)
        res = run_pass(ep, prompts, temperature=0.0, max_tokens=cfg.max_tokens, concurrency=cfg.concurrency,
                       request_timeout_s=cfg.request_timeout_s, connect_timeout_s=cfg.connect_timeout_s,
                       counters=True, label=name, progress=cfg.progress, bucket=prompt_bucket(cfg.context_buckets))
    res.pop("outputs", None)
    save_phase(out_dir, name, key, res)
    return res
