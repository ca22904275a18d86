"""Serving a checkpoint for a measurement: the one way the evaluate stage, its serving studies, the training's served
probe, the recipe and data-scaling studies and the benchmarks put a drafter (or the verifier alone) behind vLLM.

    with served(vcfg, model_path, log, ckpt, k) as ep:   # the verifier with `ckpt` drafting k tokens per round
        run_pass(ep, prompts, ...)                        # (eagle3lib/vllm/measure.py)

vLLM fixes a server's speculator and num_speculative_tokens when it starts, so each (checkpoint, K, drafting method)
is a server of its own; a running server given by URL is used as it is (the caller checks it drafts that K:
measure.check_speculative). Every local server gets the verifier section's arguments and environment first, then the
measurement's own (`server_args`, `extra_env`), so a GPU pin or an evaluate.server_args never drops a profile setting.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from eagle3lib.config.verifier import VerifierConfig
from eagle3lib.vllm.endpoint import Endpoint, verifier_endpoint
from eagle3lib.vllm.server import VLLMServer, server_for_verifier
from eagle3lib.vllm.speculative_config import speculative_config


def drafter_server(vcfg: VerifierConfig, model_path: str, log_path: Path, ckpt: str | Path | None = None,
                   k: int | None = None, *, spec_extra: dict[str, Any] | None = None, server_args: list[str] | None = None,
                   extra_env: dict[str, str] | None = None) -> VLLMServer:
    """The verifier's local server (not started), with drafter `ckpt` drafting `k` tokens per round when given, and
    `spec_extra` added to its speculative config (another drafting method, a K schedule per batch size)."""
    if ckpt is not None and k is None:
        raise ValueError(f"{ckpt}: serving a drafter needs its K (num_speculative_tokens)")
    spec = {**speculative_config(ckpt, k), **(spec_extra or {})} if ckpt is not None and k is not None else None
    return server_for_verifier(vcfg, model_path, log_path, speculative_config=spec,
                               extra_args=[*vcfg.extra_server_args, *(server_args or [])],
                               extra_env={**vcfg.server_env, **(extra_env or {})})


@contextmanager
def served(vcfg: VerifierConfig, model_path: str, log_path: Path, ckpt: str | Path | None = None, k: int | None = None,
           *, url: str | None = None, spec_extra: dict[str, Any] | None = None, server_args: list[str] | None = None,
           extra_env: dict[str, str] | None = None, connect_timeout_s: float = 30.0) -> Iterator[Endpoint]:
    """An endpoint for the passes inside the block: the running server at `url` as it is, else a local server
    (`drafter_server`) started here and stopped when the block ends, however it ends."""
    if url:
        yield verifier_endpoint(vcfg, connect_timeout_s, base_url=url)
        return
    with drafter_server(vcfg, model_path, log_path, ckpt, k, spec_extra=spec_extra, server_args=server_args,
                        extra_env=extra_env) as server:
        yield server.endpoint()
