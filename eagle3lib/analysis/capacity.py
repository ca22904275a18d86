"""Whether a machine can hold what the deployment plan serves on it: the verifier's and the drafter's weights and the KV
cache of every request decoding at once, against the GPUs' memory. A point of the decode model (eagle3lib/analysis/
decode_time.py) that cannot be held is no schedule to deploy, however fast it is modelled to be."""

from __future__ import annotations

from dataclasses import dataclass

from eagle3lib.analysis.decode_time import DrafterCost, VerifierCost

GB = 1e9  # the vendors' GB (params/hardware.yaml's mem_gb): decimal


def held_kv_bytes_per_token(kv_bytes_per_token: float, kv_heads: int, gpus: int) -> float:
    """KV bytes one token takes over the whole machine under tensor parallelism over `gpus`: vLLM gives each GPU
    max(1, kv_heads // gpus) heads (vllm/config/model.py get_num_kv_heads), so heads fewer than the GPUs are copied,
    and an MLA latent (one MQA head) is held whole by every GPU."""
    per_head = kv_bytes_per_token / kv_heads
    return gpus * max(1, kv_heads // gpus) * per_head


@dataclass(frozen=True)
class Capacity:
    weights: float  # bytes: verifier + drafter weights
    kv_cache: float  # bytes: every request's cache, over the machine
    available: float  # bytes: GPUs x memory x utilisation

    @property
    def needed(self) -> float:
        return self.weights + self.kv_cache

    @property
    def fits(self) -> bool:
        return self.needed <= self.available

    @property
    def weights_fit(self) -> bool:
        return self.weights <= self.available

    def summary(self) -> dict[str, float | bool]:
        return {"fits": self.fits, "memory_needed_gb": round(self.needed / GB, 1),
                "memory_available_gb": round(self.available / GB, 1)}


def capacity(verifier: VerifierCost, drafter: DrafterCost | None, gpus: int, mem_gb: float, utilisation: float,
             concurrency: int, context: int) -> Capacity:
    """Bytes needed against bytes available on a machine of `gpus` GPUs of `mem_gb` each, tensor parallel over all:

        needed    = verifier weights + drafter weights
                    + (verifier + drafter held KV bytes per token) x context x concurrency
        available = gpus x mem_gb x 1e9 x utilisation           (vLLM's gpu_memory_utilization, 0.9 by default)

    Held KV bytes per token: see held_kv_bytes_per_token (MLA: (kv_lora_rank + qk_rope_head_dim) x bytes per element
    per layer, on every GPU). `context` is the mean tokens a request holds while it decodes (deployment.context_tokens):
    vLLM allocates blocks as tokens arrive, so longer requests than that mean make a fitting point preempt. `drafter`
    None: the verifier alone (K = 0). What the GPUs' other memory holds (activations, CUDA graphs, the weights a
    tensor-parallel layer copies to every GPU) is left to the utilisation's margin."""
    weights = verifier.weight_bytes_held + (drafter.weight_bytes_held if drafter else 0.0)
    per_token = held_kv_bytes_per_token(verifier.kv_bytes_per_token, verifier.kv_heads, gpus)
    if drafter:
        per_token += held_kv_bytes_per_token(drafter.kv_bytes_per_token, drafter.kv_heads, gpus)
    return Capacity(weights, per_token * context * concurrency, gpus * mem_gb * GB * utilisation)
