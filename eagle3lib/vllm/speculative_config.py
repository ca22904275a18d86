"""vLLM's `--speculative-config` for one of our drafters: the one place that knows which drafting scheme a checkpoint
asks for (a chain EAGLE-3 drafter, a P-EAGLE one that drafts in parallel, or a DFlash block drafter)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def speculators_type(ckpt: str | Path) -> str | None:
    """config.json's speculators_model_type ("eagle3", "peagle", "dflash"); None for the EAGLE layout, a hub name or a
    folder not here (all served as chain EAGLE-3 drafters)."""
    try:
        return json.loads((Path(ckpt) / "config.json").read_text()).get("speculators_model_type")
    except (OSError, ValueError, AttributeError):
        return None


def is_parallel_drafter(ckpt: str | Path) -> bool:
    """A P-EAGLE checkpoint (speculators_model_type "peagle", written for train.parallel_drafting)."""
    return speculators_type(ckpt) == "peagle"


def is_dflash_drafter(ckpt: str | Path) -> bool:
    """A DFlash checkpoint (speculators_model_type "dflash", eagle3lib/model/dflash.py)."""
    return speculators_type(ckpt) == "dflash"


def speculative_config(ckpt: str | Path, k: int) -> dict[str, Any]:
    """{"method", "model", "num_speculative_tokens"}: method eagle3, plus `parallel_drafting: true` for a P-EAGLE
    drafter (vLLM 0.32 then fills the K-1 slots after the first with the checkpoint's mask token and mask_hidden and
    drafts all K in one forward, vllm/v1/spec_decode/llm_base_proposer.py), or method dflash for a DFlash drafter
    (vllm/model_executor/models/qwen3_dflash.py). Said explicitly, not left to vLLM's reading of the checkpoint's
    speculators type, so the served configuration is visible in every report."""
    method = "dflash" if is_dflash_drafter(ckpt) else "eagle3"
    spec: dict[str, Any] = {"method": method, "model": str(ckpt), "num_speculative_tokens": k}
    if is_parallel_drafter(ckpt):
        spec["parallel_drafting"] = True
    return spec


def served_as(ckpt: str | Path) -> str:
    """How vLLM drafts with it, for the side-by-side tables: "chain" (EAGLE-3: K drafter forwards per round, each
    reading the last draft), "parallel" (P-EAGLE: one forward, K-1 masked slots) or "dflash" (one non-causal forward
    over [last token, K masks] attending to the verifier's context)."""
    return {"peagle": "parallel", "dflash": "dflash"}.get(speculators_type(ckpt) or "", "chain")
