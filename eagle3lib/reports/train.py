"""What the train stage's notebook shows: this run's learning curves and how to serve the drafter."""

from __future__ import annotations

import json
from pathlib import Path

from eagle3lib.analysis import plots
from eagle3lib.analysis.curves import load_run
from eagle3lib.analysis.log_sources import expand_sources
from eagle3lib.vllm.speculative_config import speculative_config


def curves(metrics: str | Path):
    """The learning-curves notebook's two figures for this run alone, unsmoothed: (overview, per-TTT-step grid)."""
    frame = load_run(expand_sources([str(metrics)], Path(metrics))[0], smoothing=0.0).frame
    return plots.overview(frame), plots.ttt_grid(frame)


def serve_command(checkpoint: str | Path, ttt_steps: int, verifier: str = "VERIFIER") -> str:
    """The vLLM command that serves the verifier with this drafter as its EAGLE-3 speculator (vLLM's config key for
    the draft steps is num_speculative_tokens)."""
    spec = speculative_config(checkpoint, ttt_steps)
    return f"python -m vllm.entrypoints.openai.api_server --model {verifier} --speculative-config '{json.dumps(spec)}'"


def hidden_states_note(figures: dict) -> str:
    """Markdown: where this run's hidden states came from (train.hidden_states) and what that cost."""
    mode = figures.get("hidden_states", "offline")
    if mode == "offline":
        return "Hidden states: **offline**, read from the extract stage's store (`RUN_DIR/extract/`)."
    cached = figures.get("states_cached_tokens", 0)
    note = (f"Hidden states: **{mode}**: the verifier computed {figures.get('states_computed_tokens', 0):,} tokens' "
            f"states as training consumed them ({figures.get('states_verifier_s', 0):,.1f} s of verifier time over all "
            f"processes), nothing stored")
    if mode == "hybrid":
        note += (f" but the first epoch's cache ({figures.get('states_cache_bytes', 0) / 1e6:,.1f} MB in "
                 f"`train/states-cache/`), from which {cached:,} tokens' states were read")
    if figures.get("states_peak_staged_bytes"):
        note += f"; at most {figures['states_peak_staged_bytes'] / 1e6:,.2f} MB waited in the vLLM staging folder"
    return note + "."
