# Run: .venv/bin/python -m pytest tests/test_cost.py -q
"""Cost projection: the hand check from the field notes, the Kimi-K2.5 profile's measured inputs, manifests of a run
(the fixtures), speed factors, MFU, break-even, sensitivity, and clear errors for bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import polars as pl
import pytest

from eagle3lib.analysis.cost import project, speed_factor, stage_hours
from eagle3lib.analysis.hardware import get_row, load_hardware
from eagle3lib.config.profile import load_profile

FIX = Path(__file__).parent / "fixtures" / "analysis"
MANIFESTS = FIX / "manifests"


def cfg_of(profile: str, **overrides):
    return load_profile(profile, {f"cost_projection.{k}": v for k, v in overrides.items()}).section("cost_projection")


def row(frame: pl.DataFrame, hardware: str, stage: str) -> dict:
    return frame.filter((pl.col("hardware") == hardware) & (pl.col("stage") == stage)).row(0, named=True)


def test_hand_check_extraction_hours():
    # field notes: 10,000 samples x 4,000 tokens at a measured 2,912 tokens/s ~ 3.8 h on 8x RTX PRO 6000
    assert round(stage_hours(10_000 * 4_000, 2_912), 1) == 3.8
    assert stage_hours(10_000 * 4_000, 2_912) == pytest.approx(40e6 / 2912 / 3600)


def test_kimi_profile_reproduces_the_field_notes():
    cp = project(cfg_of("kimi-k2.5", samples=10_000, avg_tokens_per_sample=4_000), Path("/nonexistent"))
    t = cp.table()
    ext = row(t, "rtx-pro-6000-x8", "extract")
    assert round(ext["hours"], 1) == 3.8 and ext["usd"] == 0 and ext["gpu_scale"] == 1
    assert ext["disk_gb"] == pytest.approx(40e6 * 57344 / 1e9)  # 56 KiB per token
    b300 = row(t, "b300-x8", "extract")
    assert 45 <= b300["hours"] * 60 <= 65  # the notes' estimate for a rented 8x B300 NVL8: 45-65 min (3-5x)
    assert b300["factor_lo"] < 3.5 and b300["factor_hi"] > 5  # the range covers the notes' 3-5x
    assert b300["usd"] == pytest.approx(b300["hours"] * 40)
    assert b300["usd_lo"] == pytest.approx(b300["hours_lo"] * 30) and b300["usd_hi"] == pytest.approx(b300["hours_hi"] * 50)
    tr = row(t, "rtx-pro-6000-x8", "train")  # measured on 4 GPUs at 2,258 tokens/s, projected on all 8
    assert tr["gpu_scale"] == 2 and tr["hours"] == pytest.approx(40e6 / (2258 * 2) / 3600)
    tot = row(t, "b300-x8", "total")
    assert tot["hours"] == pytest.approx(b300["hours"] + row(t, "b300-x8", "train")["hours"])
    assert set(t["hardware"]) == {"rtx-pro-6000-x8", "b300-x8", "h200-x8", "h100-x8"}
    assert "measured here" in ext["basis"] and "FLOP/s" in b300["basis"]
    assert "field notes" in cp.inputs()["source"][0]


def test_kimi_full_run_and_mfu():
    cp = project(cfg_of("kimi-k2.5"), Path("/nonexistent"))
    assert cp.spec.tokens("extract") == pytest.approx(87.8e6, rel=1e-3)
    # the later run's ~4.6 TB of hidden states (87.8M tokens x 56 KiB = 4.6 TiB)
    assert cp.figures()["total_disk_gb"] * 1e9 / 2**40 == pytest.approx(4.6, abs=0.05)
    mfu = {r["stage"]: r for r in cp.mfu().iter_rows(named=True)}
    assert mfu["extract"]["mfu"] == pytest.approx(2 * 32e9 * 2912 / (503.8e12 * 8))
    assert mfu["train"]["mfu"] == pytest.approx(6 * 0.985e9 * 5 * 2258 / (503.8e12 * 4))
    assert mfu["train"]["gpus"] == 4


TINY_SPEC = {"samples": 2000, "avg_tokens_per_sample": 240, "avg_output_tokens_per_sample": 180, "epochs": 3}


def test_manifests_of_a_run(tmp_path):
    cp = project(cfg_of("tiny", **TINY_SPEC), MANIFESTS)
    m = cp.measured
    assert (m["generate"].tokens_per_s, m["extract"].tokens_per_s, m["train"].tokens_per_s) == (400, 2400, 3000)
    assert m["extract"].gpus == 1 and m["extract"].bytes_per_token == 1536 and m["train"].gpus == 1
    assert str(MANIFESTS / "extract" / "manifest.json") in m["extract"].source
    t = cp.table()
    cpu = row(t, "cpu-2core", "extract")
    assert cpu["hours"] == pytest.approx(2000 * 240 / 2400 / 3600) and cpu["speed_factor"] == 1
    gen = row(t, "cpu-2core", "generate")
    assert gen["hours"] == pytest.approx(2000 * 180 / 400 / 3600)
    assert row(t, "cpu-2core", "train")["hours"] == pytest.approx(2000 * 240 * 3 / 3000 / 3600)
    assert row(t, "cpu-2core", "generate")["disk_gb"] == pytest.approx(2000 * 240 * 5 / 1e9)
    h100 = row(t, "h100-x8", "generate")  # decoding: bandwidth ratio, x8 GPUs
    assert h100["speed_factor"] == pytest.approx(3.35 / 0.02) and h100["gpu_scale"] == 8
    mfu = {r["stage"]: r["mfu"] for r in cp.mfu().iter_rows(named=True)}
    assert mfu["extract"] == pytest.approx(2 * 3.5e6 * 2400 / 0.157e12) and mfu["train"] is None
    # bytes_per_token missing but bytes and tokens present: derived
    run = tmp_path / "run"
    shutil.copytree(MANIFESTS, run)
    p = run / "extract" / "manifest.json"
    d = json.loads(p.read_text())
    del d["figures"]["bytes_per_token"]
    p.write_text(json.dumps(d))
    assert project(cfg_of("tiny"), run).measured["extract"].bytes_per_token == 1536


def test_missing_manifest_or_figure_names_the_file_and_key(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(MANIFESTS, run)
    p = run / "extract" / "manifest.json"
    d = json.loads(p.read_text())
    del d["figures"]["tokens_per_s"]
    p.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=rf"{p}: figures has no 'tokens_per_s'.*cost_projection\.extract_tokens_per_s"):
        project(cfg_of("tiny"), run)
    # entered by hand instead: the manifest's missing figure is not needed
    cp = project(cfg_of("tiny", extract_tokens_per_s=1200.0), run)
    assert cp.measured["extract"].tokens_per_s == 1200 and "by hand" in cp.measured["extract"].source
    shutil.rmtree(run / "train")
    with pytest.raises(ValueError, match=rf"{run / 'train' / 'manifest.json'}: no manifest \(run the train stage"):
        project(cfg_of("tiny", extract_tokens_per_s=1200.0), run)
    only = project(cfg_of("tiny", extract_tokens_per_s=1200.0, stages=["generate", "extract"]), run)
    assert set(only.measured) == {"generate", "extract"}  # only the stages costed need measurements


def test_unknown_hardware_is_named():
    with pytest.raises(ValueError, match=r"unknown hardware 'b300'.*did you mean 'b300-x8'"):
        project(cfg_of("kimi-k2.5", reference_hardware="b300"), Path("/nonexistent"))
    with pytest.raises(ValueError, match=r"unknown hardware 'a100-x8'.*rows: rtx-pro-6000-x8"):
        project(cfg_of("kimi-k2.5", hardware=["a100-x8"]), Path("/nonexistent"))
    with pytest.raises(ValueError, match=r"unknown hardware 'mi300x'"):
        project(cfg_of("kimi-k2.5", speed_factors={"mi300x": 2.0}), Path("/nonexistent"))


def test_hardware_table(tmp_path):
    table = load_hardware("params/hardware.yaml")
    assert {"rtx-pro-6000-x8", "b300-x8", "h200-x8", "h100-x8"} <= set(table)
    rtx, b300 = table["rtx-pro-6000-x8"], table["b300-x8"]
    assert rtx.owned and rtx.usd_per_hour == 0 and rtx.count == 8
    assert not b300.owned and b300.usd_per_hour_range == (30, 50) and b300.count == 8
    assert all(r.count == 8 for n, r in table.items() if n.endswith("-x8"))
    bad = tmp_path / "hw.yaml"
    bad.write_text("hardware:\n  x:\n    gpu: X\n    count: 8\n")
    with pytest.raises(ValueError, match=rf"{bad}: hardware row 'x': bf16_tflops"):
        load_hardware(bad)
    with pytest.raises(ValueError, match="hardware table not found"):
        load_hardware(tmp_path / "none.yaml")
    with pytest.raises(ValueError, match="did you mean 'h100-x8'"):
        get_row(table, "h100")


def test_hardware_table_refuses_a_row_given_twice(tmp_path):
    """Plain YAML keeps the last of two rows of one name without a word: the table names the file, the row and both
    lines, as a profile does."""
    row = "    gpu: X\n    count: 8\n    bf16_tflops: 1\n    mem_bw_tbs: 1\n    mem_gb: 1\n    usd_per_hour: 1\n"
    bad = tmp_path / "hw.yaml"
    bad.write_text(f"hardware:\n  x:\n{row}  y:\n{row}  x:\n{row}")
    with pytest.raises(ValueError, match=rf"^{bad}:16: duplicate key 'hardware.x' \(also at line 2\)$"):
        load_hardware(bad)


def test_speed_factors():
    table = load_hardware("params/hardware.yaml")
    ref, b300 = table["rtx-pro-6000-x8"], table["b300-x8"]
    sf = speed_factor(b300, ref, "extract", uncertainty=0.25)
    assert sf.point == pytest.approx(2250 / 503.8) and sf.flops_ratio == pytest.approx(2250 / 503.8)
    assert sf.bw_ratio == pytest.approx(8 / 1.792)
    assert sf.lo == pytest.approx(min(sf.flops_ratio, sf.bw_ratio) * 0.75)
    assert sf.hi == pytest.approx(max(sf.flops_ratio, sf.bw_ratio) * 1.25)
    h200 = speed_factor(table["h200-x8"], ref, "generate")
    assert h200.point == pytest.approx(4.8 / 1.792) and "bandwidth-bound" in h200.basis
    measured = speed_factor(b300, ref, "extract", {"b300-x8": 3.7})
    assert (measured.point, measured.lo, measured.hi) == (3.7, 3.7, 3.7) and "measured pair" in measured.basis
    cp = project(cfg_of("kimi-k2.5", speed_factors={"b300-x8": 3.7}), Path("/nonexistent"))
    assert row(cp.table(), "b300-x8", "extract")["hours"] == pytest.approx(cp.spec.tokens("extract") / (2912 * 3.7) / 3600)


def test_breakeven_and_sensitivity():
    cp = project(cfg_of("kimi-k2.5"), Path("/nonexistent"))
    tot = {r["hardware"]: r for r in cp.totals().iter_rows(named=True)}
    be = cp.breakeven().filter(pl.col("rented") == "b300-x8").row(0, named=True)
    own, rent = tot["rtx-pro-6000-x8"], tot["b300-x8"]
    assert be["owned"] == "rtx-pro-6000-x8" and be["hours_saved_by_renting"] == pytest.approx(own["hours"] - rent["hours"])
    assert be["usd_per_hour_saved"] == pytest.approx(rent["usd"] / (own["hours"] - rent["hours"]))
    assert be["breakeven_owned_hours"] == pytest.approx(95_000 / (rent["usd"] / own["hours"]))
    assert be["breakeven_runs"] == pytest.approx(95_000 / rent["usd"])
    seq = cp.sensitivity_seq_len(0.5, 2.0, n=3)
    b = seq.filter(pl.col("hardware") == "b300-x8")
    assert b["avg_tokens_per_sample"].to_list() == pytest.approx([2353 * 0.5, 2353, 2353 * 2])
    assert b["hours"].to_list() == pytest.approx([rent["hours"] * f for f in (0.5, 1, 2)])
    spd = cp.sensitivity_speed(n=5).filter(pl.col("hardware") == "b300-x8")
    hf = (spd["hours"] * spd["speed_factor"]).to_list()
    assert max(hf) == pytest.approx(min(hf))  # time falls as 1/factor
    est = spd["estimate"][0]
    assert hf[0] / est == pytest.approx(rent["hours"])
    assert "rtx-pro-6000-x8" not in spd["hardware"].to_list()


def test_offline_online_hybrid_on_the_kimi_profile():
    """The field run's 37,312 samples and 1M: disk, verifier passes, $ and the crossover where storing beats recomputing."""
    from eagle3lib.analysis.hidden_modes import cheapest, hidden_modes

    cfg = cfg_of("kimi-k2.5", epochs=3)
    cp = project(cfg, Path("/nonexistent"))
    hm = hidden_modes(cp, cfg.cache_budget_gb, 25.0, 1.0, [37_312, 1_000_000])
    get = {(r["samples"], r["hardware"], r["mode"]): r for r in hm.iter_rows(named=True)}
    off, on, hy = (get[(37_312, "b300-x8", m)] for m in ("offline", "online", "hybrid"))
    assert off["disk_tb"] == pytest.approx(87.8e6 * 57344 / 1e12, rel=1e-3) and on["disk_tb"] == 0  # ~5.0 TB vs none
    assert hy["disk_tb"] == pytest.approx(2.0)  # the 2 TB cache holds 40% of the states
    assert (off["verifier_passes"], on["verifier_passes"]) == (1, 3)
    assert hy["verifier_passes"] == pytest.approx(1 + 2 * (1 - 2.0 / off["disk_tb"]))
    v = off["verifier_hours_per_epoch"]
    assert on["hours"] - off["hours"] == pytest.approx(2 * v)  # two more verifier passes, the same training
    # at the crossover, offline (one pass + the disk) costs what online (a pass per epoch) does
    x = off["crossover_epochs"]
    assert 1 < x and x * v * 40 == pytest.approx(v * 40 + off["disk_tb"] * 25.0)
    big = get[(1_000_000, "b300-x8", "offline")]
    assert big["disk_tb"] == pytest.approx(1_000_000 * 2353 * 57344 / 1e12)  # 135 TB
    owned = get[(37_312, "rtx-pro-6000-x8", "online")]
    assert owned["usd"] == 0 and owned["crossover_epochs"] is None  # owned compute is free: online never loses on $
    assert set(cheapest(hm)["mode"]) <= {"offline", "online", "hybrid"}


def test_online_run_manifests_are_costed_from_the_trainer(tmp_path):
    """An online run's extract stage stored tokens only: the verifier's throughput comes from the train manifest's
    states figures and the disk from what storing would have taken."""
    run = tmp_path / "run"
    for stage, figs in {"extract": {"hidden_states": "online", "tokens": 1000, "bytes": 5000, "offline_bytes": 3_077_000,
                                    "tokens_per_s": 1e6, "num_gpus": 1},
                        "train": {"tokens_per_s": 2000.0, "num_processes": 1, "states_computed_tokens": 4000,
                                  "states_verifier_s": 2.0}}.items():
        (run / stage).mkdir(parents=True)
        (run / stage / "manifest.json").write_text(json.dumps({"status": "complete", "figures": figs}))
    cp = project(cfg_of("tiny", stages=["extract", "train"]), run)
    m = cp.measured["extract"]
    assert m.tokens_per_s == 2000.0 and m.bytes_per_token == pytest.approx(3077) and "online" in m.source
