# .venv/bin/python -m pytest -q tests/test_train_stage.py
"""The train stage on a real hidden-state store of the tiny verifier: outputs and their schema, 2 processes (torchrun,
gloo; DDP and FSDP2) equal 1, SIGTERM + resume equals an uninterrupted run, bad inputs. (vLLM serving the checkpoint:
tests/test_evaluate.py.)"""

from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from train_fixtures import cached_store, fake_store, make_run_dir

from eagle3lib.config.stages import open_stage
from eagle3lib.model.checkpoint import CheckpointError, load_drafter
from eagle3lib.training.launch import launch, launch_command, launch_env
from eagle3lib.training.loop import train
from eagle3lib.training.metrics import read_metrics
from eagle3lib.training.setup import TrainingDiverged, TrainingError

N_SAMPLES = 300
# 3 epochs of ~285 samples in 1K-token rows, 2 rows per step: ~33 steps, about a minute here
RUN = {"train.epochs": 3, "train.log_every": 1, "train.ckpt_every": 10, "train.keep_checkpoints": 2,
       "train.nproc_per_node": 1}
K = 3


@pytest.fixture(scope="session")
def store(tiny_verifier) -> Path:
    return cached_store(tiny_verifier, N_SAMPLES)


@pytest.fixture(scope="session")
def trained(store, tmp_path_factory):
    """One uninterrupted in-process run (the reference for the resume test; the checkpoint vLLM serves)."""
    run = make_run_dir(tmp_path_factory.mktemp("train-ref"), store)
    ctx = open_stage("train", "tiny", run, RUN)
    manifest = train(ctx)
    return ctx, manifest


def _records(path: Path) -> dict[tuple[str, int], dict]:
    return {(r["kind"], r["step"]): r for r in read_metrics(path)}


def _assert_same_curve(a: dict, b: dict, keys_from: int = 1, rtol: float = 1e-4) -> None:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    fields = ["loss"] + [f"{m}_{k}" for m in ("loss", "full_acc", "cond_acc") for k in range(K)] + ["tau_est"]
    for key in a:
        if key[1] < keys_from:
            continue
        extra = ["lr", "tokens_seen", "samples_seen", "epoch", "grad_norm"] if key[0] == "train" else []
        # a served probe (the tiny profile's train.served_eval_every) of the same weights decodes the same answers
        for f in (["tau_greedy", "tau_sampled", "prompts"] if key[0] == "served" else fields + extra):
            assert math.isclose(a[key][f], b[key][f], rel_tol=rtol, abs_tol=1e-7), (key, f, a[key][f], b[key][f])


# ------------------------------------------------------------------------------------------------------ outputs

TRAIN_KEYS = (["kind", "step", "total_steps", "epoch", "tokens_seen", "samples_seen", "lr", "loss"]
              + [f"loss_{k}" for k in range(K)] + [f"full_acc_{k}" for k in range(K)] + [f"cond_acc_{k}" for k in range(K)]
              + ["tau_est", "tokens_per_s", "samples_per_s", "grad_norm", "peak_mem_mb", "time", "elapsed_s"])


@pytest.mark.slow
def test_outputs_schema_and_checkpoint(trained):
    ctx, m = trained
    recs = read_metrics(ctx.dir / "metrics.jsonl")
    train_recs = [r for r in recs if r["kind"] == "train"]
    val_recs = [r for r in recs if r["kind"] == "val"]
    assert [list(r) for r in train_recs] == [TRAIN_KEYS] * len(train_recs)
    assert [r["step"] for r in train_recs] == list(range(1, len(train_recs) + 1))  # log_every 1, no duplicates
    assert len(val_recs) == 3 and all({"loss", "tau_est", "epoch", "time", "full_acc_2"} <= set(r) for r in val_recs)
    assert train_recs[-1]["loss"] < 0.5 * train_recs[0]["loss"]
    for r in train_recs:
        assert 1 <= r["tau_est"] <= K + 1
        assert abs(r["tau_est"] - (1 + sum(r[f"full_acc_{k}"] for k in range(K)))) < 1e-9

    f = m["figures"]
    for key in ["steps", "epochs", "tokens_seen", "samples_seen", "tokens_per_s", "samples_per_s", "num_processes",
                "final_loss", "tau_est", "val_tau_est", "draft_vocab_size", "draft_vocab_coverage",
                "argmax_outside_draft_vocab", "peak_mem_mb", "wall_s", "kernels", "memory_model_gb"] + \
               [f"{p}_{k}" for p in ("full_acc", "cond_acc", "val_full_acc") for k in range(K)]:
        assert key in f and f[key] is not None, key
    assert f["kernels"] == "torch" and f["num_processes"] == 1 and f["draft_vocab_size"] == 512
    assert m["status"] == "complete" and f["val_tau_est"] > 1.5
    assert m["outputs"]["checkpoint"] == "final" and m["outputs"]["metrics"] == "metrics.jsonl"

    ck = ctx.dir / m["outputs"]["checkpoint"]
    cfg = json.loads((ck / "config.json").read_text())
    assert "model_type" not in cfg and cfg["speculators_model_type"] == "eagle3"
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == K
    assert cfg["speculators_config"]["verifier"]["name_or_path"]
    assert cfg["transformer_layer_config"]["model_type"] == "llama"
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] and cfg["draft_vocab_size"] == 512
    assert {"norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"} <= set(cfg)
    from safetensors import safe_open

    with safe_open(str(ck / "model.safetensors"), framework="pt") as sf:
        names = set(sf.keys())
        assert sf.get_tensor("d2t").dtype == torch.int64
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "layers.0.hidden_norm.weight",
            "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight"} <= names
    assert not any("embed_tokens" in n for n in names)
    assert not (ck / "training_state.pt").exists()
    # step checkpoints: the last `keep_checkpoints`, each with its resume state
    steps = sorted(p.name for p in (ctx.dir / "checkpoints").iterdir())
    assert len(steps) == 2 and steps[-1] == f"step_{f['steps']:08d}"

    # checkpoint choice by acceptance: best/ is the validation with the highest tau estimate (the earliest on a tie)
    best_rec = max(val_recs, key=lambda r: (r["tau_est"], -r["step"]))
    sel = json.loads((ctx.dir / "best" / "selection.json").read_text())
    assert sel["step"] == best_rec["step"] == f["best_step"] and sel["val_tau_est"] == f["best_val_tau_est"]
    assert f["still_improving"] == (val_recs[-1]["tau_est"] >= best_rec["tau_est"]) and f["validations"] == 3
    assert f["best_val_cond_acc_0"] == best_rec["cond_acc_0"] and m["outputs"]["best"] == "best"
    assert load_drafter(ctx.dir / "best")[1].ttt_steps == K

    # the public loader: same logits as the weights that were trained
    model, dcfg = load_drafter(ck)
    assert dcfg.ttt_steps == K and dcfg.draft_vocab_size == 512
    assert model.draft_to_target(torch.arange(512)).unique().numel() == 512


# ------------------------------------------------------------------------------------------- distributed = 1 proc


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_processes_equal_one(trained, store, tmp_path, mode):
    """torchrun, 2 processes on gloo, same global batch (2 rows per step): the same losses as the 1-process run."""
    ctx1, _ = trained
    run = make_run_dir(tmp_path / "run", store)
    ctx = open_stage("train", "tiny", run, {**RUN, "train.max_steps": 5, "train.nproc_per_node": 2,
                                            "train.distributed": mode, "train.val_fraction": 0.05})
    m = launch(ctx, echo=lambda _l: None)
    assert m["figures"]["num_processes"] == 2 and m["figures"]["distributed"] == mode
    two = {k: v for k, v in _records(ctx.dir / "metrics.jsonl").items() if k[0] == "train"}
    one = {k: v for k, v in _records(ctx1.dir / "metrics.jsonl").items() if k[0] == "train" and k[1] <= 5}
    # the warmup is 20 steps, so the learning rates of the first 5 steps do not depend on the run length
    for key in one:
        one[key] = {**one[key], "epoch": two[key]["epoch"]}
    _assert_same_curve(one, two, rtol=2e-4)


# ------------------------------------------------------------------------------------------------------- resume


@pytest.mark.slow
def test_sigterm_then_resume_equals_uninterrupted(trained, store, tmp_path):
    ctx_ref, m_ref = trained
    run = make_run_dir(tmp_path / "run", store)
    ctx = open_stage("train", "tiny", run, RUN)
    proc = subprocess.Popen(launch_command(ctx), env=launch_env(ctx), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    metrics = ctx.dir / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if any(r.get("step", 0) >= 12 for r in read_metrics(metrics)):  # past the step-10 checkpoint
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.stdout.read()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "SIGTERM: saved" in out
    from eagle3lib.core.manifest import read_manifest

    m = read_manifest(ctx.dir)
    assert m["status"] == "interrupted" and "step_" in m["resume_from"]
    stopped = int(Path(m["resume_from"]).name.split("_")[1])
    assert 12 <= stopped < m_ref["figures"]["steps"]
    assert not (ctx.dir / "final").exists()

    m2 = train(open_stage("train", "tiny", run, RUN))  # resumes from the SIGTERM checkpoint
    assert m2["figures"]["resumed_from_step"] == stopped
    _assert_same_curve(_records(ctx_ref.dir / "metrics.jsonl"), _records(metrics))
    # and the final weights are the same, and so is the choice of the best validation
    a = load_drafter(ctx_ref.dir / "final")[0].state_dict()
    b = load_drafter(ctx.dir / "final")[0].state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-6)
    assert m2["figures"]["best_step"] == m_ref["figures"]["best_step"] and m2["figures"]["validations"] == 3
    sel = json.loads((ctx.dir / "best" / "selection.json").read_text())
    assert sel["step"] == m_ref["figures"]["best_step"]


def test_best_on_resume_keeps_writes_or_forgets(tmp_path):
    """A resumed run keeps best/ when it is the checkpoint's best, writes it when the run was killed between the new
    best's step checkpoint and best/, and forgets a best/ from past the resumed step."""
    from eagle3lib.training.best import Best, on_resume, selection

    best_dir = tmp_path / "best"
    best_dir.mkdir()
    b30 = Best(step=30, epoch=1.0, val_tau_est=2.5, validations=1)
    (best_dir / "selection.json").write_text(json.dumps(selection(b30)))
    assert on_resume(best_dir, b30, resumed_step=40) == "keep"
    b40 = Best(step=40, epoch=1.3, val_tau_est=2.6, validations=2)  # the checkpoint at 40 says 40 is best
    assert on_resume(best_dir, b40, resumed_step=40) == "write"
    b20 = Best(step=20, epoch=0.7, val_tau_est=2.4, validations=1)  # resumed from an older checkpoint
    assert on_resume(best_dir, b20, resumed_step=25) == "forget"
    assert on_resume(best_dir, Best(), resumed_step=10) == "keep"  # no validation yet: nothing to say


@pytest.mark.slow
def test_killed_mid_logging_window_then_resumed_writes_the_same_records(store, tmp_path):
    """log_every 4 and a checkpoint every 6 steps: the step-6 checkpoint falls inside the window of steps 5-8, so the
    resumed run's step-8 record is right only if the checkpoint kept steps 5 and 6 of that window."""
    over = {**RUN, "train.max_steps": 14, "train.log_every": 4, "train.ckpt_every": 6}
    ref = open_stage("train", "tiny", make_run_dir(tmp_path / "ref", store), over)
    train(ref)
    run = make_run_dir(tmp_path / "run", store)

    class Killed(Exception):
        pass

    def kill_after_step_8(rec):  # the step-8 record is on disk; the newest checkpoint is step 6
        if rec["kind"] == "train" and rec["step"] == 8:
            raise Killed

    with pytest.raises(Killed):
        train(open_stage("train", "tiny", run, over), on_record=kill_after_step_8)
    m = train(open_stage("train", "tiny", run, over))
    assert m["figures"]["resumed_from_step"] == 6
    a, b = _records(ref.dir / "metrics.jsonl"), _records(run / "train" / "metrics.jsonl")
    assert [k for k in a if k[0] == "train"] == [("train", s) for s in (4, 8, 12, 14)]
    _assert_same_curve(a, b)


# --------------------------------------------------------------------------------------------------- bad inputs


@pytest.mark.slow
def test_bad_inputs_are_clear_errors(tmp_path, tiny_verifier, trained):
    def ctx_for(name, store_dir, overrides=None):
        run = tmp_path / name
        run.mkdir()
        (run / "extract").symlink_to(store_dir, target_is_directory=True)
        return open_stage("train", "tiny", run, {**RUN, **(overrides or {})})

    with pytest.raises(TrainingError, match=r"store\.json.*hidden_size 64 != the verifier's 192"):
        train(ctx_for("hidden", fake_store(tmp_path / "s-hidden", 4, hidden=64)))
    with pytest.raises(TrainingError, match=r"vocab_size 32000 != the verifier's 1472"):
        train(ctx_for("vocab", fake_store(tmp_path / "s-vocab", 4, meta_extra={"vocab_size": 32000})))
    with pytest.raises(TrainingError, match="holds no samples"):
        train(ctx_for("empty", fake_store(tmp_path / "s-empty", 0)))
    with pytest.raises(TrainingError, match=r"train.kernels=triton: .*unavailable"):
        train(ctx_for("kernels", tmp_path / "s-hidden", {"train.kernels": "triton"}))  # no CUDA here
    with pytest.raises(TrainingError, match="no hidden-state store"):
        run = tmp_path / "missing"
        run.mkdir()
        train(open_stage("train", "tiny", run, RUN))
    m = json.loads((tmp_path / "hidden" / "train" / "manifest.json").read_text())
    assert m["status"] == "failed" and "hidden_size" in m["error"]

    # incompatible checkpoint on resume: the reference run's checkpoints, a different drafter shape
    ref_ctx, _ = trained
    run = tmp_path / "incompatible"
    shutil.copytree(ref_ctx.dir, run / "train", symlinks=True)
    (run / "extract").symlink_to((ref_ctx.run_dir / "extract").resolve(), target_is_directory=True)
    with pytest.raises(CheckpointError, match=r"intermediate_size: checkpoint 512, now 256"):
        train(open_stage("train", "tiny", run, {**RUN, "train.intermediate_size": 256}))


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    store = fake_store(tmp_path / "s-nan", 24, nan_sample=13)
    run = tmp_path / "nan"
    run.mkdir()
    (run / "extract").symlink_to(store, target_is_directory=True)
    ctx = open_stage("train", "tiny", run, {"train.packing": False, "train.batch_rows": 1, "train.nproc_per_node": 1, "train.ckpt_every": 1,
                                             "train.epochs": 1, "train.log_every": 1, "train.val_fraction": 0.0,
                                             "train.packed_row_tokens": 64})
    with pytest.raises(TrainingDiverged, match=r"non-finite loss in step (\d+) .*Last good checkpoint: .*step_\d+") as e:
        train(ctx)
    import re

    bad_step = int(re.search(r"in step (\d+) ", str(e.value)).group(1))
    kept = sorted(p.name for p in (ctx.dir / "checkpoints").iterdir())
    assert bad_step > 1 and kept[-1] == f"step_{bad_step - 1:08d}"  # the state before the bad step
    model, _ = load_drafter(ctx.dir / "checkpoints" / kept[-1], verifier_path="builtin:tiny")
    assert all(torch.isfinite(v).all() for v in model.state_dict().values() if v.is_floating_point())
    assert not (ctx.dir / "final").exists()
    assert json.loads((ctx.dir / "manifest.json").read_text())["status"] == "failed"


def test_train_while_extract_runs_names_the_extract_process(tmp_path):
    """`--stages train` beside a running extract was told the store was empty (or trained on part of it): the lock
    the runner holds (eagle3lib/core/stage_lock.py) names the process."""
    import sys

    run = tmp_path / "run"
    hold = ("import sys, time; from pathlib import Path; from eagle3lib.core.stage_lock import stage_lock\n"
            "with stage_lock(Path(sys.argv[1]), 'extract'):\n    print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(TrainingError) as e:
            launch(open_stage("train", "tiny", run), echo=lambda _m: None)
    finally:
        holder.kill()
        holder.wait()
    assert str(e.value) == (f"extract is running in process {holder.pid} (lock {run / '.locks' / 'extract.lock'}): "
                            f"{run / 'extract'} is still being written; train once it completes")
    assert not (run / "train" / "train.log").exists()  # nothing started


# vLLM serving what the train stage writes (speculators layout) as the verifier's EAGLE-3 speculator, with the
# verifier's own greedy output and drafts accepted: tests/test_evaluate.py::test_library_and_vllm_agree_greedy, on the
# session's spec server (tests/conftest.py), which serves this stage's output folder; its EAGLE export beside it in
# test_k_sweep_and_drafters_side_by_side. (This module started a second spec server for the same check until the suite-time work.)


def test_frozen_lm_head_keeps_the_verifier_rows_and_refuses_an_unfrozen_resume(tmp_path, store, tiny_verifier):
    """train.freeze_lm_head: the exported lm_head is still the verifier's rows of the draft vocabulary; resuming its checkpoint with the head trainable is refused by name (the optimizer holds other tensors)."""
    from eagle3lib.model.verifier import load_verifier_head

    over = {**RUN, "train.freeze_lm_head": True, "train.max_steps": 4, "train.ckpt_every": 2}
    run = make_run_dir(tmp_path / "run", store)
    train(open_stage("train", "tiny", run, over))
    model, _ = load_drafter(run / "train" / "final")
    head = load_verifier_head(str(tiny_verifier))
    torch.testing.assert_close(model.lm_head.weight, head.lm_head[model.draft_ids].float(), rtol=0, atol=0)
    start = torch.load(run / "train" / "checkpoints" / "step_00000002" / "training_state.pt", weights_only=True)
    assert start["freeze_lm_head"] is True
    with pytest.raises(CheckpointError, match=r"train.freeze_lm_head: checkpoint True, now False"):
        train(open_stage("train", "tiny", run, {**over, "train.freeze_lm_head": False, "train.max_steps": 6}))


def test_ddp_keeps_one_gradient_copy(tmp_path, monkeypatch):
    """DDP's gradients are views into its all-reduce buckets (gradient_as_bucket_view), not a second fp32 copy of every
    parameter the memory model does not count. A one-process gloo group stands in for the ranks: `wrap` is asked as
    if there were two."""
    import torch.distributed as torch_dist
    from torch.nn.parallel import DistributedDataParallel

    from eagle3lib.training import distributed as dist

    torch_dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        monkeypatch.setattr(dist, "world", lambda: 2)
        layer = torch.nn.Linear(4, 4)
        wrapped = dist.wrap(torch.nn.Sequential(layer), torch.nn.ModuleList([layer]), "ddp", torch.device("cpu"))
        assert isinstance(wrapped, DistributedDataParallel) and wrapped.gradient_as_bucket_view
    finally:
        torch_dist.destroy_process_group()


def test_a_store_from_other_weights_of_the_same_shape_is_refused(tiny_verifier, tmp_path):
    """`--profile tiny-long` once trained on a store builtin:tiny wrote (same shapes) and labelled the drafter for
    tiny-long; a fine-tune of the same base passes every shape check too. The store records its verifier's weights."""
    import shutil

    from eagle3lib.model.verifier import load_config, weights_fingerprint
    from eagle3lib.training.setup import TrainingError, check_store

    vconf = load_config(str(tiny_verifier))
    meta = {"verifier": "builtin:tiny", "verifier_path": str(tiny_verifier), "hidden_size": vconf.hidden_size,
            "vocab_size": vconf.vocab_size, "num_layers": vconf.num_hidden_layers, "aux_layer_ids": [2, 4, 5],
            "verifier_weights": weights_fingerprint(tiny_verifier)}
    moved = shutil.copytree(tiny_verifier, tmp_path / "moved")  # the same weights elsewhere: accepted
    check_store(meta, tmp_path, vconf, [2, 4, 5], verifier=str(moved), model_path=str(moved))
    tuned = shutil.copytree(tiny_verifier, tmp_path / "tuned")
    weights = next(tuned.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-8:] = bytes(8)  # the last tensor's last values changed: the same shapes, other weights
    weights.write_bytes(bytes(data))
    with pytest.raises(TrainingError, match=rf"it was extracted from builtin:tiny \({tiny_verifier}, weights \w+\), "
                                            rf"this profile's verifier.model is mine \({tuned}, weights \w+\)"):
        check_store(meta, tmp_path, vconf, [2, 4, 5], verifier="mine", model_path=str(tuned))
