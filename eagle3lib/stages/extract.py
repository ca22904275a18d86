"""The extract stage: verifier hidden states for drafter training, into a sharded store (RUN_DIR/extract/), in this
process or one process per rank under torchrun.

  run(ctx)   what the notebook calls
  python -m eagle3lib.stages.extract --profile P --run-dir R [--set extract.key=value ...]   (one rank; torchrun runs this)

Its engine, backends, store and resume rules: eagle3lib/extraction/engine.py."""

from __future__ import annotations

import json
import sys
from typing import Any

import torch

from eagle3lib.config.stages import StageContext
from eagle3lib.core import ranks
from eagle3lib.core.manifest import read_manifest
from eagle3lib.core.torchrun import failure_cause, run_streamed, torchrun_command, torchrun_env
from eagle3lib.extraction.engine import ExtractError, extract, say


def run(ctx: StageContext, *, echo=print) -> dict[str, Any]:
    """Notebook / runner entry point: RUN_DIR/extract/ from the profile's `extract` and `verifier` sections (and
    train.hidden_states: whether the states are stored here or computed by the trainer). In this process, or under
    torchrun when extract.nproc_per_node x nnodes > 1."""
    cfg = ctx.cfg
    if cfg.nproc_per_node * cfg.nnodes == 1:
        return extract(cfg, ctx.verifier, ctx.dir, ctx.stage_dir("generate"), ctx.manifest_params(),
                       hidden_states=ctx.profile.section("train").hidden_states)
    args = ["--profile", str(ctx.profile.path), "--run-dir", str(ctx.run_dir),
            "--overrides-json", json.dumps(ctx.profile.overrides)]
    ctx.dir.mkdir(parents=True, exist_ok=True)  # the processes start in it (not the repository: see training/launch.py)
    log = ctx.dir / "extract.log"  # every rank's output; the error names the line that says why
    code, tail = run_streamed(torchrun_command(cfg, "eagle3lib.stages.extract", args), str(ctx.dir),
                              torchrun_env(cfg.nproc_per_node), lambda line: line.startswith("[extract"), echo, log)
    m = read_manifest(ctx.dir) or {}
    if code == 0 and cfg.nnodes > 1 and m.get("status") != "complete":
        echo(f"[extract] this node's ranks finished; rank 0 ran on another node and wrote the manifest to its {ctx.dir}")
        return {"figures": {}, "outputs": {}, "out_dir": ctx.dir}
    if code != 0 or m.get("status") != "complete":
        raise ExtractError(f"extraction failed: {m.get('error') or failure_cause(tail) or f'exit code {code}'} "
                           f"(every rank's output: {log})")
    return {"figures": m["figures"], "outputs": m["outputs"], "out_dir": ctx.dir}


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
