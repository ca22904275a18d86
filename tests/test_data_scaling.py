# .venv/bin/python -m pytest -q tests/test_data_scaling.py
"""The data_scaling stage on a real hidden-state store of the tiny verifier: nested fractions trained with the train
stage's recipe and the same held-out split, the 1.0 point being the train stage itself, a rerun that trains nothing,
and a profile with only reference points saying why it draws no curve. (vLLM-measured points: tests/test_pipeline.py.)"""

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

# the shared drafter's recipe (its train stage is the 1.0 point), logged more often: bookkeeping that does not change the
# drafter, so the train stage still counts as the same recipe
TRAIN = {**SHARED_TRAIN, "train.log_every": 3}
SCALING = {"data_scaling.fractions": [0.25, 0.5, 1.0], "data_scaling.vllm_points": 0, "data_scaling.target_tau": None}


def test_nested_subsets_share_the_validation_split():
    ids = [f"s{i:03d}" for i in range(300)]
    split = split_samples(300, 0.05, 200, 0, ids)
    quarter, half = (set(nested_subset(split.train, f, 0, ids)) for f in (0.25, 0.5))
    assert quarter < half < set(split.train) and not half & set(split.val)
    assert len(quarter) == 72 and len(half) == 143  # ceil(285 x f)
    shuffled = list(reversed(ids))  # a store written in another order picks the same samples (by id)
    split_r = split_samples(300, 0.05, 200, 0, shuffled)
    assert {shuffled[i] for i in nested_subset(split_r.train, 0.25, 0, shuffled)} == {ids[i] for i in quarter}


@pytest.fixture(scope="module")
def run(train_dir, tiny_verifier, tmp_path_factory):
    """A run whose train stage is the session's shared drafter (read only: data_scaling writes its own folder)."""
    run = make_run_dir(tmp_path_factory.mktemp("scaling"), cached_store(tiny_verifier, 300))
    (run / "train").symlink_to(train_dir, target_is_directory=True)
    return run


@pytest.mark.slow
def test_fractions_nested_on_one_held_out_split_and_the_full_point_is_the_train_stage(run):
    lines: list[str] = []
    res = data_scaling.run(open_stage("data_scaling", "tiny", run, {**TRAIN, **SCALING}), echo=lines.append)
    pts = res["points"]
    # the console (and so the report) says how each fraction ended, not each of its steps
    assert sum("] done:" in line for line in lines) == 2 and not any("[val]" in line for line in lines), lines
    assert [p["fraction"] for p in pts] == [0.25, 0.5, 1.0]
    assert [p["train_samples"] for p in pts] == [72, 143, 285]
    assert pts[0]["train_tokens"] < pts[1]["train_tokens"] < pts[2]["train_tokens"]
    assert pts[2]["dir"] == "train" and pts[2]["reused"] and not pts[0]["reused"]
    vals = {read_manifest(run / p["dir"])["figures"]["val_samples"] for p in pts}
    assert vals == {15}  # the same held-out split for every fraction
    for p in pts:
        assert 1.0 < p["val_tau_est"] <= 4.0 and 0 < p["val_tau_se"] < 0.3
        assert (run / p["checkpoint"] / "config.json").exists()
        assert p["scored_on"].startswith("cross-fitted") and len(p["chosen_steps"]) == 2
        # the per-sample counts (train/val_samples.jsonl) add up to each validation's own record
        vals = [r for r in read_metrics(run / p["dir"] / "metrics.jsonl") if r["kind"] == "val"]
        counts = load_counts(run / p["dir"], [r["step"] for r in vals])
        assert counts.steps == [r["step"] for r in vals] and len(counts.ids) == 15
        for s, rec in enumerate(vals):
            assert counts.n[s, :, 0].sum() == rec["positions"]
            assert float(counts.tau(np.ones(15))[s]) == pytest.approx(rec["tau_est"], abs=1e-9)
        assert p["val_tau_best"] == max(r["tau_est"] for r in vals)  # the old score: the same samples chose it
    # schedule "steps": every fraction plans as many optimizer steps as the whole data (whole epochs of its share,
    # so within one of its epochs); whether less data then scores lower needs a longer run than this one (33 steps):
    # the demo's curve in docs/howto/data-scaling.md, and tests/test_pipeline.py through the runner
    full = pts[2]["steps"]
    for p in pts[:2]:
        planned = read_manifest(run / p["dir"])["figures"]["planned_steps"]
        assert abs(planned - full) <= full * p["fraction"] + 1, (p["fraction"], planned, full)
    m = read_manifest(run / "data_scaling")
    assert m["status"] == "complete" and m["figures"]["points"] == 3 and m["figures"]["points_trained_here"] == 2
    fit = json.loads((run / "data_scaling" / "fit.json").read_text())
    assert fit["curve"] is not None and fit["curve"]["c"] <= 4.0
    assert "Infinity" not in (run / "data_scaling" / "fit.json").read_text()  # strict JSON
    assert fit["explanation"].startswith(("Acceptance rises from 1 (no data) toward a ceiling", "The points are still"))
    assert m["figures"]["target_tau"] == pytest.approx(round(pts[2]["val_tau_est"] + 0.2, 2))

    again = data_scaling.run(open_stage("data_scaling", "tiny", run, {**TRAIN, **SCALING}), echo=lambda _l: None)
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
