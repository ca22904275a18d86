"""The evaluate stage: the trained drafter's acceptance length measured by real speculative decoding, beside the
training-time estimate.

Three numbers for the same drafter, per draft position and overall (tau = tokens per verifier step, bonus included):
  estimate   from the train stage's conditional accuracies a_i: tau_est = 1 + sum_{k<=K} prod_{i<=k} a_i (train, val)
  library    eagle3lib.model.speculative: the HF verifier + the drafter, one sequence at a time, greedy and sampled; also
             the wall-clock speedup over plain KV-cached decoding with the same verifier (interleaved per prompt)
  vLLM       the verifier served with the drafter as its EAGLE-3 speculator; tau from the spec-decode counters on
             /metrics (deltas per category), throughput with and without the drafter at the same concurrency
All use the same prompts (token ids rendered once with the chat template), the same max_tokens and K.

Outputs in RUN_DIR/evaluate/: manifest.json (flat figures), results.json (every table), comparison.png, the two
servers' logs, and phases/*.json: each measurement phase is kept once complete (keyed by everything it depends on),
so a rerun after a failure resumes at the phase that failed. The phases themselves: eagle3lib/evaluation/stage_run.py.
"""

from __future__ import annotations

import time
from typing import Any

from eagle3lib.analysis.deployment import k_sweep_model
from eagle3lib.config.stages import StageContext
from eagle3lib.core.manifest import now_iso, update_manifest
from eagle3lib.evaluation import stage_run as phase
from eagle3lib.reports.evaluate import plot_comparison


def run(ctx: StageContext) -> dict[str, Any]:
    """The stage: returns {"figures", "results", "outputs"}; writes manifest.json, results.json, comparison.png."""
    timer = ctx.timer()
    t_start = time.time()
    try:
        ev = phase.prepare(ctx, t_start)
        try:
            if ev.cfg.vllm:
                phase.open_servers(ev)
            if ev.cfg.library:
                phase.library(ev)
            if ev.cfg.vllm:
                if ev.cfg.speed_repeats:
                    phase.speed(ev)
                phase.served(ev)
                phase.same_dist(ev)
                phase.other_drafters(ev)
                k_model = k_sweep_model(ctx.profile, ev.ckpt, ev.cfg.concurrency) if ev.cfg.ttt_steps_sweep else None
                phase.sweeps(ev, k_model)
                if ev.cfg.draft_sample_methods:
                    phase.sampling(ev)
        finally:
            ev.servers.close_all()
        return phase.finish(ev, timer, plot_comparison)
    except BaseException as e:
        update_manifest(ctx.dir, status="failed", error=f"{type(e).__name__}: {e}", finished_at=now_iso())
        raise
