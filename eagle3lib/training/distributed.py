"""torch.distributed for the training loop: the process group, DDP or FSDP2 wrapping, full state dicts for checkpoints.

One process (no WORLD_SIZE) runs the same code with every helper a no-op. Under torchrun the group is gloo on CPU and
nccl on GPUs. Checkpoints gather full (unsharded) state dicts on CPU, so a checkpoint written by N processes loads in
any number of them, and the saved file is the same as a single process would write.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

from eagle3lib.core.ranks import barrier, group, process_group, rank, world  # noqa: F401  (the loop's dist.* calls)


def all_reduce_(t: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """In-place all-reduce when torch.distributed is initialised (a no-op in a single process)."""
    d = group()
    if d and d.get_world_size() > 1:
        d.all_reduce(t, op={"sum": d.ReduceOp.SUM, "max": d.ReduceOp.MAX}[op])
    return t


def wrap(module: torch.nn.Module, layers: torch.nn.ModuleList, strategy: str, device: torch.device) -> torch.nn.Module:
    """DDP (gradients averaged), or FSDP2 `fully_shard` per decoder layer + root; unchanged in a single process."""
    if world() == 1:
        return module
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        # gradient_as_bucket_view: the gradients are views into DDP's all-reduce buckets instead of a second fp32 copy
        # of every parameter (the memory model counts one copy: eagle3lib/training/memory_model.py)
        return DDP(module, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False,
                   gradient_as_bucket_view=True)
    from torch.distributed.fsdp import fully_shard

    for layer in layers:
        fully_shard(layer)
    fully_shard(module)
    return module


def no_sync(module: torch.nn.Module, strategy: str, last: bool):
    """Skip the gradient all-reduce on all but the last micro-batch of a step."""
    if world() == 1 or last:
        return nullcontext()
    if strategy == "ddp":
        return module.no_sync()
    return _fsdp_no_sync(module)


@contextmanager
def _fsdp_no_sync(module) -> Iterator[None]:
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


def _full_cpu(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True, **kw)


def model_state(module) -> dict[str, torch.Tensor]:
    """Full model state dict on CPU (every rank takes part; FSDP gathers the shards)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(module, options=_full_cpu())


def optimizer_state(module, opt) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(module, opt.parts, options=_full_cpu())


def load_optimizer_state(module, opt, state) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(module, opt.parts, state, options=StateDictOptions(full_state_dict=True))
