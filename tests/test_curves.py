# Run: .venv/bin/python -m pytest tests/test_curves.py -q
"""Learning-curve loading on the fixtures (tests/fixtures/analysis, made by make_fixtures.py): live files with a torn
last line, ranks that all logged, speculators console logs, smoothing, ETA, and clear errors for bad input."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import polars as pl
import pytest

from eagle3lib.analysis.curves import latest, load_run, summary_table
from eagle3lib.analysis.log_sources import expand_sources, parse_ssh_url

FIX = Path(__file__).parent / "fixtures" / "analysis"
RUN_A = FIX / "run_a" / "train" / "metrics.jsonl"
RUN_B = FIX / "run_b" / "train" / "metrics.jsonl"
SPEC = FIX / "speculators" / "train.log"


def load(path, **kw):
    return load_run(expand_sources([str(path)], Path("unused"))[0], **kw)


def test_live_file_with_torn_last_line():
    r = load(RUN_A, smoothing=0.9)
    assert r.format == "eagle3lib" and r.torn_last_line and r.bad_lines == 0
    assert r.records == 14 and r.duplicates_dropped == 0  # 12 train (10..120) + 2 val
    train = r.frame.filter(pl.col("kind") == "train")
    assert train["step"].to_list() == list(range(10, 121, 10))
    lat = latest(r)
    assert lat["step"] == 120 and lat["total_steps"] == 200 and lat["progress_pct"] == pytest.approx(60.0)
    assert lat["steps_per_s"] == pytest.approx(0.5)  # 2 s per step in the fixture
    assert lat["eta_h"] * 3600 == pytest.approx(160.0)  # 80 steps left at 0.5 steps/s
    assert lat["finishes_at_unix"] == pytest.approx(1_750_000_000 + 240 + 160)
    last = json.loads(RUN_A.read_text().splitlines()[-2])
    assert lat["tau_est"] == pytest.approx(1 + sum(last[f"full_acc_{k}"] for k in range(3)))
    assert lat["val_step"] == 100 and "note" not in r.frame.columns  # an unknown string key is ignored
    val = r.frame.filter(pl.col("kind") == "val")
    assert val["tokens_seen"].to_list() == [50 * 4096, 100 * 4096]  # filled in from the train records
    assert val["elapsed_s"].to_list() == [101.0, 201.0]  # aligned with the train records' clock


def test_reading_while_training_appends(tmp_path):
    p = tmp_path / "train" / "metrics.jsonl"
    p.parent.mkdir()
    shutil.copy(RUN_A, p)
    assert load(p).records == 14
    torn = p.read_text().splitlines()[-1]
    full = json.loads(RUN_A.read_text().splitlines()[-2]) | {"step": 130, "time": 1_750_000_260.0, "elapsed_s": 260.0}
    rest = json.dumps(full)[len(torn):]
    assert json.dumps(full).startswith(torn)
    with p.open("a") as f:  # the writer finishes its line, then is caught mid-way through the next
        f.write(rest + "\n" + '{"kind": "train", "st')
    r = load(p)
    assert r.records == 15 and r.torn_last_line and latest(r)["step"] == 130


def test_ranks_that_all_logged_are_deduplicated_to_rank_0():
    r = load(RUN_B)
    assert r.records == 32 and r.duplicates_dropped == 24
    rank0 = [json.loads(x) for x in RUN_B.read_text().splitlines() if json.loads(x)["rank"] == 0]
    assert r.frame["loss"].to_list() == pytest.approx([x["loss"] for x in rank0])


def test_duplicates_without_rank_keep_the_last_copy(tmp_path):
    p = tmp_path / "m.jsonl"
    recs = [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0}, {"step": 2, "loss": 3.9}, {"step": 3, "loss": 3.0}]
    p.write_text("".join(json.dumps(x) + "\n" for x in recs))
    r = load(p, smoothing=0.0)
    assert r.duplicates_dropped == 1 and r.frame["loss"].to_list() == [5.0, 3.9, 3.0]
    assert r.frame["loss_smooth"].to_list() == [5.0, 3.9, 3.0]  # smoothing 0 = raw


def test_smoothing_is_a_bias_corrected_ema():
    r = load(RUN_A, smoothing=0.9)
    t = r.frame.filter(pl.col("kind") == "train")
    x, s = t["loss_0"].to_list(), t["loss_0_smooth"].to_list()
    assert s[0] == pytest.approx(x[0])
    assert s[1] == pytest.approx((x[1] + 0.9 * x[0]) / (1 + 0.9))
    v = r.frame.filter(pl.col("kind") == "val")
    assert v["loss_0_smooth"].to_list() == v["loss_0"].to_list()  # validation points stay raw


def test_speculators_console_log():
    r = load(SPEC)
    assert r.format == "speculators"
    assert r.records == 14 and r.duplicates_dropped == 1  # 12 train (steps 0..110) + a repeated one + 1 val
    assert r.total_steps == 200  # tqdm's 100 batches per epoch x "Training epoch 1/2"
    train = r.frame.filter(pl.col("kind") == "train")
    assert train["step"].to_list() == list(range(0, 120, 10))
    assert train["elapsed_s"].to_list() == [20.0 * i for i in range(12)]  # across midnight
    lat = latest(r)
    assert lat["loss_0"] == 1.259 and lat["full_acc_2"] == 0.423 and lat["cond_acc_1"] == 0.752
    assert lat["tau_est"] == pytest.approx(1 + 0.802 + 0.603 + 0.423)
    assert lat["lr"] == 1e-4 and lat["tokens_per_s"] == 2050.0 and lat["epoch"] == 1
    assert lat["val_step"] == 90 and lat["val_loss"] == 3.926 and lat["val_full_acc_0"] == 0.783
    assert lat["eta_h"] * 3600 == pytest.approx(180.0)  # 90 steps left at 0.5 steps/s
    assert "tokens_seen" not in r.frame.columns


def test_speculators_unwrapped_lines(tmp_path):
    p = tmp_path / "train.log"
    p.write_text("some banner\n"
                 "train/loss_0=2.500, train/full_acc_0=0.500, train/cond_acc_0=0.500, epoch=0, lr=1.00e-04, global_step=5\n"
                 "Epoch 0:  50%|#####     | 5/10\n"
                 "train/loss_0=2.000, train/full_acc_0=0.600, train/cond_acc_0=0.600, epoch=0, lr/AdamW=9.00e-05, "
                 "global_step=6\n")
    r = load(p)
    assert r.format == "speculators" and r.frame["step"].to_list() == [5, 6]
    assert r.frame["lr"].to_list() == [1e-4, 9e-5] and r.frame["tau_est"].to_list() == [1.5, 1.6]


def test_several_runs_side_by_side():
    srcs = expand_sources([str(FIX / "run_*" / "train" / "metrics.jsonl"), str(SPEC)], Path("unused"))
    assert [s.label for s in srcs] == ["run_a", "run_b", "speculators/train.log"]
    runs = [load_run(s) for s in srcs]
    table = summary_table(runs)
    assert table.columns == ["metric", "run_a", "run_b", "speculators/train.log"]
    row = table.filter(pl.col("metric") == "step").row(0)
    assert row[1:] == ("120", "80", "110")
    labelled = expand_sources([str(RUN_A), str(RUN_A)], Path("unused"), labels=["x", "x"])
    assert [s.label for s in labelled] == ["x", "x #2"]


def test_bad_input_messages(tmp_path):
    missing = tmp_path / "nope" / "metrics.jsonl"
    with pytest.raises(ValueError, match=f"metrics file not found: {missing}"):
        expand_sources([str(missing)], Path("unused"))
    with pytest.raises(ValueError, match=r"the train stage writes it"):
        expand_sources([], missing)  # the default source names what should have written it
    with pytest.raises(ValueError, match="no file matches"):
        expand_sources([str(tmp_path / "*.jsonl")], Path("unused"))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match=f"{empty}: the metrics file is empty"):
        load(empty)
    junk = tmp_path / "junk.log"
    junk.write_text("starting\nloading model\n")
    with pytest.raises(ValueError, match=f"{junk}: no metrics lines"):
        load(junk)
    nosteps = tmp_path / "nosteps.jsonl"
    nosteps.write_text('{"msg": "hello"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=f"{nosteps}: no metrics records among 2 lines"):
        load(nosteps)
    with pytest.raises(ValueError, match="2 names for 1 files"):
        expand_sources([str(RUN_A)], Path("unused"), labels=["a", "b"])


def test_ssh_sources_are_an_argument_list_never_a_shell_string():
    t = parse_ssh_url("ssh://alice@gpu-box:2222/runs/kimi/train/metrics.jsonl")
    assert (t.user, t.host, t.port, t.path) == ("alice", "gpu-box", 2222, "/runs/kimi/train/metrics.jsonl")
    assert t.command(30) == ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=30", "-p", "2222", "--", "alice@gpu-box",
                             "cat", "--", "/runs/kimi/train/metrics.jsonl"]
    nasty = parse_ssh_url("ssh://box/tmp/a;rm -rf ~")  # the remote shell sees one quoted word
    assert nasty.command(5)[-1] == "'/tmp/a;rm -rf ~'"
    assert parse_ssh_url("ssh://box/~/runs/m.jsonl").path == "runs/m.jsonl"
    for bad in ("ssh://-oProxyCommand=x/p", "ssh://box", "ssh://box/"):
        with pytest.raises(ValueError, match="ssh://"):
            parse_ssh_url(bad)
    src = expand_sources(["ssh://box/runs/r1/train/metrics.jsonl"], Path("unused"))[0]
    assert src.label == "r1" and src.ssh is not None


def test_unreachable_ssh_host_is_a_clear_error():
    src = expand_sources(["ssh://127.0.0.1:1/runs/x/train/metrics.jsonl"], Path("unused"))[0]
    with pytest.raises(ValueError, match=r"ssh://127\.0\.0\.1:1/runs/x/train/metrics\.jsonl: could not fetch over ssh"):
        load_run(src, timeout_s=5)


def test_tau_is_one_plus_sum_of_full_accuracies():
    r = load(RUN_A)
    t = r.frame.filter(pl.col("kind") == "train")
    for row in t.iter_rows(named=True):
        assert row["tau_est"] == pytest.approx(1 + sum(row[f"full_acc_{k}"] for k in range(3)))
        assert 1 <= row["tau_est"] <= 4 and not math.isnan(row["tau_est"])
