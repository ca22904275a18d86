"""The `verifier_report` section: what the verifier stage shows about the model the drafter will imitate."""

from __future__ import annotations

from pydantic import Field

from eagle3lib.config.base import StageConfig


class VerifierReportConfig(StageConfig):
    n_prompts: int = Field(6, ge=0)  # held-out prompts answered in the report, greedy and sampled
    max_tokens: int = Field(256, ge=1)  # enough for the tiny verifier's longest answer (code with reasoning)
    temperature: float = Field(0.8, gt=0)  # for the sampled answers; greedy answers use 0
    seed: int = 0  # sampling seed, so the report is reproducible
    serve: bool = True  # answer through a real vLLM server (False: HF generate only, e.g. without vLLM installed)
