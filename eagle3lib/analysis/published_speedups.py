"""Published GPU measurements of EAGLE-3 speedup against batch size, and the decode model's prediction for each.

The model predicts time, not acceptance, and these setups draft trees (SGLang's EAGLE-3: top-k candidates per step,
more tokens verified per request than a chain's K + 1) with acceptance lengths the sources give only in part. So each
comparison fixes tau with ONE number, the published speedup at the smallest batch, and then predicts the others:
what is compared is how the speedup falls as the batch grows, which is what the model is for.

Shapes are the models' published config.json values (Llama-3.1-8B-Instruct, Qwen3-8B); the drafters are one EAGLE-3
Llama layer at the verifier's hidden size with a 32,000-token draft vocabulary (as the published drafters).

Those two sources set deployment.flops_efficiency (docs/howto/choose-k.md): they calibrate the model. PUBLISHED_DECODE
below is OUT OF SAMPLE, used to fit nothing: absolute decode speed (time per output token of one request, no
speculation) of a large MoE on 8-GPU machines, against the verifier step the model computes for the same batch,
context and machine with the deployment section's default efficiencies and step overhead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eagle3lib.analysis.decode_time import DrafterCost, Machine, VerifierCost, speedup
from eagle3lib.config.deployment import DeploymentConfig, VerifierShape
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


@dataclass(frozen=True)
class PublishedDecode:
    """A published decode measurement, OUT OF SAMPLE (nothing in the model or its defaults was set from it): the mean
    time per output token of a request while `batch` requests decode at once."""

    source: str
    url: str
    date: str  # when it was measured
    setup: str  # engine, version, parallelism, precision, workload, as the source states them
    verifier: VerifierShape
    gpus: int  # tensor parallel over all of them
    mem_bw_tbs: float  # per GPU, as the source's spec table gives it
    bf16_tflops: float  # dense, per GPU, likewise
    batch: int  # requests in flight: the benchmark's max concurrency
    prompt_tokens: int
    output_tokens: int
    tpot_ms: float  # the published mean time per output token
    speculation: str = "none"

    @property
    def context(self) -> int:
        """KV tokens per request while it decodes: the prompt and, on average, half the answer."""
        return self.prompt_tokens + self.output_tokens // 2


_INFERENCEX = dict(
    source="SemiAnalysis InferenceX: B200 NVFP4 vs H200 INT4 on Kimi K2.5/K2.6 (blog, 2026-05-26), tables 'The Numbers'",
    url="https://inferencex.semianalysis.com/blog/b200-nvfp4-vs-h200-int4-kimi-k2-vllm-perf-per-dollar",
    date="2026-05-19 (GHA run 26118912054)", verifier=KIMI_K25, gpus=8, prompt_tokens=8192, output_tokens=1024)
_VLLM = ("vLLM v0.21.0 (vllm/vllm-openai), TP=8, moonshotai/Kimi-K2.5 native INT4 weights, random prompts ISL 8192 / "
         "OSL 1024, no speculation (no --speculative-config in InferenceX's benchmarks/single_node/kimik2.5_int4_*.sh)")

PUBLISHED_DECODE: tuple[PublishedDecode, ...] = (
    PublishedDecode(**_INFERENCEX, setup=f"8x H200 SXM, {_VLLM}: 91.18 tok/s/user", mem_bw_tbs=4.8,
                    bf16_tflops=989, batch=4, tpot_ms=10.97),
    PublishedDecode(**_INFERENCEX, setup=f"8x H200 SXM, {_VLLM}: 70.28 tok/s/user", mem_bw_tbs=4.8,
                    bf16_tflops=989, batch=8, tpot_ms=14.23),
    PublishedDecode(**_INFERENCEX, setup=f"8x B200 SXM, {_VLLM}: 104.36 tok/s/user (no hardware.yaml row: the "
                                         "source's B200 figures)", mem_bw_tbs=8.0, bf16_tflops=2250, batch=4,
                    tpot_ms=9.58),
)


def predict_decode(p: PublishedDecode, cfg: DeploymentConfig | None = None) -> dict[str, Any]:
    """The model's time per output token for a published decode measurement: the verifier alone (one forward per
    token) for `batch` requests at the measurement's context, with the deployment section's efficiencies and step
    overhead (its defaults unless `cfg`)."""
    cfg = cfg or DeploymentConfig()
    m = Machine(gpus=p.gpus, bandwidth=p.mem_bw_tbs * 1e12, flops=p.bf16_tflops * 1e12,
                bandwidth_efficiency=cfg.bandwidth_efficiency, flops_efficiency=cfg.flops_efficiency,
                overhead_s=cfg.step_overhead_ms / 1e3)
    s = m.seconds(*VerifierCost(p.verifier).step(p.batch, 1, p.context))
    return {"setup": p.setup.split(",")[0], "batch": p.batch, "published_tpot_ms": p.tpot_ms, "model_tpot_ms": 1e3 * s,
            "published_tokens_per_s": 1e3 / p.tpot_ms, "model_tokens_per_s": 1 / s,
            "model_over_published": p.tpot_ms / (1e3 * s)}
