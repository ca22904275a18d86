"""vLLM's `--speculative-config` for one of our drafters: the one place that knows a P-EAGLE checkpoint asks for
parallel drafting."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def is_parallel_drafter(ckpt: str | Path) -> bool:
    """A P-EAGLE checkpoint (speculators_model_type "peagle", written for train.parallel_drafting). A hub name or a
    folder not here counts as a chain drafter."""
    f = Path(ckpt) / "config.json"
    try:
        return json.loads(f.read_text()).get("speculators_model_type") == "peagle"
    except (OSError, ValueError):
        return False


def eagle3_speculative_config(ckpt: str | Path, k: int) -> dict[str, Any]:
    """{"method": "eagle3", "model", "num_speculative_tokens"}, plus `parallel_drafting: true` for a P-EAGLE drafter:
    vLLM 0.32 then fills the K-1 slots after the first with the checkpoint's mask token and mask_hidden and drafts all
    K in one forward (vllm/v1/spec_decode/llm_base_proposer.py); said explicitly, not left to vLLM's reading of the
    checkpoint's speculators type, so the served configuration is visible in every report."""
    spec: dict[str, Any] = {"method": "eagle3", "model": str(ckpt), "num_speculative_tokens": k}
    if is_parallel_drafter(ckpt):
        spec["parallel_drafting"] = True
    return spec


def served_as(ckpt: str | Path) -> str:
    """How vLLM drafts with it, for the side-by-side tables: "parallel" (P-EAGLE) or "chain" (EAGLE-3)."""
    return "parallel" if is_parallel_drafter(ckpt) else "chain"
