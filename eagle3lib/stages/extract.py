"""The extract stage: verifier hidden states for drafter training, into a sharded store (RUN_DIR/extract/), in this
process or one process per rank under torchrun.

  run(ctx)   what the notebook calls
  python -m eagle3lib.stages.extract --profile P --run-dir R [--set extract.key=value ...]   (one rank; torchrun runs this)

Its engine, backends, store and resume rules: eagle3lib/extraction/engine.py."""

from __future__ import annotations

import sys
from typing import Any

import torch

from eagle3lib.config.stages import StageContext
from eagle3lib.core import ranks
from eagle3lib.core.torchrun import run_stage_processes
from eagle3lib.extraction.engine import ExtractError, extract, say


def run(ctx: StageContext, *, echo=print) -> dict[str, Any]:
    """Notebook / runner entry point: RUN_DIR/extract/ from the profile's `extract` and `verifier` sections (and
    train.hidden_states: whether the states are stored here or computed by the trainer). In this process, or under
    torchrun when extract.nproc_per_node x nnodes > 1."""
    cfg = ctx.cfg
    if cfg.nproc_per_node * cfg.nnodes == 1:
        return extract(cfg, ctx.verifier, ctx.dir, ctx.stage_dir("generate"), ctx.manifest_params(),
                       hidden_states=ctx.profile.section("train").hidden_states)
    m = run_stage_processes(cfg, "eagle3lib.stages.extract", ctx.rank_args(), ctx.dir, "extract", "extraction",
                            ExtractError, echo)
    return {"figures": m.get("figures") or {}, "outputs": m.get("outputs") or {}, "out_dir": ctx.dir}


def main(argv: list[str] | None = None) -> int:
    """One extraction process (what torchrun starts, once per rank)."""
    from eagle3lib.config.stages import open_rank_stage

    ctx = open_rank_stage("extract", argv, "Extract hidden states")
    with ranks.process_group(torch.device("cpu")):  # gloo: barriers and the per-rank figures only, never tensors
        try:
            extract(ctx.cfg, ctx.verifier, ctx.dir, ctx.stage_dir("generate"), ctx.manifest_params(),
                    hidden_states=ctx.profile.section("train").hidden_states)
            # the other ranks wait here while rank 0 merges the index and writes the manifest, so that every rank
            # tears the gloo group down together: a rank leaving early aborted once at exit ("terminate called
            # without an active exception") after its work was done (mosaicml/streaming#186 does the same)
            ranks.barrier()
        except ExtractError as e:
            say(f"error: {e}")
            if ranks.rank() == 0:
                from eagle3lib.core.manifest import update_manifest

                update_manifest(ctx.dir, status="failed", error=f"{type(e).__name__}: {e}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
