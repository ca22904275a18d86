"""Published decode speed of large MoE verifiers served with tensor parallelism on one 8-GPU machine, and the decode
model's time per output token for each (the verifier alone, one forward per token, at the measurement's batch,
context and machine).

One point sets deployment.tp_layer_overhead_us (`fit_tp_layer_overhead`: the fixed cost per layer per forward that
makes the model reproduce it; the roofline alone has ~8 ms a step less than measured). Every other point is OUT OF
SAMPLE, used to fit nothing: it checks that term on other batches, machines, models, precisions and engines
(tests/test_decode_time.py). Sources read and left out, with the reason, are in docs/howto/choose-k.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from eagle3lib.analysis.decode_time import VerifierCost
from eagle3lib.analysis.deployment import machine_from
from eagle3lib.analysis.published_speedups import KIMI_K25
from eagle3lib.config.deployment import DeploymentConfig, VerifierShape

# deepseek-ai/DeepSeek-R1-0528 config.json (the DeepSeek-V3 architecture: 128 heads, 256 experts, 3 dense layers),
# served as shipped: FP8 weights (block scales of 128 x 128: ~0 bytes more), bf16 KV cache
DEEPSEEK_R1 = VerifierShape(num_hidden_layers=61, hidden_size=7168, vocab_size=129280, intermediate_size=18432,
                            num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                            qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8,
                            n_shared_experts=1, moe_intermediate_size=2048, first_k_dense_replace=3, weight_bytes=1.0)


@dataclass(frozen=True)
class PublishedDecode:
    """A published decode measurement: the mean time per output token of a request while `batch` requests decode at
    once. Out of sample (nothing in the model or its defaults was set from it) unless `fitted`."""

    source: str
    url: str
    model: str  # the verifier, as the source names it, with its weights' precision
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
    fitted: bool = False  # True: deployment.tp_layer_overhead_us was set from this point (in sample, not a check)

    @property
    def context(self) -> int:
        """KV tokens per request while it decodes: the prompt and, on average, half the answer."""
        return self.prompt_tokens + self.output_tokens // 2


_INFERENCEX = dict(
    source="SemiAnalysis InferenceX: B200 NVFP4 vs H200 INT4 on Kimi K2.5/K2.6 (blog, 2026-05-26), tables "
           "'The Numbers'",
    url="https://inferencex.semianalysis.com/blog/b200-nvfp4-vs-h200-int4-kimi-k2-vllm-perf-per-dollar",
    date="2026-05-19 (GHA run 26118912054)", model="Kimi-K2.5 INT4", verifier=KIMI_K25, gpus=8, prompt_tokens=8192,
    output_tokens=1024)
_VLLM = ("vLLM v0.21.0 (vllm/vllm-openai), TP=8, moonshotai/Kimi-K2.5 native INT4 weights, random prompts ISL 8192 / "
         "OSL 1024, no speculation (no --speculative-config in InferenceX's benchmarks/single_node/kimik2.5_int4_*.sh)")

_SGLANG_R1_B200 = dict(
    source="SGLang cookbook, DeepSeek-R1 page, section 5.1 Speed Benchmark (sglang.bench_serving outputs)",
    url="https://github.com/sgl-project/sglang/blob/main/docs_new/cookbook/autoregressive/DeepSeek/DeepSeek-R1.mdx",
    date="2025-12 (SGLang 0.5.6.post1); the page read at commit 3df105d", model="DeepSeek-R1-0528 FP8",
    verifier=DEEPSEEK_R1, gpus=8, mem_bw_tbs=8.0, bf16_tflops=2250)
_SGLANG_R1 = ("8x B200, SGLang 0.5.6.post1, --tp 8, no speculation, random dataset (mean prompt / answer tokens: the "
              "run's totals over its requests)")
_IX_R1_H200 = dict(
    source="SemiAnalysis InferenceX issue 870, 'deepseek sglang h200 experimental' (concurrency sweep, 1k/1k)",
    url="https://github.com/SemiAnalysisAI/InferenceX/issues/870", date="2026-03-05 (GHA run 22740679519)",
    model="DeepSeek-R1-0528 FP8", verifier=DEEPSEEK_R1, gpus=8, mem_bw_tbs=4.8, bf16_tflops=989, prompt_tokens=1024,
    output_tokens=1024)
_IX_R1 = "8x H200, SGLang v0.5.7, TP=8 EP=1, ISL 1024 / OSL 1024, no speculation"

PUBLISHED_DECODE: tuple[PublishedDecode, ...] = (
    PublishedDecode(**_INFERENCEX, setup=f"8x H200 SXM, {_VLLM}: 91.18 tok/s/user", mem_bw_tbs=4.8,
                    bf16_tflops=989, batch=4, tpot_ms=10.97, fitted=True),
    PublishedDecode(**_INFERENCEX, setup=f"8x H200 SXM, {_VLLM}: 70.28 tok/s/user", mem_bw_tbs=4.8,
                    bf16_tflops=989, batch=8, tpot_ms=14.23),
    PublishedDecode(**_INFERENCEX, setup=f"8x B200 SXM, {_VLLM}: 104.36 tok/s/user (no hardware.yaml row: the "
                                         "source's B200 figures)", mem_bw_tbs=8.0, bf16_tflops=2250, batch=4,
                    tpot_ms=9.58),
    # the cookbook's three scenarios at its three concurrencies; prompt / answer tokens = its totals / requests
    *(PublishedDecode(**_SGLANG_R1_B200, setup=f"8x B200, {_SGLANG_R1}: {scenario} at {batch}", batch=batch,
                      prompt_tokens=prompt, output_tokens=answer, tpot_ms=tpot)
      for scenario, batch, prompt, answer, tpot in (
          ("1K/1K", 1, 610, 421, 9.16), ("1K/1K", 16, 496, 509, 17.56), ("1K/1K", 100, 500, 504, 40.11),
          ("1K/8K", 1, 610, 4445, 9.21), ("1K/8K", 16, 496, 3978, 15.42), ("1K/8K", 64, 497, 4065, 25.94),
          ("8K/1K", 1, 4194, 421, 9.26), ("8K/1K", 16, 3750, 521, 19.06), ("8K/1K", 64, 3981, 530, 39.93))),
    *(PublishedDecode(**_IX_R1_H200, setup=f"8x H200, {_IX_R1}: concurrency {batch}", batch=batch, tpot_ms=tpot)
      for batch, tpot in ((8, 12.8), (16, 17.2), (32, 25.6), (64, 34.6))),
)


def predict_decode(p: PublishedDecode, cfg: DeploymentConfig | None = None) -> dict[str, Any]:
    """The model's time per output token for a published decode measurement: the verifier alone (one forward per
    token) for `batch` requests at the measurement's context, with the deployment section's efficiencies and
    overheads (its defaults unless `cfg`)."""
    cfg = cfg or DeploymentConfig()
    v = VerifierCost(p.verifier)
    m = machine_from(p.gpus, p.mem_bw_tbs, p.bf16_tflops, cfg)
    s = m.seconds(*v.step(p.batch, 1, p.context), v.layers)
    return {"model": p.model, "setup": p.setup.split(",")[0], "batch": p.batch, "context": p.context, "fitted": p.fitted, "published_tpot_ms": p.tpot_ms,
            "model_tpot_ms": 1e3 * s, "published_tokens_per_s": 1e3 / p.tpot_ms, "model_tokens_per_s": 1 / s,
            "model_over_published": p.tpot_ms / (1e3 * s)}


def fit_tp_layer_overhead(p: PublishedDecode, cfg: DeploymentConfig | None = None) -> float:
    """The tensor-parallel fixed cost per layer (microseconds) that makes the model reproduce `p` exactly: what the
    measured step takes beyond the roofline and the per-forward overhead, over the verifier's layers."""
    cfg = (cfg or DeploymentConfig()).model_copy(update={"tp_layer_overhead_us": 0.0})
    roofline_ms = predict_decode(p, cfg)["model_tpot_ms"]
    return 1e3 * (p.tpot_ms - roofline_ms) / VerifierCost(p.verifier).layers
