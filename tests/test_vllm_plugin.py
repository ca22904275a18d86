# Run: .venv/bin/python -m pytest tests/test_vllm_plugin.py -q
"""eagle3lib's vLLM plugin (eagle3lib/vllm/plugin.py): the rejection sampler's per-request -> per-token expansion on CPU,
against a loop that follows vLLM's Triton `expand_kernel` line by line, and its registration as a general plugin. The
end-to-end effect (vLLM's sampled tau agreeing with the library's) is checked in tests/test_evaluate.py."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest
import torch

from eagle3lib.vllm.plugin import expand_per_request


def _reference(inp: list, cu: list[int], replace_from, replace_to) -> list:
    out = []
    for r, v in enumerate(inp):  # one Triton program per request
        start = 0 if r == 0 else cu[r - 1]
        out += [replace_to if v == replace_from else v] * (cu[r] - start)
    return out


@pytest.mark.parametrize(("dtype", "values", "replace"), [
    (torch.float32, [0.8, -1.0, 0.5, 1.3, -1.0], (-1, 1)),  # temperatures; greedy requests (-1) become 1
    (torch.float32, [0.9, 0.95, 1.0, 0.7, 0.5], (0, 0)),  # top_p
    (torch.int32, [20, 0, 5, 1, 50], (0, 0)),  # top_k
    (torch.int64, [3, 4, 5, 6, 7], (4, 9)),
])
@pytest.mark.parametrize("counts", [[1, 1, 1, 1, 1], [3, 0, 2, 5, 1], [0, 0, 0, 0, 4]])
def test_expand_matches_the_kernel(dtype, values, replace, counts):
    cu = torch.tensor(counts).cumsum(0).to(torch.int32)
    inp = torch.tensor(values, dtype=dtype)
    out = torch.full((int(cu[-1]),), 12345, dtype=dtype)
    expand_per_request(out, inp, cu, *replace, MAX_NUM_TOKENS=8)
    expected = torch.tensor(_reference(values, cu.tolist(), *replace), dtype=dtype)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_registered_as_a_vllm_general_plugin():
    eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert eps.get("eagle3lib_cpu_fixes") == "eagle3lib.vllm.plugin:register", "run `make setup` (pip install -e .)"
    from vllm.utils import cpu_triton_utils

    from eagle3lib.vllm.plugin import register

    register()
    assert cpu_triton_utils._expand_kernel_impl is expand_per_request


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize(("heads", "kv_heads", "flat"), [(2, 1, False), (4, 1, False), (3, 3, False), (4, 1, True)])
def test_rotary_embedding_on_cpu_matches_the_reference(neox, heads, kv_heads, flat):
    """vLLM's MLA layer rotates q_pe as [tokens, heads, rope]: the C++ op gets that wrong for heads > 1 (the flat
    [tokens, heads x rope] form Llama layers pass is right). After register(), forward_cpu equals vLLM's own torch
    reference in every layout, and the tiny-kimi verifier's prompt log-probabilities equal HF's
    (tests/test_tiny_kimi.py)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    from eagle3lib.vllm.plugin import register

    register()
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(64, max_position=256, rope_parameters={"rope_type": "default", "rope_theta": 5e4},
                        is_neox_style=neox)
    torch.manual_seed(0)
    T = 7
    q, k, pos = torch.randn(T, heads, 64), torch.randn(T, kv_heads, 64), torch.arange(T) * 3
    want_q, want_k = rope.forward_native(pos, q.clone(), k.clone())
    shape = (lambda x: x.reshape(T, -1)) if flat else (lambda x: x)
    got_q, got_k = rope.forward_cpu(pos, shape(q.clone()), shape(k.clone()))
    torch.testing.assert_close(got_q.reshape(T, heads, 64), want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k.reshape(T, kv_heads, 64), want_k, rtol=1e-5, atol=1e-5)
