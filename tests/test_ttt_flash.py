# .venv/bin/python -m pytest -q tests/test_ttt_flash.py
"""The linear-memory TTT attention (eagle3lib/model/ttt_flash.py) against its dense reference (the boolean `ttt_mask`
written out, softmax in float64): outputs and every gradient, over odd shapes (GQA, MLA's unequal q/v widths, rows
of several samples and padding, blocks that do not divide the row, 0-3 diagonals), per dtype; and what it keeps for
the backward grows linearly with the row. Exactness against incremental decoding: tests/test_train_model.py."""

from __future__ import annotations

import pytest
import torch

from eagle3lib.model.ttt_attention import ttt_mask
from eagle3lib.model.ttt_flash import _TTTFlash, block_size, make_plan, sample_starts

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

TOLERANCE = {  # (atol, rtol) against the float64 reference; bf16 keeps 8 mantissa bits
    torch.float64: (1e-10, 1e-8),
    torch.float32: (2e-5, 1e-4),
    torch.bfloat16: (3e-2, 3e-2),
}


def reference(doc, q, k0, v0, kd, vd):
    """Dense attention with the mask the other layouts use: keys [step-0 | diagonal 1 | ..], float64."""
    nh, nkv = q.shape[1], k0.shape[1]
    keys = torch.cat([k0, *kd], dim=2).double().repeat_interleave(nh // nkv, dim=1)
    vals = torch.cat([v0, *vd], dim=2).double().repeat_interleave(nh // nkv, dim=1)
    s = q.double() @ keys.transpose(-1, -2) * q.shape[-1] ** -0.5
    s = s.masked_fill(~ttt_mask(doc, len(kd))[:, None], float("-inf"))
    return torch.softmax(s, -1) @ vals


def random_inputs(doc, nh, nkv, dq, dv, n_diag, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, S = doc.shape

    def t(h, d):
        return (torch.randn(B, h, S, d, generator=g) * 1.5).to(dtype).requires_grad_()

    return t(nh, dq), t(nkv, dq), t(nkv, dv), [t(nkv, dq) for _ in range(n_diag)], [t(nkv, dv) for _ in range(n_diag)]


DOCS = {
    "one sample": torch.tensor([[0] * 37]),
    "packed + padding": torch.tensor([[0] * 11 + [1] * 19 + [2] * 4 + [-1] * 3, [0] * 30 + [1] * 7]),
}
SHAPES = {"gqa": (6, 2, 8, 8), "mha": (4, 4, 8, 8), "mla": (3, 3, 12, 5)}  # heads, kv heads, q/k width, v width


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("n_diag", [0, 1, 3])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("docs", DOCS)
@pytest.mark.parametrize("block,budget", [(5, 1), (5, 10**6), (16, 10**6)])  # budget 1: one block per group
def test_matches_dense_reference(docs, shape, n_diag, dtype, block, budget):
    doc = DOCS[docs]
    nh, nkv, dq, dv = SHAPES[shape]
    q, k0, v0, kd, vd = random_inputs(doc, nh, nkv, dq, dv, n_diag, dtype)
    leaves = [q, k0, v0, *kd, *vd]
    out = _TTTFlash.apply(make_plan(doc, nh, budget, block), q, k0, v0, *kd, *vd)
    ref = reference(doc, q, k0, v0, kd, vd)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    got = torch.autograd.grad((out.double() * w).sum(), leaves)
    want = torch.autograd.grad((ref * w).sum(), leaves)
    for name, a, b in zip(["q", "k0", "v0"] + [f"d{j}" for j in range(2 * n_diag)], got, want, strict=True):
        torch.testing.assert_close(a.double(), b.double(), atol=atol * 10, rtol=rtol * 10, msg=lambda m, n=name: f"{n}: {m}")


def test_sample_starts():
    doc = torch.tensor([[0, 0, 0, 1, 1, 2, -1, -1], [0, 0, 0, 0, 0, 0, 0, 0]])
    assert sample_starts(doc).tolist() == [[0, 0, 0, 3, 3, 5, 6, 7], [0] * 8]


def test_block_size_bounds():
    assert block_size(8, 1024) == 256  # short rows: the largest block
    assert block_size(8, 100) == 64  # no longer than the longest sample
    assert block_size(8, 32768) == 32  # 2^23 / (8 x 32K)
    assert block_size(64, 65536) == 16  # never below the floor


def _saved_bytes(S: int) -> int:
    """Bytes the autograd graph keeps for the backward of one flash call over one S-token sample, 2 diagonals."""
    doc = torch.zeros(1, S, dtype=torch.long)
    q, k0, v0, kd, vd = random_inputs(doc, 4, 2, 16, 16, 2, torch.float32)
    saved: list[int] = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _TTTFlash.apply(make_plan(doc, 4, block=16), q, k0, v0, *kd, *vd)
    return sum(saved)


def test_saved_state_grows_linearly():
    """Quadrupling the sample quadruples what is kept for the backward (the dense layouts keep [L, L] tensors: 16x)."""
    a, b = _saved_bytes(256), _saved_bytes(1024)
    assert b == 4 * a
