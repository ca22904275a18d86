"""The kernels' public API: choose a backend per device, and dispatch RMSNorm and the draft-vocab loss to the Triton
kernel or its torch reference (re-exported by the package)."""

from __future__ import annotations

import functools
import logging
import os
from typing import Literal

import torch

from . import draft_loss as _draft_loss
from . import rmsnorm as _rmsnorm
from .draft_loss import DraftLossOutput
from .launch import DraftLossConfig, RMSNormConfig, draft_loss_config, rmsnorm_config, smem_budget

__all__ = [
    "DraftLossConfig",
    "DraftLossOutput",
    "RMSNormConfig",
    "draft_kl_loss",
    "draft_loss_config",
    "rms_norm",
    "rmsnorm_config",
    "select_backend",
    "smem_budget",
]

Backend = Literal["triton", "torch"]
log = logging.getLogger("eagle3lib.kernels")


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _triton_drives_gpu() -> tuple[str, bool]:
    # The launch tables are NVIDIA's; a ROCm build also reports device type "cuda" but gets the torch path.
    try:
        from triton.runtime import driver

        target = driver.active.get_current_target()
    except Exception as exc:  # a broken driver/toolchain must degrade to torch, not stop training
        return f"triton cannot drive this GPU ({type(exc).__name__}: {exc})", False
    if target.backend != "cuda":
        return f"triton backend {target.backend!r} is not NVIDIA CUDA", False
    return f"NVIDIA GPU sm_{target.arch}", True


@functools.cache
def _select(device_type: str, index: int | None, prefer: str) -> Backend:
    if prefer not in ("auto", "triton", "torch"):
        raise ValueError(f"prefer must be 'auto', 'triton' or 'torch', got {prefer!r}")
    if device_type == "cuda":
        reason, triton_ok = _triton_drives_gpu()
    elif device_type == "cpu" and _interpreting():
        reason = "CPU under TRITON_INTERPRET=1 (slow; for tests)"
        triton_ok = prefer == "triton"  # "auto" on CPU stays on torch even under the interpreter
    else:
        reason, triton_ok = f"no Triton backend for device type {device_type!r}", False
    if prefer == "triton" and not triton_ok:
        raise RuntimeError(f"backend 'triton' requested but unavailable: {reason}")
    choice: Backend = "triton" if prefer != "torch" and triton_ok else "torch"
    log.info("kernels backend for %s%s: %s (prefer=%s; %s)", device_type, "" if index is None else f":{index}",
             choice, prefer, reason)
    return choice


def select_backend(device: torch.device | str, prefer: str = "auto") -> Backend:
    """"triton" on NVIDIA CUDA devices, "torch" elsewhere. prefer="torch" forces torch; prefer="triton" raises where
    impossible (on CPU it is allowed only under TRITON_INTERPRET=1). Logged once per (device, prefer) at INFO to the
    logger "eagle3lib.kernels"."""
    device = torch.device(device)
    return _select(device.type, device.index, prefer)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, backend: str | None = None) -> torch.Tensor:
    """RMSNorm over the last dim of x. backend: None/"auto" chooses by device; "triton" or "torch" forces one."""
    if select_backend(x.device, backend or "auto") == "triton":
        return _rmsnorm.rms_norm(x, weight, eps)
    return _rmsnorm.rms_norm_reference(x, weight, eps)


def draft_kl_loss(h: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, mask: torch.Tensor | None = None, *,
                  backend: str | None = None, **kw) -> DraftLossOutput:
    """Draft-vocab loss of logits h @ weight.T against softmax(target); definitions and keywords (kind, reduction) in
    kernels/draft_loss.py. Triton: the fused kernel; torch: the reference with its hand-written backward."""
    if select_backend(h.device, backend or "auto") == "triton":
        return _draft_loss.draft_kl_loss(h, weight, target, mask, **kw)
    return _draft_loss.draft_kl_loss_reference(h, weight, target, mask, manual_backward=True, **kw)
