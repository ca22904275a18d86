"""The generate stage: the verifier answers every training prompt, reasoning included, and the answers become the data
(RUN_DIR/generate/shard-NNNNN.jsonl, resumable). Its engine, output format and resume rules:
eagle3lib/generation/engine.py."""

from __future__ import annotations

from typing import Any

from eagle3lib.config.stages import StageContext
from eagle3lib.generation.engine import generate


def run(ctx: StageContext, server_url: str | list[str] | None = None) -> dict[str, Any]:
    """Stage entry point (the notebook's one call); the engine: eagle3lib/generation/engine.py."""
    return generate(ctx.cfg, ctx.verifier, ctx.dir, manifest_params=ctx.manifest_params(), server_url=server_url)
