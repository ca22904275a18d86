# .venv/bin/python -m pytest -q tests/test_data_scaling.py
"""The data_scaling stage on a real hidden-state store of the tiny verifier (the session's tiny run through the runner,
tests/pipeline_runs.py): nested fractions trained with the train stage's recipe and the same held-out split, the 1.0
point being the train stage itself, a rerun that trains nothing, and a profile with only reference points saying why
it draws no curve. (vLLM-measured points: tests/test_pipeline.py.)"""

from __future__ import annotations

import json

import numpy as np
import pytest
from train_fixtures import SHARED_TRAIN, cached_store, make_run_dir

from eagle3lib.analysis.scaling_points import load_counts
from eagle3lib.config.stages import open_stage
from eagle3lib.core.manifest import read_manifest
from eagle3lib.data.packing import nested_subset, split_samples
from eagle3lib.stages import data_scaling
from eagle3lib.training.loop import train
from eagle3lib.training.metrics import read_metrics

# the shared drafter's recipe, logged more often (bookkeeping that does not change the drafter)
TRAIN = {**SHARED_TRAIN, "train.log_every": 3}

def test_nested_subsets_share_the_validation_split():
    ids = [f"s{i:03d}" for i in range(300)]
    split = split_samples(300, 0.05, 200, 0, ids)
    quarter, half = (set(nested_subset(split.train, f, 0, ids)) for f in (0.25, 0.5))
    assert quarter < half < set(split.train) and not half & set(split.val)
    assert len(quarter) == 72 and len(half) == 143  # ceil(285 x f)
    shuffled = list(reversed(ids))  # a store written in another order picks the same samples (by id)
    split_r = split_samples(300, 0.05, 200, 0, shuffled)
    assert {shuffled[i] for i in nested_subset(split_r.train, 0.25, 0, shuffled)} == {ids[i] for i in quarter}


def test_fractions_nested_on_one_held_out_split_and_the_full_point_is_the_train_stage(tiny_run, tmp_path):
    """The session's tiny run (tests/pipeline_runs.py: its second command is this stage through the runner, 1/4, 1/2
    and the whole data): read, not trained again beside it. Then a copy of it run again trains nothing."""
    import math
    import shutil

    from pipeline_runs import TINY_SCALING_SETS, TINY_SETS

    from eagle3lib.config.profile import parse_set

    run = tiny_run.check()
    fit = json.loads((run / "data_scaling" / "fit.json").read_text())
    pts = fit["points"]
    log = (run / "data_scaling" / "data_scaling.ipynb").read_text()
    # the console (and so the report) says how each fraction ended, not each of its steps
    assert log.count("] done:") == 2 and "[val]" not in log
    assert [p["fraction"] for p in pts] == [0.25, 0.5, 1.0]
    n = pts[2]["train_samples"]
    assert [p["train_samples"] for p in pts] == [math.ceil(n * 0.25), math.ceil(n * 0.5), n]  # nested shares
    assert pts[0]["train_tokens"] < pts[1]["train_tokens"] < pts[2]["train_tokens"]
    assert pts[2]["dir"] == "train" and pts[2]["reused"] and not pts[0]["reused"]
    vals = {read_manifest(run / p["dir"])["figures"]["val_samples"] for p in pts}
    assert len(vals) == 1  # the same held-out split for every fraction
    (n_val,) = vals
    for p in pts:
        assert 1.0 < p["val_tau_est"] <= 4.0 and 0 < p["val_tau_se"] < 0.5
        assert (run / p["checkpoint"] / "config.json").exists()
        assert p["scored_on"].startswith("cross-fitted") and len(p["chosen_steps"]) == 2
        # the per-sample counts (train/val_samples.jsonl) add up to each validation's own record
        records = [r for r in read_metrics(run / p["dir"] / "metrics.jsonl") if r["kind"] == "val"]
        counts = load_counts(run / p["dir"], [r["step"] for r in records])
        assert counts.steps == [r["step"] for r in records] and len(counts.ids) == n_val
        for i, rec in enumerate(records):
            assert counts.n[i, :, 0].sum() == rec["positions"]
            assert float(counts.tau(np.ones(n_val))[i]) == pytest.approx(rec["tau_est"], abs=1e-9)
        assert p["val_tau_best"] == max(r["tau_est"] for r in records)  # the old score: the same samples chose it
    # schedule "steps": every fraction plans as many optimizer steps as the whole data (whole epochs of its share, so
    # within one of its epochs); whether less data then scores lower needs a longer run than this one: the demo's
    # curve in docs/howto/data-scaling.md
    full = pts[2]["steps"]
    for p in pts[:2]:
        planned = read_manifest(run / p["dir"])["figures"]["planned_steps"]
        assert abs(planned - full) <= full * p["fraction"] + 1, (p["fraction"], planned, full)
    m = read_manifest(run / "data_scaling")
    assert m["status"] == "complete" and m["figures"]["points"] == 3 and m["figures"]["points_trained_here"] == 2
    assert "Infinity" not in (run / "data_scaling" / "fit.json").read_text()  # strict JSON
    assert fit["explanation"] and (fit["curve"] is None) == bool(fit["no_curve_reason"])

    copy = tmp_path / "run"  # the session's run is read by other tests: run again in a copy
    shutil.copytree(run, copy, symlinks=True)
    # no vLLM point: the copy's checkpoints are at other paths, so the evaluate stage's measurement of the whole data
    # would not be taken and a server would start; the trainings are what a rerun must not repeat
    over = parse_set([*TINY_SETS, *TINY_SCALING_SETS, "data_scaling.vllm_points=0"])
    again = data_scaling.run(open_stage("data_scaling", "tiny", copy, over), echo=lambda _l: None)
    assert all(p["reused"] for p in again["points"])  # nothing trained twice
    assert [p["val_tau_est"] for p in again["points"]] == [p["val_tau_est"] for p in pts]


def test_reference_points_alone_are_no_curve_and_say_what_is_needed(tmp_path):
    """The kimi-k2.5 profile's field-notes runs only (two runs, two recipes): no curve drawn through them."""
    ctx = open_stage("data_scaling", "kimi-k2.5", tmp_path, {"data_scaling.fractions": [],
                                                             "data_scaling.fit_reference_points": True})
    res = data_scaling.run(ctx)
    assert res["curve"] is None and res["target"]["tokens"] is None
    assert "cannot be extrapolated" in res["explanation"] and "data_scaling.fractions" in res["explanation"]
    assert read_manifest(ctx.dir)["figures"]["samples_needed"] is None
    from eagle3lib.reports.data_scaling import plot_scaling

    plot_scaling(res)  # the reference points are still drawn


def test_patience_stops_an_overfitting_run_and_a_rerun_stays_stopped(tiny_verifier, tmp_path):
    """A run that stops getting better: train.patience ends it `patience` validations after its best, which best/
    keeps; the same command again trains nothing more, and a more patient one trains on. (A learning rate of 1e-12
    makes every validation tie with the first, so the stop is certain; the demo's 1/64 fraction shows a real one:
    best at step 44, stopped at 47 of 384.)"""
    run = make_run_dir(tmp_path / "run", cached_store(tiny_verifier, 300))
    over = {**TRAIN, "train.train_fraction": 0.1, "train.epochs": 40, "train.patience": 2, "train.ckpt_every": 10,
            "train.lr": 1e-12}
    m = train(open_stage("train", "tiny", run, over))
    f = m["figures"]
    assert f["stopped_early"] and f["steps"] < f["planned_steps"]
    vals = [r for r in json_lines(run / "train" / "metrics.jsonl") if r["kind"] == "val"]
    assert vals[-1]["step"] == f["steps"] and f["validations"] == len(vals)
    assert len(vals) == 3 and f["best_step"] == vals[0]["step"]  # the first, then 2 without a better tau
    assert all(r["tau_est"] <= f["best_val_tau_est"] for r in vals[-2:])
    again = train(open_stage("train", "tiny", run, over))
    assert again["figures"]["steps"] == f["steps"]  # stopped stays stopped
    more = train(open_stage("train", "tiny", run, {**over, "train.patience": 50, "train.max_steps": f["steps"] + 4}))
    assert more["figures"]["steps"] == f["steps"] + 4 and not more["figures"]["stopped_early"]


def json_lines(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_a_train_setting_added_later_reads_as_its_default_in_older_manifests():
    """A finished variant run (a data-scaling point, a recipe) stays reused when the train section gains a setting: the
    old manifest lacks the key and trained with what its default does; a run that sets it otherwise is another recipe."""
    from eagle3lib.training.variants import recipe_of

    old = {"train": {"lr": 1e-3, "batch_rows": 2}}  # written before train.target_logits existed
    assert recipe_of(old) == recipe_of({"train": {"lr": 1e-3, "batch_rows": 2, "target_logits": "full"}})
    assert recipe_of(old) != recipe_of({"train": {"lr": 1e-3, "batch_rows": 2, "target_logits": "draft"}})
