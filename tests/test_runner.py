# Run: .venv/bin/python -m pytest tests/test_runner.py -q
"""The runner end to end on the verifier stage: validation before execution, failure reporting, skip/force, index."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest


def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "eagle3lib", "run", *args], capture_output=True, text=True, cwd=cwd)


def test_misspelled_parameter_stops_before_anything_runs(tmp_path):
    r = run_cli("--run-dir", str(tmp_path / "run"), "--set", "verifier_report.n_promts=3")
    assert r.returncode == 2
    assert "verifier_report.n_promts" in r.stderr and "did you mean 'n_prompts'" in r.stderr
    assert not (tmp_path / "run" / "verifier").exists()


def test_unknown_stage_is_named(tmp_path):
    r = run_cli("--run-dir", str(tmp_path / "run"), "--stages", "verifer")
    assert r.returncode == 2 and "unknown stage 'verifer'" in r.stderr and "did you mean 'verifier'" in r.stderr


@pytest.mark.slow
def test_failing_stage_names_its_notebook(tiny_verifier, tmp_path):
    run = tmp_path / "run"
    # a verifier folder whose config cannot be read: the preflight says so and leaves it to the stage, which fails
    missing = tmp_path / "no-config-here"
    missing.mkdir()
    r = run_cli("--run-dir", str(run), "--stages", "verifier", "--set", f"verifier.model={missing}")
    assert r.returncode == 1
    nb = run / "verifier" / "00_verifier.ipynb"
    assert "[preflight] skipped" in r.stderr and "stage 'verifier' failed" in r.stderr and str(nb) in r.stderr
    assert "cannot load a config" in r.stderr  # the library's message, not a generic one
    m = json.loads((run / "verifier" / "manifest.json").read_text())
    assert m["status"] == "failed" and "cannot load a config" in m["error"]
    assert nb.exists() and (run / "verifier" / "report.html").exists()
    assert "failed" in (run / "index.html").read_text()


@pytest.mark.slow
def test_stage_runs_then_is_skipped_and_index_links_it(tiny_verifier, tmp_path):
    run = tmp_path / "run"
    args = ("--run-dir", str(run), "--stages", "verifier", "--set", "verifier_report.serve=false")
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads((run / "verifier" / "manifest.json").read_text())
    assert m["status"] == "complete" and m["wall_s"] > 0
    assert m["figures"]["num_layers"] == 8 and m["figures"]["aux_layer_ids"] == [2, 4, 5]
    assert m["params"]["verifier_report"]["serve"] is False
    index = (run / "index.html").read_text()
    assert 'href="verifier/report.html"' in index and (run / "verifier" / "report.html").exists()
    # complete -> skipped; a changed parameter makes it stale: the dry run names it (and runs nothing)
    r2 = run_cli(*args, "--dry-run")
    assert r2.returncode == 0 and "verifier         skip" in r2.stdout, r2.stdout
    r2 = run_cli(*args, "--set", "verifier_report.n_prompts=2", "--dry-run")
    assert r2.returncode == 0 and "run again from scratch" in r2.stdout, r2.stdout
    assert "verifier_report.n_prompts: 6 -> 2" in r2.stdout
    # --force re-runs from scratch
    r3 = run_cli(*args, "--force")
    assert r3.returncode == 0 and "verifier: complete in" in r3.stderr


def test_a_stage_is_stale_when_its_input_was_made_again_whatever_the_clocks_say(tmp_path):
    """`--stages train --force` re-makes the drafter: the evaluation of the old one must not be skipped as complete.
    And the reverse: a clock that steps (NTP), or stages run on two machines, once made a generate manifest completed
    "after" extract started, and extract then redid everything and a finished drafter was deleted. Ids, not times."""
    from eagle3lib.config.stages import get_stage
    from eagle3lib.core.manifest import StageTimer, update_manifest
    from eagle3lib.pipeline.plan import input_stale

    def complete(stage):
        up = get_stage(stage).input_stage
        StageTimer(tmp_path / stage, {}, tmp_path / up if up else None).finish({})

    def stale_reason(run, name):
        return input_stale(run, get_stage(name))

    complete("train")
    complete("evaluate")
    assert stale_reason(tmp_path, "evaluate") is None
    assert stale_reason(tmp_path, "train") is None  # no extract manifest: nothing to compare with
    # the clocks disagree: the input "completed" an hour after its user started, yet it is the same output
    update_manifest(tmp_path / "train", completed_at="2099-01-01T00:00:00+00:00", finished_at="2099-01-01T00:00:00")
    update_manifest(tmp_path / "evaluate", started_at="2000-01-01T00:00:00")  # no time zone: never compared
    assert stale_reason(tmp_path, "evaluate") is None
    complete("train")  # re-trained
    assert "train was re-run after it" in stale_reason(tmp_path, "evaluate")
    assert stale_reason(tmp_path, "verifier") is None  # the verifier report feeds no stage


def test_one_shared_verifier_server_for_the_stages_that_serve_the_verifier_alone(tmp_path):
    from eagle3lib.config.profile import load_profile, parse_set
    from eagle3lib.pipeline.shared_server import SharedServer

    def users(will_run, *sets):
        s = SharedServer(load_profile("tiny", parse_set(list(sets))), tmp_path, will_run)
        return getattr(s, "users", None)

    every = ["verifier", "generate", "extract", "train", "evaluate"]
    assert users(every) == ["verifier", "generate", "evaluate"]
    assert users(every, "verifier_report.serve=false") == ["generate", "evaluate"]
    assert users(every, "evaluate.server_args=[--max-num-seqs, '8']") == ["verifier", "generate"]  # not like-for-like
    assert users(every, "evaluate.base_server_url=http://127.0.0.1:9") == ["verifier", "generate"]
    assert users(["generate", "extract"]) is None  # one user: it starts its own
    assert users(["evaluate"]) is None  # overlapping its start with the library measurement is better
    assert users(every, "verifier.server_url=http://127.0.0.1:9") is None  # a running server is used as is


def test_the_index_shows_each_stages_headline_first(tmp_path):
    """The evaluate row listed ttt_steps, prompt counts and the training estimate, never the measured tau or the
    speedup: the first figures written. Each stage now declares its headline (config/stages.py)."""
    from eagle3lib.core.manifest import StageTimer
    from eagle3lib.pipeline.index import write_index

    run = tmp_path / "run"
    StageTimer(run / "evaluate").finish({"ttt_steps": 3, "ttt_steps_trained": 3, "num_prompts": 6, "num_prompts_lib": 3,
                                         "tau_train_est": 2.1, "accept_rate_pos_1_train_est": 0.7, "tau_val_est": 2.4,
                                         "tau_lib_greedy": 3.1, "tau_vllm_greedy": 3.05, "vllm_speedup": 1.9})
    StageTimer(run / "cost_projection").finish({"samples": 37000, "epochs": 3.0, "generate_tokens": 1e9,
                                                "h200-x8.total_usd": 1234.5, "h200-x8.total_hours": 20.0})
    page = write_index(run).read_text()
    row = page[page.index("<b>evaluate</b>"):page.index("</tr>", page.index("<b>evaluate</b>"))]
    shown = re.findall(r"<code>([^<]+)</code>", row)
    assert shown[:4] == ["tau_vllm_greedy", "tau_lib_greedy", "vllm_speedup", "tau_val_est"], shown
    row = page[page.index("<b>cost_projection</b>"):]
    assert re.findall(r"<code>([^<]+)</code>", row)[:3] == ["samples", "h200-x8.total_usd", "h200-x8.total_hours"]
