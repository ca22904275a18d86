"""Which process this is among torchrun's: rank, world size, barriers, and joining the process group.

One process (no WORLD_SIZE) runs the same code with every helper a no-op. Under torchrun the group is gloo on CPU and
nccl on GPUs. Shared by training (eagle3lib/training/distributed.py) and multi-process extraction (extraction/engine.py).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


def group():
    """The default process group's module, or None when this process runs alone."""
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def rank() -> int:
    d = group()
    return d.get_rank() if d else 0


def world() -> int:
    d = group()
    return d.get_world_size() if d else 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def barrier() -> None:
    d = group()
    if d:
        d.barrier()


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj` (picklable, made by this program), in rank order; [obj] in a single process."""
    d = group()
    if not d or d.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * d.get_world_size()
    d.all_gather_object(out, obj)
    return out


@contextmanager
def process_group(device: torch.device) -> Iterator[None]:
    """Join torchrun's group for the duration (when WORLD_SIZE > 1 and no group exists yet)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or group() is not None:
        yield
        return
    import torch.distributed as dist

    backend = "nccl" if device.type == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend=backend)
    try:
        yield
    finally:
        dist.destroy_process_group()


def owner(sample_id: str, world_size: int) -> int:
    """The rank that handles a sample: a hash of its id, so the split depends on nothing else (not the order, not
    which samples are already done) and any world size covers every sample exactly once."""
    return int.from_bytes(hashlib.sha1(sample_id.encode()).digest()[:8], "big") % world_size
