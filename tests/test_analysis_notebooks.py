# Run: .venv/bin/python -m pytest tests/test_analysis_notebooks.py -q
"""Both analysis notebooks executed headlessly through the runner on the fixtures (before the generate/extract/train
stages exist): manifests complete with the right numbers, HTML reports linked from the index, and a bad source failing
the stage with the library's message."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # every test here executes notebooks (papermill kernels)
FIX = Path(__file__).parent / "fixtures" / "analysis"


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "eagle3lib", "run", *args], capture_output=True, text=True)


def test_both_notebooks_on_fixtures(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(FIX / "manifests", run)  # this run's generate/extract/train manifests, as the stages write them
    sources = json.dumps([str(FIX / "run_*" / "train" / "metrics.jsonl"), str(FIX / "speculators" / "train.log")])
    r = run_cli("--run-dir", str(run), "--stages", "learning_curves,cost_projection",
                "--set", f"learning_curves.sources={sources}", "--set", "cost_projection.samples=4000",
                "--set", "cost_projection.avg_tokens_per_sample=240", "--set", "cost_projection.avg_output_tokens_per_sample=180",
                "--set", "cost_projection.epochs=3")
    assert r.returncode == 0, r.stderr[-4000:]
    console = r.stdout + r.stderr  # the runner's console: one clean line per stage step, no kernel or papermill noise
    for noise in ("without encryption", "Unable to parse", "unknown parameter", "IProgress"):
        assert noise not in console, noise

    lc = json.loads((run / "learning_curves" / "manifest.json").read_text())
    assert lc["status"] == "complete"
    f = lc["figures"]
    assert (f["runs"], f["records"], f["duplicates_dropped"], f["torn_last_lines"]) == (3, 60, 25, 1)
    assert f["step"] == 120 and f["total_steps"] == 200 and f["ttt_steps"] == 3
    assert f["eta_h"] * 3600 == pytest.approx(160.0) and f["val_step"] == 100
    assert f["run1.step"] == 80 and f["run2.step"] == 110 and f["run2.total_steps"] == 200
    assert f["run2.val_loss"] == 3.926
    summary = (run / "learning_curves" / "summary.csv").read_text().splitlines()
    assert summary[0] == "metric,run_a,run_b,speculators/train.log" and summary[1] == "step,120,80,110"

    cp = json.loads((run / "cost_projection" / "manifest.json").read_text())
    assert cp["status"] == "complete" and cp["params"]["cost_projection"]["samples"] == 4000
    f = cp["figures"]
    assert f["extract_measured_tokens_per_s"] == 2400 and f["train_measured_tokens_per_s"] == 3000
    assert f["cpu-2core.extract_hours"] == pytest.approx(4000 * 240 / 2400 / 3600, rel=1e-5)
    assert f["cpu-2core.total_hours"] == pytest.approx((4000 * 180 / 400 + 4000 * 240 / 2400 + 4000 * 240 * 3 / 3000)
                                                       / 3600, rel=1e-5)
    assert f["extract_disk_gb"] == pytest.approx(4000 * 240 * 1536 / 1e9)
    assert f["mfu_extract"] == pytest.approx(2 * 3.5e6 * 2400 / 0.157e12, rel=1e-4)
    assert f["b300-x8.total_usd"] > 0 and f["cpu-2core.total_usd"] == 0
    assert (run / "cost_projection" / "projection.csv").exists()

    index = (run / "index.html").read_text()
    for stage in ("learning_curves", "cost_projection"):
        assert f'href="{stage}/report.html"' in index
        html = (run / stage / "report.html").read_text()
        assert "<img" in html or "image/png" in html  # the plots rendered


def test_missing_metrics_file_fails_with_its_name(tmp_path):
    run = tmp_path / "run"
    r = run_cli("--run-dir", str(run), "--stages", "learning_curves")  # default source: run/train/metrics.jsonl
    assert r.returncode == 1
    expected = f"metrics file not found: {run / 'train' / 'metrics.jsonl'}"
    assert "stage 'learning_curves' failed: ValueError: " + expected in r.stderr
    m = json.loads((run / "learning_curves" / "manifest.json").read_text())
    assert m["status"] == "failed" and expected in m["error"]


# ---------------------------------------------------------------------------------- notebooks opened as they ship
def _execute(notebook: str, runs: Path, out: Path):
    """papermill with no parameters, from notebooks/ (as JupyterLab runs it), looking for runs in `runs`."""
    import os

    import papermill as pm

    os.environ["EAGLE3LIB_RUNS_DIR"] = str(runs)  # the kernel inherits it
    try:
        nb_dir = Path(__file__).parents[1] / "notebooks"
        return pm.execute_notebook(str(nb_dir / notebook), str(out), cwd=str(nb_dir), progress_bar=False,
                                   kernel_name="python3")
    finally:
        del os.environ["EAGLE3LIB_RUNS_DIR"]


def _text(nb) -> str:
    return "\n".join(o.get("text", "") if isinstance(o.get("text"), str) else "".join(o.get("text", []))
                     for c in nb.cells for o in c.get("outputs", []))


def test_analysis_notebooks_as_they_ship_show_the_fixtures_before_any_run(tmp_path):
    for name in ("learning_curves", "cost_projection", "compare_runs", "deployment"):
        nb = _execute(f"{name}.ipynb", tmp_path / "runs", tmp_path / f"{name}.ipynb")
        assert "shows the shipped fixtures (tests/fixtures/analysis)" in _text(nb), name
        assert json.loads((tmp_path / "runs" / "interactive" / name / "manifest.json").read_text())["status"] == "complete"
    # deployment's fixture is a measured grid (tests/fixtures/analysis/deployment: the demo drafter, K 1-4 x
    # concurrency 1-16 on 2 cores): the model is held against every point of it, with the trained drafter's shape
    dep = json.loads((tmp_path / "runs" / "interactive" / "deployment" / "results.json").read_text())
    grid = json.loads((FIX / "deployment" / "evaluate" / "results.json").read_text())["concurrency_grid"]
    assert len(dep["cpu_comparison"]) == len([r for r in grid["rows"] if r["ttt_steps"]]) == 20
    assert dep["inputs"]["drafter_source"] == "the trained drafter"
    assert dep["inputs"]["acceptance_source"] == "the evaluate stage's concurrency grid, K = 4"


def test_notebooks_as_they_ship_use_the_newest_run_with_their_inputs(tmp_path):
    import os
    import time

    runs = tmp_path / "runs"
    for name in ("older", "newer"):
        shutil.copytree(FIX / "run_a" / "train", runs / name / "train")
        time.sleep(0.05)
    os.utime(runs / "older" / "train" / "metrics.jsonl")  # written last: the newest by its input
    _execute("learning_curves.ipynb", runs, tmp_path / "lc.ipynb")
    assert (runs / "older" / "learning_curves" / "manifest.json").exists() and not (runs / "newer" / "learning_curves").exists()

    import papermill as pm

    with pytest.raises(pm.PapermillExecutionError) as e:  # a stage notebook whose input no run has
        _execute("03_train.ipynb", runs, tmp_path / "train.ipynb")
    assert "no run under runs/ has extract/store.json, which the train stage reads" in str(e.value)
    assert "python -m eagle3lib run --profile tiny --run-dir runs/interactive --stages generate,extract" in str(e.value)


def test_compare_runs_side_by_side(tmp_path):
    """Two runs: one with an evaluate stage (tau per method, position and category), one without (dashes)."""
    import csv

    runs = {}
    for name in ("a", "b"):
        run = tmp_path / name
        shutil.copytree(FIX / "manifests", run)
        runs[name] = run
    ev = {"stage": "evaluate", "status": "complete", "wall_s": 60.0,
          "figures": {"tau_vllm_greedy": 2.75, "tau_lib_greedy": 2.74, "tau_val_est": 3.1, "accept_rate_pos_1_vllm_greedy": 0.8,
                      "accept_rate_pos_2_vllm_greedy": 0.55, "accept_rate_pos_3_vllm_greedy": 0.4,
                      "tau_vllm_greedy_chat": 2.5, "tau_vllm_greedy_math": 3.0}}
    (runs["a"] / "evaluate").mkdir()
    (runs["a"] / "evaluate" / "manifest.json").write_text(json.dumps(ev))
    r = run_cli("--run-dir", str(runs["a"]), "--stages", "compare_runs", "--set",
                f"compare_runs.runs={json.dumps([str(runs['a']), str(runs['b'])])}")
    assert r.returncode == 0, r.stderr[-4000:]
    m = json.loads((runs["a"] / "compare_runs" / "manifest.json").read_text())
    assert m["status"] == "complete" and m["figures"]["runs"] == 2
    assert m["figures"]["a.tau_vllm_greedy"] == 2.75 and m["figures"]["b.tau_vllm_greedy"] is None
    assert m["figures"]["a.train_tokens_per_s"] == 3000
    rows = {r_["method"]: r_ for r_ in csv.DictReader(open(runs["a"] / "compare_runs" / "acceptance.csv"))}
    assert rows["vllm_greedy"]["a"] == "2.75" and rows["vllm_greedy"]["b"] == ""
    pos = list(csv.DictReader(open(runs["a"] / "compare_runs" / "positions.csv")))
    assert [p["position"] for p in pos] == ["1", "2", "3"] and pos[1]["a"] == "0.55"
    tput = {(t["stage"], t["figure"]): t for t in csv.DictReader(open(runs["a"] / "compare_runs" / "throughput.csv"))}
    assert tput[("extract", "tokens_per_s")]["b"] == "2400.0"
    html = (runs["a"] / "compare_runs" / "report.html").read_text()
    assert "image/png" in html and "<td>–</td>" in html  # the plot, and b's missing evaluate as dashes
    assert 'href="compare_runs/report.html"' in (runs["a"] / "index.html").read_text()


def test_deployment_notebook_plans_kimi_on_every_hardware_row(tmp_path):
    """The kimi-k2.5 profile's deployment stage with no run at all (its verifier's shape and acceptance are in the
    profile): the report names every hardware row with its schedule and `vllm serve` line, or with the memory it
    lacks (h100-x8 cannot hold Kimi-K2.5's weights), and draws the curves."""
    run = tmp_path / "kimi"
    r = run_cli("--profile", "kimi-k2.5", "--run-dir", str(run), "--stages", "deployment")
    assert r.returncode == 0, r.stderr[-4000:]
    assert "huggingface.co" not in r.stderr  # an analysis-only run never asks the hub for the verifier
    m = json.loads((run / "deployment" / "manifest.json").read_text())
    assert m["status"] == "complete" and m["figures"]["hardware_rows"] == 4
    html = (run / "deployment" / "report.html").read_text()
    for row in ("rtx-pro-6000-x8", "b300-x8", "h200-x8"):
        assert f"<strong>{row}</strong>: at concurrency &lt;= " in html, row
    assert "<strong>h100-x8</strong>: does not fit: the weights need 596.2 GB, 576.0 GB available" in html
    assert "num_speculative_tokens_per_batch_size" in html and "MODEL" in html
    assert html.count("image/png") >= 1 and "Traceback" not in html
    # the decode model against published decode speed: one fitted row, the checks out of sample, in the manifest
    assert "DeepSeek-R1-0528 FP8" in html and html.count("<td>fit</td>") == 1 and html.count("<td>check</td>") == 15
    assert 0.5 <= m["figures"]["decode_model_over_measured_min"] <= m["figures"]["decode_model_over_measured_max"] <= 2
