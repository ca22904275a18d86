# Run: .venv/bin/python -m pytest tests/test_kernels_numerics.py -q
# GPU, natively: EAGLE3_KERNEL_DEVICE=cuda .venv/bin/python -m pytest tests/test_kernels_numerics.py -q
"""Each Triton kernel against its torch reference, forward and backward, over odd shapes, fp32 and bf16.

Why a subprocess on CPU: triton.jit decides when a kernel module is imported whether its functions run under the
interpreter (TRITON_INTERPRET is read at decoration time). In a shared pytest process any earlier test module that
imports `kernels` or `eagle3lib` makes that choice first, so setting the variable at the top of this file would depend
on test order. Instead, on CPU the one test `test_numerics_under_interpreter` reruns this file in a fresh Python process
with TRITON_INTERPRET=1 from the start, and the parametrised tests run there (they are skipped in the parent process).
With EAGLE3_KERNEL_DEVICE=cuda they run in-process on the GPU, plus a few full-size shapes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

DEVICE = os.environ.get("EAGLE3_KERNEL_DEVICE", "cpu")
ON_GPU = DEVICE == "cuda"
INTERPRETING = os.environ.get("TRITON_INTERPRET", "0") == "1"
RUN_KERNELS = ON_GPU or (INTERPRETING and DEVICE == "cpu")
REPO = Path(__file__).resolve().parents[1]

# Tolerances (atol, rtol) per dtype and quantity. bf16: the interpreter truncates fp32->bf16 stores where torch rounds
# to nearest, and fp32 sums in a different order can land on the other side of a rounding boundary, so outputs may
# differ by one bf16 step (2**-7 relative). Losses are fp32 sums of bf16 logits: a 1-ulp logit difference (row chunking
# changes the matmul blocking) moves them by ~1e-3 relative.
TOL: dict[torch.dtype, dict[str, tuple[float, float]]] = {
    torch.float32: {"out": (1e-5, 1e-5), "grad": (1e-5, 1e-4), "loss": (1e-5, 1e-5)},
    torch.bfloat16: {"out": (1e-3, 2**-7), "grad": (2e-3, 2**-6), "loss": (1e-3, 5e-3)},
}

pytestmark = pytest.mark.skipif(ON_GPU and not torch.cuda.is_available(), reason="EAGLE3_KERNEL_DEVICE=cuda, no CUDA")
needs_kernels = pytest.mark.skipif(not RUN_KERNELS, reason="runs in the TRITON_INTERPRET subprocess (or on CUDA)")


@pytest.mark.slow
@pytest.mark.skipif(RUN_KERNELS, reason="already inside the interpreter process or on CUDA")
def test_numerics_under_interpreter() -> None:
    env = {k: v for k, v in os.environ.items() if k != "EAGLE3_KERNEL_DEVICE"}
    env.update(TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "pytest", str(Path(__file__).resolve()), "-q", "-p", "no:cacheprovider",
           "-W", "ignore::UserWarning"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    tail = (proc.stdout + proc.stderr)[-6000:]
    assert proc.returncode == 0, f"interpreter run failed:\n{tail}"
    print(tail.strip().splitlines()[-1])


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    atol, rtol = TOL[dtype][what]
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


# ---------------------------------------------------------------- RMSNorm
# (shape, forced config or None for the selector's). Forced configs make hidden > BLOCK_H (chunk loop with a ragged last
# chunk) and rows not a multiple of BLOCK_R.
RMS_CASES = [
    ((1, 96), None),
    ((7, 200), None),
    ((33, 96), (4, 64)),
    ((7, 200), (2, 64)),
    ((2, 3, 200), (8, 128)),
    ((5, 1000), (1, 256)),
]
if ON_GPU:  # the shapes of the real failure: long sequences, large hidden, the selector's own configs
    RMS_CASES += [((16384, 7168), None), ((2, 8192, 4096), None), ((32768, 16384), None)]


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape,cfg", RMS_CASES, ids=[f"{'x'.join(map(str, s))}-{c}" for s, c in RMS_CASES])
@pytest.mark.parametrize("weight_fp32", [False, True], ids=["w=x.dtype", "w=fp32"])
def test_rmsnorm_matches_reference(shape, cfg, dtype, weight_fp32) -> None:
    from eagle3lib.kernels.launch import RMSNormConfig, rmsnorm_config
    from eagle3lib.kernels.rmsnorm import rms_norm, rms_norm_reference

    if weight_fp32 and dtype == torch.float32:
        pytest.skip("same as w=x.dtype")
    gen = torch.Generator(DEVICE).manual_seed(sum(shape) * 10 + dtype.itemsize)
    hidden = shape[-1]
    x = torch.randn(shape, generator=gen, device=DEVICE).to(dtype).requires_grad_()
    weight = (1 + 0.2 * torch.randn(hidden, generator=gen, device=DEVICE)).to(torch.float32 if weight_fp32 else dtype)
    weight.requires_grad_()
    dy = torch.randn(shape, generator=gen, device=DEVICE).to(dtype)
    config = RMSNormConfig(cfg[0], cfg[1], 1, 1) if cfg else rmsnorm_config(hidden, dtype, 101_376)

    y = rms_norm(x, weight, 1e-6, config)
    gx, gw = torch.autograd.grad(y, (x, weight), dy)
    y_ref = rms_norm_reference(x, weight, 1e-6)
    gx_ref, gw_ref = torch.autograd.grad(y_ref, (x, weight), dy)

    assert y.shape == x.shape and y.dtype == x.dtype and gw.dtype == weight.dtype
    close(y, y_ref, dtype, "out")
    close(gx, gx_ref, dtype, "grad")
    close(gw, gw_ref, dtype, "grad")


@needs_kernels
def test_rmsnorm_strided_rows_and_broadcast_grad() -> None:
    from eagle3lib.kernels.launch import RMSNormConfig
    from eagle3lib.kernels.rmsnorm import rms_norm, rms_norm_reference

    base = torch.randn(7, 300, device=DEVICE, requires_grad=True)
    weight = torch.rand(200, device=DEVICE, requires_grad=True)
    x = base[:, 50:250]  # row stride 300: passed as a stride, not copied
    # .sum() hands the backward an expanded (stride-0) gradient
    grads = torch.autograd.grad(rms_norm(x, weight, 1e-5, RMSNormConfig(4, 64, 1, 1)).sum(), (base, weight))
    grads_ref = torch.autograd.grad(rms_norm_reference(x, weight, 1e-5).sum(), (base, weight))
    for a, b in zip(grads, grads_ref, strict=True):
        close(a, b, torch.float32, "grad")


# ---------------------------------------------------------------- draft loss
# (N, H, V, forced (block_vocab, chunk_rows) or None). Forced configs give several vocab tiles with a ragged last one
# and several row chunks with a ragged last one.
LOSS_CASES = [
    (1, 32, 100, None),
    (7, 48, 300, None),
    (33, 64, 257, (128, 8)),  # 257 = 2 full tiles + 1: the last tile has one live lane
    (7, 40, 200, (128, 3)),
]
if ON_GPU:
    LOSS_CASES += [(4096, 4096, 32000, None), (2048, 7168, 32000, (4096, 512))]


def _loss_inputs(n, hidden, vocab, dtype, seed):
    gen = torch.Generator(DEVICE).manual_seed(seed)
    h = torch.randn(n, hidden, generator=gen, device=DEVICE).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=gen, device=DEVICE) / hidden**0.5 * 3).to(dtype).requires_grad_()
    target = (3 * torch.randn(n, vocab, generator=gen, device=DEVICE)).to(dtype)
    mask = (torch.rand(n, generator=gen, device=DEVICE) > 0.3).to(torch.float32)
    mask[0] = 1.0  # at least one live row
    return h, w, target, mask


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", ["kl", "ce"])
@pytest.mark.parametrize("n,hidden,vocab,cfg", LOSS_CASES, ids=[f"{n}x{h}x{v}-{c}" for n, h, v, c in LOSS_CASES])
def test_draft_loss_matches_reference(n, hidden, vocab, cfg, kind, dtype) -> None:
    from eagle3lib.kernels.draft_loss import draft_kl_loss, draft_kl_loss_reference
    from eagle3lib.kernels.launch import DraftLossConfig

    h, w, target, mask = _loss_inputs(n, hidden, vocab, dtype, seed=n * 1000 + vocab)
    config = DraftLossConfig(cfg[0], 1, 1, cfg[1]) if cfg else None
    out = draft_kl_loss(h, w, target, mask, kind=kind, reduction="sum", config=config)
    gh, gw = torch.autograd.grad(out.loss, (h, w))
    ref = draft_kl_loss_reference(h, w, target, mask, kind=kind, reduction="sum")
    gh_ref, gw_ref = torch.autograd.grad(ref.loss, (h, w))

    close(out.loss / mask.sum(), ref.loss / mask.sum(), dtype, "loss")
    close(gh, gh_ref, dtype, "grad")
    close(gw, gw_ref, dtype, "grad")
    # Argmax: must attain the reference maximum (bf16 logits can tie, or differ by an ulp between row chunkings).
    logits = (h @ w.t()).float().detach()
    atol = TOL[dtype]["out"][1] * logits.abs().max()
    assert out.argmax.dtype == torch.int64
    assert (logits.gather(1, out.argmax[:, None])[:, 0] >= logits.max(1).values - atol).all()


@needs_kernels
def test_draft_loss_reductions_masks_and_infinite_targets() -> None:
    from eagle3lib.kernels.draft_loss import draft_kl_loss, draft_kl_loss_reference
    from eagle3lib.kernels.launch import DraftLossConfig

    h, w, target, mask = _loss_inputs(9, 32, 150, torch.float32, seed=3)
    target[:, ::7] = float("-inf")  # tokens the verifier gives zero probability
    target = torch.cat([target, torch.zeros_like(target[:, :10])], dim=1)[:, :150]  # row stride 160, as after a gather
    config = DraftLossConfig(64, 1, 1, 4)
    rows = draft_kl_loss(h, w, target, mask, reduction="none", config=config).loss
    rows_ref = draft_kl_loss_reference(h, w, target, mask, reduction="none").loss
    close(rows, rows_ref, torch.float32, "loss")
    assert torch.all(rows[mask == 0] == 0)
    mean = draft_kl_loss(h, w, target, mask, reduction="mean", config=config).loss
    close(mean, rows.sum() / mask.sum(), torch.float32, "loss")
    # The two kinds differ by the target entropy only, so their gradients agree.
    g_kl = torch.autograd.grad(draft_kl_loss(h, w, target, mask, kind="kl", config=config).loss, (h, w))
    g_ce = torch.autograd.grad(draft_kl_loss(h, w, target, mask, kind="ce", config=config).loss, (h, w))
    for a, b in zip(g_kl, g_ce, strict=True):
        assert torch.isfinite(a).all()
        close(a, b, torch.float32, "grad")
    # All rows masked: zero loss, zero gradient, no NaN from 0/0.
    zero = torch.zeros_like(mask)
    out = draft_kl_loss(h, w, target, zero, reduction="mean", config=config).loss
    gh, gw = torch.autograd.grad(out, (h, w))
    assert out.item() == 0.0 and not gh.any() and not gw.any()


@pytest.mark.skipif(not ON_GPU, reason="GPU only")
def test_dispatcher_picks_triton_on_cuda() -> None:
    from eagle3lib import kernels
    assert kernels.select_backend(torch.device("cuda")) == "triton"
    x = torch.randn(4, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(2048, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(kernels.rms_norm(x, w), kernels.rms_norm(x, w, backend="torch"), atol=1e-2, rtol=2**-7)
