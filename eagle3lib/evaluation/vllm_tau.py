"""One drafter's acceptance through vLLM, on the evaluate section's prompts and server settings: what the evaluate
stage measures as tau_vllm_greedy (and _sampled), for a drafter that is not the run's own (a data-scaling point, a
drafting recipe), or the verifier alone's tokens/s to compare them with."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from eagle3lib.config.evaluate import EvaluateConfig
from eagle3lib.config.verifier import VerifierConfig
from eagle3lib.evaluation.inputs import select_prompts
from eagle3lib.evaluation.phases import load_phase, measurement_key, save_phase
from eagle3lib.evaluation.servers import Servers, pass_settings
from eagle3lib.vllm.measure import measure_vllm


def measure_served(ecfg: EvaluateConfig, vcfg: VerifierConfig, ckpt: Path | None, k: int, log_dir: Path, modes: list[str],
                   key: str, keep: tuple[Path, str] | None = None) -> dict[str, Any]:
    """Start the verifier with `ckpt` as its speculator (K = k; None: the verifier alone, or evaluate's given base
    server), decode evaluate's prompts once per mode, stop it. Per mode: tau, acceptance per draft position, tau per
    category and per context bucket (evaluate.context_buckets), output tokens/s and the outputs (token ids by prompt
    id); plus the server's start-up seconds. `key` names what asked for it in errors. `keep` (folder, phase name):
    kept there as a measurement phase under its `measurement_key`, and reused when nothing it depends on changed."""
    from eagle3lib.model.verifier import load_tokenizer, resolve_model

    model_path = resolve_model(vcfg.model)
    tok = load_tokenizer(model_path, vcfg.trust_remote_code)
    prompts, _, _ = select_prompts(ecfg, tok, vcfg.max_model_len, k)
    cfg = ecfg.model_copy(update={"modes": list(modes), "spec_server_url": None})
    which = "spec" if ckpt is not None else "base"
    servers = Servers(cfg, vcfg, model_path, log_dir)
    how = pass_settings(cfg)
    mkey = measurement_key(how, prompts, ckpt, k if ckpt is not None else None, vcfg, model_path, cfg.server_args,
                           servers.key_url(which))
    if keep is not None and (cached := load_phase(*keep, mkey)) is not None:
        return cached
    t0 = time.time()
    try:
        servers.open(which, ckpt, k if ckpt is not None else None, background=False)
        res = measure_vllm(how, servers.get(which), prompts, k, which, key)
    finally:
        servers.close_all()
    out: dict[str, Any] = {"prompts": len(prompts), "start_seconds": servers.start_seconds.get(which),
                           "seconds": round(time.time() - t0, 1)}
    for m in modes:
        r = res[m]
        out[m] = {"tau": r.get("tau"), "accept_rate_pos": r.get("accept_rate_pos"), "tokens_per_s": r["tokens_per_s"],
                  "categories": {c: v.get("tau") for c, v in r["categories"].items()}, "outputs": r["outputs"],
                  "context_buckets": {b: v.get("tau") for b, v in (r.get("context_buckets") or {}).items()}}
        if ecfg.per_prompt:  # every prompt alone: its rounds and accepted drafts, for intervals over prompts
            out[m]["per_prompt"] = [{f: row.get(f) for f in ("id", "rounds", "accepted", "accepted_per_pos")}
                                    for row in (r.get("per_prompt") or {}).values()]
    if keep is not None:
        save_phase(*keep, mkey, out)
    return out


def measure_greedy_tau(ecfg: EvaluateConfig, vcfg: VerifierConfig, ckpt: Path, k: int, log_dir: Path,
                       keep: tuple[Path, str] | None = None) -> dict[str, Any]:
    """Greedy only: tau, the acceptance rate per draft position, output tokens/s and the server's start-up seconds."""
    res = measure_served(ecfg, vcfg, ckpt, k, log_dir, ["greedy"], "data_scaling", keep)
    g = res["greedy"]
    return {"tau": g["tau"], "accept_rate_pos": g["accept_rate_pos"], "tokens_per_s": g["tokens_per_s"],
            "prompts": res["prompts"], "start_seconds": res["start_seconds"], "seconds": res["seconds"]}
