"""Launch configurations: pure functions of (model dims, dtype, shared-memory budget). Never of the number of rows.

Why: a tile that grows with the sequence compiles on a 227 KiB H100/B200 and then dies on a 99 KiB RTX PRO 6000 the
first time a long batch arrives ("out of resource: shared memory, Required: 163912, Hardware limit: 101376" at 16384
tokens). Because nothing here sees the row count, the kernels a model can launch are a finite set known before training
starts, and tests/test_kernels_smem.py compiles every one of them for sm_120, sm_90 and sm_100 and reads the real
shared-memory size.

Shared-memory estimate (an upper bound; the AOT test checks it against the compiler): these kernels use no tl.dot, so
shared memory only holds (a) cross-warp reduction scratch and layout conversions, at most one fp32 tile, and (b) if the
software pipeliner ever stages a loop's loads through shared memory, (num_stages - 1) copies of every tile the loop
loads:
    estimate = tile_elems * 4 + (num_stages - 1) * loads_per_iteration * tile_elems * elem_bytes + 1 KiB
The selector keeps estimate <= budget, dropping num_stages first, then halving the tile.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

# Largest dynamic shared memory per block (opt-in), bytes, by compute capability (CUDA C Programming Guide, "Technical
# Specifications per Compute Capability"). Triton's launch check uses this same per-block opt-in figure.
SMEM_LIMITS: dict[tuple[int, int], int] = {
    (8, 0): 166_912,  # A100
    (8, 6): 101_376,  # RTX 30xx, A40
    (8, 7): 166_912,  # Jetson Orin
    (8, 9): 101_376,  # RTX 40xx, L4, L40
    (9, 0): 232_448,  # H100, H200
    (10, 0): 232_448,  # B200, GB200
    (12, 0): 101_376,  # RTX PRO 6000 Blackwell, RTX 50xx
}
# Unknown GPU (or no GPU: interpreter, AOT tests): assume the smallest budget of any GPU Triton 3.9 supports here.
DEFAULT_SMEM_BUDGET = min(SMEM_LIMITS.values())

_MAX_TILE = 4096  # elements per program tile: 16 KiB of fp32, 16 registers/thread at 8 warps; no spills
_CHUNK_BYTES = 256 << 20  # logits buffer per row chunk of the draft loss (memory, not shared memory)


@dataclass(frozen=True)
class RMSNormConfig:
    block_rows: int  # rows per program
    block_hidden: int  # hidden elements per loop step (power of two)
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class DraftLossConfig:
    block_vocab: int  # vocab elements per loop step (power of two)
    num_warps: int
    num_stages: int
    chunk_rows: int  # rows per logits chunk (bounds memory to chunk_rows * vocab * elem bytes)


def dtype_bytes(dtype: torch.dtype | str) -> int:
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    return dtype.itemsize


def smem_estimate(tile_elems: int, elem_bytes: int, loads_per_iteration: int, num_stages: int) -> int:
    """Upper bound on a config's shared memory in bytes (formula in the module docstring)."""
    return tile_elems * 4 + (num_stages - 1) * loads_per_iteration * tile_elems * elem_bytes + 1024


def _next_pow2(n: int) -> int:
    return 1 << (max(1, n) - 1).bit_length()


def _pow2_at_most(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _fit(tile: int, elem_bytes: int, loads: int, budget: int) -> tuple[int, int]:
    """Largest (tile, num_stages <= 2) whose estimate fits the budget; tile halves only after stages are down to 1."""
    while True:
        for stages in (2, 1):
            if smem_estimate(tile, elem_bytes, loads, stages) <= budget:
                return tile, stages
        if tile <= 32:
            raise ValueError(f"shared-memory budget {budget} B is too small for any tile")
        tile //= 2


def _warps(tile: int) -> int:
    return max(1, min(8, tile // 512))


def rmsnorm_config(hidden: int, dtype: torch.dtype | str, smem_budget: int) -> RMSNormConfig:
    """Tile [block_rows, block_hidden] for the forward and both backward kernels (2 loads per step: x and dy)."""
    if hidden < 1:
        raise ValueError(f"hidden must be positive, got {hidden}")
    tile, stages = _fit(_MAX_TILE, max(dtype_bytes(dtype), 4), 2, smem_budget)  # the weight may be fp32 under bf16 x
    # Floor of 64 lanes: smaller hidden sizes are padded, keeping the set of possible tiles (and AOT compiles) small.
    cap = min(tile, max(64, _next_pow2(hidden)))
    # Among cap .. cap/8 (at least 512 wide, for coalescing) pick the block that pads the row least: 7168 -> 1024 (no
    # padding) rather than 4096 (1024 masked lanes per row).
    candidates = [b for b in (cap, cap // 2, cap // 4, cap // 8) if b >= 512] or [cap]
    block = min(candidates, key=lambda b: (-(-hidden // b) * b, -b))
    rows = max(1, min(64, tile // block))
    return RMSNormConfig(block_rows=rows, block_hidden=block, num_warps=_warps(rows * block), num_stages=stages)


def draft_loss_config(hidden: int, draft_vocab: int, dtype: torch.dtype | str, smem_budget: int) -> DraftLossConfig:
    """One row per program, vocab walked in block_vocab tiles (2 loads per step: logits and target)."""
    if hidden < 1 or draft_vocab < 1:
        raise ValueError(f"hidden and draft_vocab must be positive, got {hidden}, {draft_vocab}")
    elem = dtype_bytes(dtype)
    tile, stages = _fit(_MAX_TILE, max(elem, 4), 2, smem_budget)  # target logits may be fp32 even if h is bf16
    block = min(tile, max(128, _next_pow2(draft_vocab)))
    # Rows per chunk from the vocab row size alone; the h chunk [rows, hidden] is small next to the logits.
    chunk = max(16, min(8192, _pow2_at_most(_CHUNK_BYTES // (draft_vocab * elem))))
    return DraftLossConfig(block_vocab=block, num_warps=_warps(block), num_stages=stages, chunk_rows=chunk)


def smem_budget(device: torch.device | str | None = None) -> int:
    """The device's own per-block opt-in shared memory when it is a CUDA GPU, else DEFAULT_SMEM_BUDGET."""
    device = torch.device(device) if device is not None else None
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return DEFAULT_SMEM_BUDGET
    return _cuda_budget(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_budget(index: int) -> int:
    props = torch.cuda.get_device_properties(index)
    own = getattr(props, "shared_memory_per_block_optin", None)
    if own:
        return int(own)
    return SMEM_LIMITS.get((props.major, props.minor), DEFAULT_SMEM_BUDGET)


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors, for grid sizes only (never tiles); off-GPU 4, to keep the interpreter fast."""
    if device.type != "cuda":
        return 4
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
