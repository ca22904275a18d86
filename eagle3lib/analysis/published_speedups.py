"""Published GPU measurements of EAGLE-3 speedup against batch size, and the decode model's prediction for each.

The model predicts time, not acceptance, and these setups draft trees (SGLang's EAGLE-3: top-k candidates per step,
more tokens verified per request than a chain's K + 1) with acceptance lengths the sources give only in part. So each
comparison fixes tau with ONE number, the published speedup at the smallest batch, and then predicts the others:
what is compared is how the speedup falls as the batch grows, which is what the model is for.

Shapes are the models' published config.json values (Llama-3.1-8B-Instruct, Qwen3-8B); the drafters are one EAGLE-3
Llama layer at the verifier's hidden size with a 32,000-token draft vocabulary (as the published drafters).

Those two sources set deployment.flops_efficiency (docs/howto/choose-k.md): they calibrate the model. Absolute decode
speed of large MoE verifiers on 8-GPU machines, the model's other check, is eagle3lib/analysis/published_decode.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eagle3lib.analysis.decode_time import DrafterCost, Machine, VerifierCost, speedup
from eagle3lib.config.deployment import VerifierShape
from eagle3lib.model.drafter_shape import DrafterShape

LLAMA_31_8B = VerifierShape(num_hidden_layers=32, hidden_size=4096, vocab_size=128256, intermediate_size=14336,
                            num_attention_heads=32, num_key_value_heads=8, head_dim=128)
QWEN3_8B = VerifierShape(num_hidden_layers=36, hidden_size=4096, vocab_size=151936, intermediate_size=12288,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128)
KIMI_K25 = VerifierShape(num_hidden_layers=61, hidden_size=7168, vocab_size=163840, intermediate_size=18432,
                         num_attention_heads=64, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                         qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=384, num_experts_per_tok=8,
                         n_shared_experts=1, moe_intermediate_size=2048, first_k_dense_replace=1,
                         expert_weight_bytes=0.5625)  # moonshotai/Kimi-K2.5 text_config: int4 routed experts, the rest bf16


@dataclass(frozen=True)
class Published:
    source: str  # who measured it, and where (cited in the README)
    url: str
    setup: str  # engine, GPU, model, drafting settings, as the source states them
    verifier: VerifierShape
    hardware: str  # the params/hardware.yaml row with the GPU's figures (one GPU of it)
    draft_steps: int  # drafter forwards per round
    verify_tokens: int  # tokens verified per request per round
    draft_width: int  # candidates expanded per drafter forward (SGLang's top-k)
    speedup_by_batch: dict[int, float]  # the published figures
    context: int = 1024  # KV tokens per request: MT-bench / ShareGPT turns (prompt + half the answer), an assumption
    note: str = ""


PUBLISHED: tuple[Published, ...] = (
    Published(
        source="EAGLE-3 paper (Li et al., 2025, arXiv:2503.01840): SGLang throughput, abstract and SGLang table",
        url="https://arxiv.org/abs/2503.01840",
        setup="SGLang, 1x H100, LLaMA-Instruct 3.1 8B, MT-bench; batch 1: 373.25 vs 158.34 tokens/s",
        verifier=LLAMA_31_8B, hardware="h100-x8", draft_steps=5, verify_tokens=8, draft_width=4,
        speedup_by_batch={1: 373.25 / 158.34, 64: 1.38},
        note="tree settings assumed: SGLang's documented defaults (5 steps, top-k 4, 8 draft tokens)"),
    Published(
        source="GPUStack performance lab: Optimizing Qwen3-8B latency on NVIDIA H100 GPUs",
        url="https://docs.gpustack.ai/latest/performance-lab/qwen3-8b/h100-latency",
        setup="SGLang EAGLE-3 (4 steps, top-k 4, 16 draft tokens), Qwen3-8B-FP8, 1x H100, ShareGPT; mean request "
              "latency vs a vLLM baseline",
        verifier=QWEN3_8B.model_copy(update={"weight_bytes": 1.0}), hardware="h100-x8", draft_steps=4, verify_tokens=16,
        draft_width=4, speedup_by_batch={1: 1.66 / 0.62, 2: 1.68 / 0.71, 4: 1.68 / 0.77, 8: 1.78 / 1.10},
        note="the baseline is another engine (vLLM, default settings) and FP8 weights: the FP8 verifier is modelled"),
)


def _drafter(v: VerifierShape) -> DrafterCost:
    s = DrafterShape(hidden=v.hidden_size, intermediate=v.intermediate_size, heads=v.num_attention_heads,
                     kv_heads=v.num_key_value_heads or v.num_attention_heads, qk_dim=v.head_dim, v_dim=v.head_dim,
                     draft_vocab=32000, vocab=v.vocab_size)
    return DrafterCost(s)


def predict(p: Published, m: Machine) -> list[dict[str, Any]]:
    """The model's speedup at each published batch size, tau fixed by the smallest batch's figure."""
    vc, dc = VerifierCost(p.verifier), _drafter(p.verifier)
    b0 = min(p.speedup_by_batch)

    def at(batch: int, tau: float) -> float:
        return speedup(vc, dc, m, batch, p.draft_steps, tau, p.context, p.verify_tokens, p.draft_width)["speedup"]

    lo, hi = 1.0, 16.0  # speedup grows with tau: bisect for the tau that reproduces the first figure
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if at(b0, mid) < p.speedup_by_batch[b0] else (lo, mid)
    tau = (lo + hi) / 2
    return [{"source": p.source.split(":")[0].split(" (")[0], "batch": b, "published_speedup": s,
             "model_speedup": at(b, tau), "tau_fitted_at_batch": b0, "tau": tau}
            for b, s in sorted(p.speedup_by_batch.items())]
