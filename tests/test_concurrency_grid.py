# .venv/bin/python -m pytest -q tests/test_concurrency_grid.py
"""The K schedule per batch size (eagle3lib/evaluation/concurrency_grid.py): the schedule derived from a grid, the
comparison against fixed Ks, and the evaluate stage measuring a grid on the session's servers, then a real vLLM
server following a schedule (vLLM 0.32's num_speculative_tokens_per_batch_size): at concurrency 1 it drafts the first
range's K, at a larger batch the next range's (K = 0 included: no drafting), and its greedy outputs are the
verifier's own. The decode model that plans schedules for GPUs: tests/test_decode_time.py."""

from __future__ import annotations

import json

import pytest

from eagle3lib.evaluation.concurrency_grid import (
    grid_prompts,
    grid_rows,
    schedule_comparison,
    serve_command,
)
from eagle3lib.vllm.k_schedule import fastest_k, schedule_ranges
from eagle3lib.vllm.measure import EvalPrompt


def _rows(tps: dict[tuple[int, int], float]) -> list[dict]:
    measured: dict[int, dict[int, dict]] = {}
    for (k, c), t in tps.items():
        measured.setdefault(k, {})[c] = {"tokens_per_s": t, "tpot_ms": 1000.0 / t, "outputs": {"a": [k]}}
    return grid_rows(measured)


def test_schedule_is_the_fastest_k_per_concurrency_as_vllm_ranges():
    # K = 3 wins at 1-2, K = 1 at 4, the verifier alone at 8 and 16
    rows = _rows({(0, 1): 10, (1, 1): 14, (3, 1): 18, (0, 2): 19, (1, 2): 25, (3, 2): 28, (0, 4): 35, (1, 4): 40,
                  (3, 4): 38, (0, 8): 60, (1, 8): 55, (3, 8): 45, (0, 16): 90, (1, 16): 70, (3, 16): 50})
    best = fastest_k(rows)
    assert best == {1: 3, 2: 3, 4: 1, 8: 0, 16: 0}
    sched = schedule_ranges(best)
    assert sched == [[1, 2, 3], [3, 4, 1], [5, 16, 0]]  # neighbours with one K merged; the first range starts at 1
    speed = {r["concurrency"]: r["speedup"] for r in rows if r["ttt_steps"] == 3}
    assert speed[1] == pytest.approx(1.8) and speed[16] == pytest.approx(50 / 90)
    cmd = serve_command("tiny", "/d", sched)
    assert '"num_speculative_tokens": 3' in cmd and '"num_speculative_tokens_per_batch_size": [[1, 2, 3]' in cmd


def test_schedule_comparison_scores_every_policy_against_the_best_fixed_k():
    rows = _rows({(0, 1): 10, (2, 1): 20, (0, 8): 40, (2, 8): 20})
    served = {1: {"tokens_per_s": 19.0, "rounds": 10, "draft_tokens": 20, "outputs": {"a": [0]}},
              8: {"tokens_per_s": 38.0, "rounds": 0, "draft_tokens": 0, "outputs": {"a": [0]}}}
    base = {1: {"outputs": {"a": [0]}}, 8: {"outputs": {"a": [1]}}}
    cmp = schedule_comparison(rows, served, base)
    per = {r["concurrency"]: r for r in cmp["per_concurrency"]}
    assert per[1]["vs_best_fixed"] == pytest.approx(0.95) and per[1]["drafted_per_round"] == 2.0
    assert per[8]["drafted_per_round"] == 0.0 and per[8]["greedy_same_output_frac"] == 0.0
    # each fixed K loses half its speed at one of the two points: sqrt(0.5); the schedule ~0.95 at both
    assert cmp["grid_score"]["k0"] == pytest.approx(0.5 ** 0.5) and cmp["grid_score"]["k2"] == pytest.approx(0.5 ** 0.5)
    assert cmp["grid_score"]["schedule"] == pytest.approx(0.95) and cmp["schedule_beats_every_fixed_k"]


def test_a_pass_keeps_the_batch_full_by_cycling_the_prompts():
    prompts = [EvalPrompt(str(i), "chat", [1, 2, i]) for i in range(3)]
    sent = grid_prompts(prompts, 1)
    assert len(sent) == 8 and len({p.id for p in sent}) == 8 and {p.category for p in sent} == {"all"}
    assert [p.token_ids[-1] for p in sent] == [0, 1, 2, 0, 1, 2, 0, 1]
    assert len(grid_prompts(prompts, 4)) == 32 and len(grid_prompts([*prompts] * 4, 1)) == 12


@pytest.mark.slow
def test_stage_measures_the_grid_and_vllm_follows_a_schedule(spec_server, vllm_server, train_dir, tmp_path):
    """The evaluate stage's grid at concurrency 1 and 2 on the session's servers (K = 0: the verifier alone; K = 3:
    the spec server), then a schedule served by a server of its own: K = 0 (no drafting) at batch 1, K = 2 from batch
    2. At concurrency 1 nothing is drafted, at 2 every round drafts 2 (the tail's batch of 1 drafts none): vLLM applies
    the schedule per step. Every greedy output is the verifier's alone. A rerun reuses every measured phase.
    (Concurrency 1 and 2 only: each pass sends 8 x concurrency requests, and a third point at 4 doubled the test's
    time in the suite.)"""
    from eagle3lib.config.stages import open_stage
    from eagle3lib.stages.evaluate import run as run_evaluate

    run = tmp_path / "run"
    run.mkdir()
    (run / "train").symlink_to(train_dir, target_is_directory=True)
    over = {"evaluate.n_prompts": 8, "evaluate.max_tokens": 16, "evaluate.concurrency": 4, "evaluate.progress": False,
            "evaluate.modes": ["greedy"], "evaluate.library": False, "evaluate.checkpoint": "final",
            "evaluate.spec_server_url": spec_server.base_url, "evaluate.base_server_url": vllm_server.base_url,
            "evaluate.concurrency_sweep": [1, 2], "evaluate.ttt_steps_schedule": [[1, 1, 0], [2, 64, 2]],
            "evaluate.grid_repeats": 2, "evaluate.speed_repeats": 0, "evaluate.per_prompt": False}
    r = run_evaluate(open_stage("evaluate", "tiny", run, over))
    grid, f = r["results"]["concurrency_grid"], r["figures"]
    assert [(row["ttt_steps"], row["concurrency"]) for row in grid["rows"]] == [(k, c) for k in (0, 3) for c in (1, 2)]
    assert all(row["greedy_same_output_frac"] == 1.0 and row["tokens_per_s"] > 0 for row in grid["rows"])
    assert all(row["tau"] > 1.3 for row in grid["rows"] if row["ttt_steps"] == 3)  # the drafter is accepted
    phase = json.loads((run / "evaluate" / "phases" / "grid_k0.json").read_text())["result"]
    for point in phase.values():  # two passes per point, the faster kept
        assert len(point["tokens_per_s_passes"]) == 2 and point["tokens_per_s"] == max(point["tokens_per_s_passes"])
    best = fastest_k(grid["rows"])  # the grid's own schedule follows its measured rows
    assert {int(c): k for c, k in grid["best_k"].items()} == best and grid["derived_schedule"] == (
        schedule_ranges(best) if any(best.values()) else None)
    assert grid["schedule_source"] == "evaluate.ttt_steps_schedule"
    per = {row["concurrency"]: row for row in grid["per_concurrency"]}
    assert per[1]["drafted_per_round"] == 0.0 and per[1]["tau"] is None  # K = 0 at batch 1: the verifier alone
    assert per[2]["drafted_per_round"] == 2.0  # K = 2 at batch 2 (not 3, the spec server's K), every drafting round
    assert all(row["greedy_same_output_frac"] == 1.0 for row in per.values())
    assert '"num_speculative_tokens_per_batch_size": [[1, 1, 0], [2, 64, 2]]' in grid["serve_command"]
    assert f["grid_speedup_k3_c1"] == pytest.approx(per_row(grid, 3, 1)["speedup"]) and "grid_score_schedule" in f
    again = run_evaluate(open_stage("evaluate", "tiny", run, over))  # every phase kept: no server starts, same rows
    assert again["results"]["concurrency_grid"]["rows"] == grid["rows"]
    assert again["results"]["phases"]["concurrency_grid"]["seconds"] < 5


def per_row(grid: dict, k: int, c: int) -> dict:
    return next(row for row in grid["rows"] if row["ttt_steps"] == k and row["concurrency"] == c)
