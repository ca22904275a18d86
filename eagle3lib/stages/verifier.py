"""The verifier stage: make sure the verifier exists (building the tiny one), describe it, and show how it answers.

A drafter's acceptance length on a random or looping verifier means nothing, so this report shows the held-out loss
and real greedy and sampled chat answers, served by vLLM exactly as the generate stage will use it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from eagle3lib.config.stages import StageContext
from eagle3lib.config.verifier import VerifierConfig
from eagle3lib.config.verifier_report import VerifierReportConfig
from eagle3lib.core.paths import ASSETS_DIR
from eagle3lib.model.drafter_shape import verifier_is_mla
from eagle3lib.model.verifier import aux_layer_ids, describe_model, load_config, resolve_model
from eagle3lib.vllm.client import chat_once
from eagle3lib.vllm.server import verifier_endpoint_for_stage

HELDOUT_PROMPTS = ASSETS_DIR / "prompts" / "heldout.jsonl"


def describe(model_path: str, verifier_cfg: VerifierConfig) -> dict[str, Any]:
    c = load_config(model_path, verifier_cfg.trust_remote_code)
    out = {
        "architecture": (getattr(c, "architectures", None) or [type(c).__name__])[0],
        "num_layers": c.num_hidden_layers,
        "hidden_size": c.hidden_size,
        "vocab_size": c.vocab_size,
        "aux_layer_ids": aux_layer_ids(verifier_cfg.aux_layer_ids, c.num_hidden_layers),
        "attention": "MLA (latent)" if verifier_is_mla(c) else "standard",
    }
    if verifier_is_mla(c):
        out.update({k: getattr(c, k, None) for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                                                     "v_head_dim")})
    if getattr(c, "n_routed_experts", None):
        out.update({"routed_experts": c.n_routed_experts, "experts_per_token": c.num_experts_per_tok,
                    "shared_experts": getattr(c, "n_shared_experts", None),
                    "first_dense_layers": getattr(c, "first_k_dense_replace", None),
                    "router": f"{getattr(c, 'scoring_func', 'softmax')}, {getattr(c, 'topk_method', 'greedy')}"})
    report = Path(model_path) / "build_report.json"
    if report.exists():  # a tiny verifier records what its build measured; a packaged one what its weights are
        b = json.loads(report.read_text())
        keys = ("parameters", "heldout_loss", "final_train_loss", "train_tokens", "train_tokens_per_s", "build_seconds",
                "recipe_key", "train_loss_curve",
                "weights", "source", "gguf_sha256", "gguf_tensor_types", "license")  # model/packaged.py
        out.update({k: b[k] for k in keys if k in b})
        if "gguf_tensor_types" in out:  # a line the figures table shows: "Q4_1 210, F32 61, Q8_0 1"
            out["gguf_tensor_types"] = ", ".join(f"{t} {n}" for t, n in out["gguf_tensor_types"].items())
    return out


def sample_answers(endpoint, prompts: list[dict], cfg: VerifierReportConfig) -> list[dict]:
    rows = []
    for p in prompts:
        for mode, temp in (("greedy", 0.0), ("sampled", cfg.temperature)):
            t0 = time.time()
            r = chat_once(endpoint, p["messages"], max_tokens=cfg.max_tokens, temperature=temp, seed=cfg.seed)
            rows.append({"id": p["id"], "category": p["category"], "mode": mode, "prompt": p["messages"][-1]["content"],
                         "reasoning": r.reasoning, "content": r.content, "finish_reason": r.finish_reason,
                         "completion_tokens": r.completion_tokens, "seconds": round(time.time() - t0, 3)})
    return rows


def run(ctx: StageContext) -> dict[str, Any]:
    cfg, vcfg = ctx.cfg, ctx.verifier
    timer = ctx.timer()
    t0 = time.time()
    model_path = resolve_model(vcfg.model)
    figures: dict[str, Any] = {"model": describe_model(vcfg.model),
                               "resolve_seconds": round(time.time() - t0, 1), **describe(model_path, vcfg)}
    answers: list[dict] = []
    if cfg.serve and cfg.n_prompts > 0:
        prompts = [json.loads(line) for line in HELDOUT_PROMPTS.read_text().splitlines()[: cfg.n_prompts]]
        with verifier_endpoint_for_stage(vcfg, model_path, ctx.dir / "vllm.log", figures) as (endpoint, _):
            figures.update({f"server_{k}": v for k, v in endpoint.info().items() if k != "base_url"})
            answers = sample_answers(endpoint, prompts, cfg)
        (ctx.dir / "answers.jsonl").write_text("".join(json.dumps(a) + "\n" for a in answers))
        greedy = [a for a in answers if a["mode"] == "greedy"]
        figures["answers"] = len(answers)
        figures["greedy_stop_fraction"] = sum(a["finish_reason"] == "stop" for a in greedy) / max(1, len(greedy))
        figures["greedy_with_reasoning_fraction"] = sum(bool(a["reasoning"]) for a in greedy) / max(1, len(greedy))
    timer.finish(figures, {"answers": "answers.jsonl" if answers else None, "model_path": model_path})
    return {"figures": figures, "answers": answers, "model_path": model_path}
