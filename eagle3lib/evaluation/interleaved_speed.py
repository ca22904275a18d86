"""The vLLM speedup measured with the two servers interleaved (`evaluate.speed_repeats`): greedy passes over the same
prompts alternate between the drafter's server and the verifier alone's, in alternating order (spec, base; base,
spec; ...), so whatever else loads the machine at the time loads both. The speedup of each repeat is the ratio of the
two passes next to each other; the reported figure is the median ratio, with the lowest and highest ratio of the
repeats as its range.

Why: measured one after the other, the demo's speedup read 2.37x at one commit and 1.19x an hour earlier at the same
acceptance: on 2 shared cores a pass's throughput moves with whatever else runs, and a ratio of two passes minutes
apart carries all of it. Both servers must be up at once: local servers on CPU, or given URLs; two local servers of
one model on the same GPUs cannot both hold it, so there the phase is skipped and says so.
"""

from __future__ import annotations

import statistics
from typing import Any

from eagle3lib.config.evaluate import EvaluateConfig
from eagle3lib.vllm.measure import EvalPrompt, run_pass, warmup


def interleaved_speed(cfg: EvaluateConfig, endpoints: dict[str, Any], prompts: list[EvalPrompt]) -> dict[str, Any]:
    """`endpoints`: {"spec": ..., "base": ...}, both answering. Returns every pass's tokens/s, the ratio per repeat,
    the median ratio and its range."""
    for ep in endpoints.values():
        warmup(ep, prompts, cfg.warmup_requests, min(16, cfg.max_tokens), 0.0, cfg.request_timeout_s)
    repeats = []
    for r in range(cfg.speed_repeats):
        order = ("spec", "base") if r % 2 == 0 else ("base", "spec")
        tps = {}
        for w in order:
            p = run_pass(endpoints[w], prompts, temperature=0.0, max_tokens=cfg.max_tokens, concurrency=cfg.concurrency,
                         request_timeout_s=cfg.request_timeout_s, connect_timeout_s=cfg.connect_timeout_s,
                         counters=False, label=f"speed {r + 1}/{cfg.speed_repeats} {w}", progress=cfg.progress)
            tps[w] = p["tokens_per_s"]
        repeats.append({"order": list(order), "spec_tokens_per_s": tps["spec"], "base_tokens_per_s": tps["base"],
                        "speedup": tps["spec"] / tps["base"] if tps["spec"] and tps["base"] else None})
    ratios = [x["speedup"] for x in repeats if x["speedup"] is not None]
    return {"repeats": repeats, "concurrency": cfg.concurrency,
            "speedup": statistics.median(ratios) if ratios else None,
            "speedup_range": [min(ratios), max(ratios)] if ratios else None}
