"""What the train stage's notebook shows: this run's learning curves and how to serve the drafter."""

from __future__ import annotations

import json
from pathlib import Path

from eagle3lib.analysis import plots
from eagle3lib.analysis.curves import load_run
from eagle3lib.analysis.log_sources import expand_sources


def curves(metrics: str | Path):
    """The learning-curves notebook's two figures for this run alone, unsmoothed: (overview, per-TTT-step grid)."""
    frame = load_run(expand_sources([str(metrics)], Path(metrics))[0], smoothing=0.0).frame
    return plots.overview(frame), plots.ttt_grid(frame)


def serve_command(checkpoint: str | Path, ttt_steps: int, verifier: str = "VERIFIER") -> str:
    """The vLLM command that serves the verifier with this drafter as its EAGLE-3 speculator (vLLM's config key for
    the draft steps is num_speculative_tokens)."""
    spec = {"method": "eagle3", "model": str(checkpoint), "num_speculative_tokens": ttt_steps}
    return f"python -m vllm.entrypoints.openai.api_server --model {verifier} --speculative-config '{json.dumps(spec)}'"
