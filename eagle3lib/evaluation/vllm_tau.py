"""One drafter's greedy acceptance length through vLLM, on the evaluate section's prompts and server settings: what
the evaluate stage measures as tau_vllm_greedy, for a drafter that is not the run's own (a data-scaling point)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from eagle3lib.evaluation.inputs import select_prompts
from eagle3lib.vllm.measure import measure_vllm
from eagle3lib.vllm.servers import Servers
from eagle3lib.vllm.speculative_config import eagle3_speculative_config


def measure_greedy_tau(ecfg, vcfg, ckpt: Path, k: int, log_dir: Path) -> dict[str, Any]:
    """Start the verifier with `ckpt` as its EAGLE-3 speculator (K = k), decode evaluate's prompts greedily, stop it.
    Returns tau, the acceptance rate per draft position, output tokens/s and the server's start-up seconds."""
    from eagle3lib.model.verifier import load_tokenizer, resolve_model

    model_path = resolve_model(vcfg.model)
    tok = load_tokenizer(model_path, vcfg.trust_remote_code)
    prompts, _, _ = select_prompts(ecfg, tok, vcfg.max_model_len, k)
    cfg = ecfg.model_copy(update={"modes": ["greedy"], "spec_server_url": None})
    servers = Servers(cfg, vcfg, model_path, log_dir)
    t0 = time.time()
    try:
        servers.open("spec", eagle3_speculative_config(ckpt, k), background=False)
        res = measure_vllm(cfg, servers.get("spec"), prompts, k, "spec", "data_scaling")
    finally:
        servers.close_all()
    g = res["greedy"]
    return {"tau": g["tau"], "accept_rate_pos": g["accept_rate_pos"], "tokens_per_s": g["tokens_per_s"],
            "prompts": len(prompts), "start_seconds": servers.start_seconds.get("spec"),
            "seconds": round(time.time() - t0, 1)}
