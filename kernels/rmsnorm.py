"""RMSNorm: Triton forward/backward, a torch reference, and the autograd wrapper, in one file.

y = x * rstd * w with rstd = 1 / sqrt(mean(x^2) + eps), computed in fp32 and rounded once to x.dtype.
(Hugging Face Llama rounds x * rstd to x.dtype before multiplying by w; the difference is at most one rounding step.)

Layout: rows = all leading dims flattened, hidden is the last dim. A program owns a [BLOCK_R, BLOCK_H] tile and walks
the row in BLOCK_H chunks, so any hidden size (non-power-of-two, 16384, ...) fits in the same bounded tile. The tile
comes from kernels.launch, which looks at hidden, dtype and the shared-memory budget only, never at the number of rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import RMSNormConfig, rmsnorm_config, sm_count, smem_budget


@triton.jit
def _rmsnorm_fwd_kernel(
    x_ptr, w_ptr, y_ptr, rstd_ptr, n_rows, n_cols, x_stride, y_stride, eps,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # int64 row offsets: rows * stride overflows int32 beyond 2**31 elements (e.g. 131072 tokens x 16384).
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    cols0 = tl.arange(0, BLOCK_H)
    # Pass 1: sum of squares. Pass 2 re-reads x (an L2 hit for typical rows) instead of holding the row in registers.
    sumsq = tl.zeros([BLOCK_R], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_H):
        cols = start + cols0
        ok = row_ok[:, None] & (cols < n_cols)[None, :]
        x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        sumsq += tl.sum(x * x, axis=1)
    rstd = tl.math.rsqrt(sumsq / n_cols + tl.cast(eps, tl.float32))
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)
    for start in range(0, n_cols, BLOCK_H):
        cols = start + cols0
        ok = row_ok[:, None] & (cols < n_cols)[None, :]
        x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        y = x * rstd[:, None] * w[None, :]
        tl.store(y_ptr + rows[:, None] * y_stride + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rmsnorm_bwd_dx_kernel(
    x_ptr, w_ptr, dy_ptr, rstd_ptr, dx_ptr, n_rows, n_cols, x_stride, dy_stride, dx_stride,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # dx = rstd * (dy*w - x * rstd^2 * sum(dy*w*x) / H)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    cols0 = tl.arange(0, BLOCK_H)
    rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
    dot = tl.zeros([BLOCK_R], dtype=tl.float32)
    for start in range(0, n_cols, BLOCK_H):
        cols = start + cols0
        ok = row_ok[:, None] & (cols < n_cols)[None, :]
        x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows[:, None] * dy_stride + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        dot += tl.sum(dy * w[None, :] * x, axis=1)
    coef = rstd * rstd * dot / n_cols
    for start in range(0, n_cols, BLOCK_H):
        cols = start + cols0
        ok = row_ok[:, None] & (cols < n_cols)[None, :]
        x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows[:, None] * dy_stride + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        dx = rstd[:, None] * (dy * w[None, :] - x * coef[:, None])
        tl.store(dx_ptr + rows[:, None] * dx_stride + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rmsnorm_bwd_dw_kernel(
    x_ptr, dy_ptr, rstd_ptr, partial_ptr, n_rows, n_cols, x_stride, dy_stride, rows_per_group,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # Program (column block, row group) writes sum over its rows of dy * x * rstd into partial[group, cols]; the caller
    # sums the groups. No atomics, so dweight is deterministic run to run.
    cols = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < n_cols
    group = tl.program_id(1).to(tl.int64)
    first = group * rows_per_group
    acc = tl.zeros([BLOCK_R, BLOCK_H], dtype=tl.float32)
    for r in range(0, rows_per_group, BLOCK_R):
        rows = first + r + tl.arange(0, BLOCK_R)
        row_ok = rows < n_rows
        ok = row_ok[:, None] & col_ok[None, :]
        x = tl.load(x_ptr + rows[:, None] * x_stride + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows[:, None] * dy_stride + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
        acc += dy * x * rstd[:, None]
    tl.store(partial_ptr + group * n_cols + cols, tl.sum(acc, axis=0), mask=col_ok)


def _rows(t: torch.Tensor, hidden: int) -> torch.Tensor:
    t2 = t.reshape(-1, hidden)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


class RMSNormFunction(torch.autograd.Function):
    """Autograd wrapper: saves x, weight and the per-row rstd (fp32, [rows]); dx and dweight come from two kernels."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, config: RMSNormConfig) -> torch.Tensor:
        hidden = x.shape[-1]
        x2 = _rows(x, hidden)
        n_rows = x2.shape[0]
        y = torch.empty((n_rows, hidden), dtype=x.dtype, device=x.device)
        rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
        grid = (triton.cdiv(n_rows, config.block_rows),)
        _rmsnorm_fwd_kernel[grid](
            x2, weight, y, rstd, n_rows, hidden, x2.stride(0), y.stride(0), eps,
            BLOCK_R=config.block_rows, BLOCK_H=config.block_hidden,
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
        ctx.save_for_backward(x2, weight, rstd)
        ctx.config = config
        ctx.x_shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x2, weight, rstd = ctx.saved_tensors
        cfg: RMSNormConfig = ctx.config
        n_rows, hidden = x2.shape
        dy2 = _rows(dy, hidden)
        launch = {"BLOCK_R": cfg.block_rows, "BLOCK_H": cfg.block_hidden,
                  "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        dx = dweight = None
        if ctx.needs_input_grad[0]:
            dx = torch.empty((n_rows, hidden), dtype=x2.dtype, device=x2.device)
            _rmsnorm_bwd_dx_kernel[(triton.cdiv(n_rows, cfg.block_rows),)](
                x2, weight, dy2, rstd, dx, n_rows, hidden, x2.stride(0), dy2.stride(0), dx.stride(0), **launch
            )
            dx = dx.view(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            col_blocks = triton.cdiv(hidden, cfg.block_hidden)
            # Enough (column block, row group) programs to fill the GPU a few times over; the grid may follow n_rows,
            # the tile may not.
            groups = max(1, min(triton.cdiv(n_rows, cfg.block_rows), 4 * sm_count(x2.device) // col_blocks))
            rows_per_group = triton.cdiv(triton.cdiv(n_rows, groups), cfg.block_rows) * cfg.block_rows
            groups = triton.cdiv(n_rows, rows_per_group)
            partial = torch.empty((groups, hidden), dtype=torch.float32, device=x2.device)
            _rmsnorm_bwd_dw_kernel[(col_blocks, groups)](
                x2, dy2, rstd, partial, n_rows, hidden, x2.stride(0), dy2.stride(0), rows_per_group, **launch
            )
            dweight = partial.sum(0).to(weight.dtype)
        return dx, dweight, None, None


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, config: RMSNormConfig | None = None
) -> torch.Tensor:
    """Triton RMSNorm over the last dim of x (any leading shape); config defaults to the selector's choice here."""
    if x.shape[-1] != weight.shape[0]:
        raise ValueError(f"hidden mismatch: x {tuple(x.shape)} vs weight {tuple(weight.shape)}")
    if config is None:
        config = rmsnorm_config(x.shape[-1], x.dtype, smem_budget(x.device))
    return RMSNormFunction.apply(x, weight.contiguous(), eps, config)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Plain torch RMSNorm with the kernel's rounding (fp32 math, one rounding at the end); autograd gives the grads."""
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * rstd * weight.float()).to(x.dtype)
