"""Fields of a stage that runs as several processes under torchrun (train, extract): one name each across stages."""

from __future__ import annotations

from pydantic import Field

from eagle3lib.config.base import StageConfig


class TorchrunConfig(StageConfig):
    # how many processes share the work: 1 and N processes make the same store and take the same steps (the batch is
    # global, the loss normalised over it: eagle3lib/training/loop.py)
    OPERATIONAL = frozenset({"nproc_per_node", "nnodes", "rdzv_endpoint", "rdzv_id"})

    nproc_per_node: int = Field(1, ge=1)  # processes (GPUs) per node; > 1 launches torchrun
    nnodes: int = Field(1, ge=1)  # nodes for multi-node torchrun (launch the same command on each node)
    rdzv_endpoint: str | None = None  # nnodes > 1: host:port of torchrun's c10d rendezvous, reachable from every node
    # (usually node 0's address); None = $EAGLE3_RDZV_ENDPOINT, else localhost:29400
    rdzv_id: str = "eagle3"  # nnodes > 1: the rendezvous' job id; agents with the same id and endpoint form one job
