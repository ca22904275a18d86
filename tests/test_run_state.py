# .venv/bin/python -m pytest -q tests/test_run_state.py
"""Damaged or contended run state, as a run meets it: nothing finished is lost or redone (forced re-runs, stale and
damaged manifests, one run per stage folder), failures before and under torchrun are one line naming the cause, and
a full disk leaves the last good state. Bad input itself (parameters, datasets, stores): tests/test_bad_inputs.py,
whose helpers this file shares; checkpoints: tests/test_bad_checkpoints.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_bad_inputs import _store, tree_digest

from eagle3lib.__main__ import main

# ----------------------------------------------------------------------------------------------- nothing is lost


def _complete_stage(run: Path, name: str, files: dict[str, str]) -> None:
    from eagle3lib.config.stages import get_stage
    from eagle3lib.core.manifest import StageTimer

    d = run / name
    d.mkdir(parents=True)
    for rel, text in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(text)
    up = get_stage(name).input_stage
    StageTimer(d, {"profile": "tiny"}, run / up if up else None).finish({"samples": 1})


@pytest.mark.slow
def test_forced_rerun_that_fails_restores_the_finished_outputs(tmp_path):
    """The two data-loss cases: a forced generate whose dataset has no prompt must not delete the finished responses,
    and the extract stage after it must not count that failed attempt as new input. (A dataset file that does not
    exist is refused earlier, by the preflight, before any stage starts: the outputs are not touched either.)"""
    run = tmp_path / "run"
    _complete_stage(run, "generate", {"shard-00000.jsonl": '{"id": "a", "status": "ok"}\n'})
    _complete_stage(run, "extract", {})
    _store(run / "extract")  # a sound store (a damaged one is extracted again: the next test)
    before = {s: tree_digest(run / s) for s in ("generate", "extract")}
    r = subprocess.run([sys.executable, "-m", "eagle3lib", "run", "--run-dir", str(run), "--stages", "generate",
                        "--force", "--set", f"generate.dataset={tmp_path / 'missing.jsonl'}"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "generate.dataset: no such file" in r.stderr, r.stderr
    assert tree_digest(run / "generate") == before["generate"]
    (tmp_path / "empty.jsonl").write_text("")  # exists: the stage itself fails, after the runner set the outputs aside
    r = subprocess.run([sys.executable, "-m", "eagle3lib", "run", "--run-dir", str(run), "--stages", "generate",
                        "--force", "--set", f"generate.dataset={tmp_path / 'empty.jsonl'}"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "no prompt to answer" in r.stderr and "were restored" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert tree_digest(run / "generate") == before["generate"]
    r = subprocess.run([sys.executable, "-m", "eagle3lib", "run", "--run-dir", str(run), "--stages", "extract"],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "extract: complete, skipped" in r.stderr, r.stderr
    assert tree_digest(run / "extract") == before["extract"]
    assert not list(run.glob(".*previous*"))


def test_stale_downstream_stage_is_redone_only_after_a_completed_upstream(tmp_path):
    from eagle3lib.config.stages import get_stage
    from eagle3lib.core.manifest import StageTimer, update_manifest
    from eagle3lib.pipeline.plan import input_stale

    run = tmp_path / "run"
    _complete_stage(run, "generate", {"shard-00000.jsonl": "{}\n"})
    _complete_stage(run, "extract", {"store.json": "{}"})
    StageTimer(run / "generate", {})  # a later attempt of generate...
    update_manifest(run / "generate", status="failed", finished_at="2099-01-01T00:00:00+00:00")  # ...that failed
    assert input_stale(run, get_stage("extract")) is None
    StageTimer(run / "generate", {}).finish({})  # one that completed
    assert "generate was re-run after it" in input_stale(run, get_stage("extract"))


def test_a_repaired_store_does_not_make_training_stale(tmp_path):
    """A complete extract whose store was damaged is run again to redo what is missing (same inputs, same data): its
    output id stays the original, so a finished training is not counted stale and trained again from scratch."""
    from eagle3lib.config.stages import get_stage
    from eagle3lib.core.manifest import StageTimer, read_manifest
    from eagle3lib.pipeline.plan import input_stale
    from eagle3lib.pipeline.runner import keep_data_time

    run = tmp_path / "run"
    _complete_stage(run, "extract", {"store.json": "{}"})
    _complete_stage(run, "train", {"final/model.safetensors": "weights"})
    before = read_manifest(run / "extract")
    StageTimer(run / "extract", {}).finish({"samples": 1})  # the repair run
    assert "extract was re-run after it" in input_stale(run, get_stage("train"))  # what a plain re-run would mean
    keep_data_time(run / "extract", before)
    after = read_manifest(run / "extract")
    assert input_stale(run, get_stage("train")) is None and after["output_id"] == before["output_id"] and after["repaired_at"]


@pytest.mark.parametrize(("manifest", "expected"), [
    ("[]", r"extract/manifest.json: damaged \(a JSON list where a manifest object belongs\)"),
    ('{"status": "complete", "params": []}', r"extract/manifest.json: damaged \(params is a JSON list, not an object\)"),
    ('{"status": "complete", "output_id": 5}', r"extract/manifest.json: damaged \(output_id is a JSON int, not a string"),
])
def test_a_damaged_upstream_manifest_is_an_error_and_deletes_nothing(capsys, tmp_path, manifest, expected):
    """A manifest of the wrong shape was read as "no manifest": extract re-ran with 0 samples and the train stage, its
    input "re-made", deleted a finished training run. Now: one line naming the file, exit 2, nothing touched."""
    run = tmp_path / "run"
    _complete_stage(run, "train", {"final/model.safetensors": "weights", "metrics.jsonl": "{}\n"})
    (run / "extract").mkdir()
    (run / "extract" / "manifest.json").write_text(manifest)
    before = tree_digest(run)
    code = main(["run", "--run-dir", str(run), "--stages", "train"])
    err = capsys.readouterr().err
    assert code == 2 and re.search(expected, err) and "Traceback" not in err, err
    assert tree_digest(run) == before


def _read_only(folder: Path) -> bool:
    """Make `folder` unwritable: permissions for a user, the immutable flag for root (whom permissions do not stop).
    True when a write into it now fails."""
    import os

    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i", str(folder)], capture_output=True)
    else:
        folder.chmod(0o555)
    try:
        (folder / ".probe").write_text("")
    except OSError:
        return True
    return False


def _writable_again(folder: Path) -> None:
    subprocess.run(["chattr", "-i", str(folder)], capture_output=True)
    folder.chmod(0o755)


def test_a_read_only_stage_folder_is_named_before_the_stage_runs(capsys, tmp_path):
    """A read-only stage folder inside a writable run dir gave a PermissionError traceback from the manifest's
    first write. Now: one line naming the folder and what to do, exit 2, the folder as it was."""
    run = tmp_path / "run"
    folder = run / "cost_projection"
    folder.mkdir(parents=True)
    (folder / "notes.txt").write_text("kept")
    if not _read_only(folder):
        _writable_again(folder)
        pytest.skip("cannot make a folder read-only here (root without chattr)")
    try:
        code = main(["run", "--run-dir", str(run), "--stages", "cost_projection"])
    finally:
        _writable_again(folder)
    err = capsys.readouterr().err
    assert code == 2 and f"{folder}: the stage cannot write to its folder" in err and "Traceback" not in err, err
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]


def test_a_file_where_a_stage_folder_belongs_is_named(capsys, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "cost_projection").write_text("not a folder")
    code = main(["run", "--run-dir", str(run), "--stages", "cost_projection"])
    err = capsys.readouterr().err
    assert code == 2 and f"{run / 'cost_projection'}: a file where the stage's folder belongs" in err, err
    assert "Traceback" not in err and (run / "cost_projection").read_text() == "not a folder"


def test_a_second_run_of_a_stage_on_the_same_run_dir_stops_naming_the_first(capsys, tmp_path):
    """Two `run --stages train` on one run dir both trained (the second resumed from the first's checkpoint: 172
    metrics records for 120 steps, final/ from whichever wrote last). Now the second stops at once, naming the first."""
    import os

    from eagle3lib.core.stage_lock import stage_lock

    run = tmp_path / "run"
    _complete_stage(run, "train", {"final/model.safetensors": "weights", "metrics.jsonl": "{}\n"})
    before = tree_digest(run / "train")
    with stage_lock(run, "train"):  # what the first run holds while it trains (an flock: a second open conflicts)
        code = main(["run", "--run-dir", str(run), "--stages", "train", "--force"])
    err = capsys.readouterr().err
    assert code == 2 and f"the train stage is being run by pid {os.getpid()}" in err, err
    assert tree_digest(run / "train") == before
    with stage_lock(run, "train"):  # released when the holder ends (or dies: the kernel drops an flock)
        pass


@pytest.mark.slow
def test_force_starts_over_a_stage_whose_manifest_is_damaged(capsys, tmp_path):
    """A truncated manifest blocked even --force ("not valid JSON"); --force now sets the folder aside and runs."""
    run = tmp_path / "run"
    (run / "verifier").mkdir(parents=True)
    (run / "verifier" / "manifest.json").write_text('{"status": "comp')
    assert main(["run", "--run-dir", str(run), "--stages", "verifier"]) == 2  # without --force: named, kept
    assert "verifier/manifest.json: not valid JSON" in capsys.readouterr().err
    code = main(["run", "--run-dir", str(run), "--stages", "verifier", "--force", "--set", "verifier_report.serve=false"])
    assert code == 0 and json.loads((run / "verifier" / "manifest.json").read_text())["status"] == "complete"


def test_serve_on_a_port_in_use_is_one_line(tmp_path):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "eagle3lib", "serve", "--port", str(port)], capture_output=True,
                           text=True, timeout=120)
    assert r.returncode == 2 and f"--port {port}: cannot listen on 127.0.0.1:{port}" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


def test_a_server_url_that_is_not_vllm_is_named_without_its_html(tmp_path):
    """verifier.server_url at another HTTP server (a web page, a proxy's error page) printed the HTML; now the key, the
    status and the page's text in one line."""
    import threading
    from http.server import HTTPServer, SimpleHTTPRequestHandler

    from eagle3lib.config.verifier import VerifierConfig
    from eagle3lib.vllm.endpoint import ServerError, verifier_endpoint

    (tmp_path / "index.html").write_text("<html><head><style>p{}</style></head><body><h1>Welcome</h1></body></html>")

    class Quiet(SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=str(tmp_path), **kw)

        def log_message(self, *a):
            pass

    httpd = HTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_port}"
    try:
        with pytest.raises(ServerError) as e:
            verifier_endpoint(VerifierConfig(model="builtin:tiny", server_url=url), 5.0)
    finally:
        httpd.shutdown()
    msg = str(e.value)
    assert msg.startswith(f"verifier.server_url: {url}/v1/models answered HTTP 404 (text/html: ") and "<" not in msg, msg
    assert msg.endswith("is it a vLLM (OpenAI API) server?") and len(msg) < 400


def test_the_cause_of_a_rank_failure_is_found_in_torchruns_output():
    """The line that says why, out of a rank's traceback and torchrun's own report (the shapes torch 2.13 prints)."""
    from eagle3lib.core.torchrun import failure_cause

    traceback = ["[rank1]: Traceback (most recent call last):", '[rank1]:   File "loop.py", line 9, in train',
                 "[rank1]:     raise ValueError('bad')", "[rank1]: ValueError: the store has 3 samples",
                 "E1203 12:00:00.000 torch.distributed.elastic.multiprocessing.api: [ERROR] failed (exitcode: 1)",
                 "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:", "  exitcode  : 1 (pid: 7)"]
    assert failure_cause(traceback) == "ValueError: the store has 3 samples"
    assert failure_cause(["[train] error: train.init_from: no such folder", *traceback]) == "train.init_from: no such folder"
    assert failure_cause(["Killed", "  exitcode  : -9 (pid: 7)"]).startswith("a rank was killed by SIGKILL (the kernel's")
    assert failure_cause(["Killed"]) is None  # the caller says "exit code N"
    # the rank that failed first, not the collective the others were in when it went
    echo = ["[rank0]: torch.distributed.DistBackendError: [../gloo/transport/tcp/pair.cc:534] Connection closed by peer"]
    assert failure_cause(traceback[:4] + echo + traceback[4:]) == "ValueError: the store has 3 samples"
    assert failure_cause(echo + traceback[4:]) == echo[0].removeprefix("[rank0]: ")


@pytest.mark.slow
def test_a_failing_rank_is_one_line_with_torchruns_report_in_the_log(tiny_verifier, tmp_path):
    """A rank that fails under torchrun: its one-line cause, and the ~30 lines of torchrun's ChildFailedError in
    train/train.log instead of in the error (a memory budget the step does not fit: known to a rank only). A
    validation split that leaves no training samples is known from the store's index: refused before torchrun."""
    from train_fixtures import cached_store, make_run_dir

    from eagle3lib.config.stages import open_stage
    from eagle3lib.training.launch import launch
    from eagle3lib.training.setup import TrainingError

    run = make_run_dir(tmp_path / "run", cached_store(tiny_verifier, 300))
    split = {"train.nproc_per_node": 2, "train.val_fraction": 0.999, "train.val_max_samples": 1000}
    with pytest.raises(TrainingError, match=r"train.val_fraction=0.999: the validation split takes all 300 samples"):
        launch(open_stage("train", "tiny", run, split), echo=lambda _l: None)
    assert not (run / "train" / "train.log").exists()  # no process was started
    with pytest.raises(TrainingError) as e:
        launch(open_stage("train", "tiny", run, {"train.nproc_per_node": 2, "train.memory_gb": 0.001}),
               echo=lambda _l: None)
    msg = str(e.value)
    assert re.fullmatch(r"training failed: \w+: .*train\.memory_gb.* \(every process's output: \S+/train/train.log\)",
                        msg, re.S) and "\n" not in msg, msg
    assert "ChildFailedError" in (run / "train" / "train.log").read_text()


# ------------------------------------------------------------------------------------------------------ disk full


@pytest.fixture
def tiny_disk(tmp_path):
    """A 256 KiB tmpfs, where this machine lets root mount one."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({r.stderr.strip() or r.returncode}): disk-full cases not run")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


def test_disk_full_during_a_shard_keeps_the_complete_shards(tiny_disk):
    from eagle3lib.data.hidden_store import HiddenSample, HiddenStateReader, HiddenStateWriter, StoreError

    root = tiny_disk / "store"
    meta = {"verifier": "x", "hidden_size": 64, "vocab_size": 64, "num_layers": 8, "aux_layer_ids": [2, 4, 5]}
    w = HiddenStateWriter(root, meta, samples_per_shard=1)
    w.add(HiddenSample("s0", torch.arange(100), torch.ones(100, dtype=torch.bool), torch.zeros(100, 3, 64).bfloat16(),
                       torch.zeros(100, 64).bfloat16()))
    before = tree_digest(root)
    with pytest.raises(StoreError, match=r"shard-00001.safetensors: cannot write the shard .*MiB free on that disk.*"
                                         r"keeps its 1 complete shards"):
        w.add(HiddenSample("s1", torch.arange(2000), torch.ones(2000, dtype=torch.bool),
                           torch.zeros(2000, 3, 64).bfloat16(), torch.zeros(2000, 64).bfloat16()))
    assert tree_digest(root) == before and not list((root / "shards").glob(".*.tmp"))
    assert HiddenStateReader(root).ids == ["s0"]


def test_disk_full_during_a_checkpoint_keeps_the_previous_one(tiny_disk, tmp_path):
    from eagle3lib.model.checkpoint import CheckpointError, save_drafter
    from eagle3lib.model.drafter import DrafterConfig, Eagle3Drafter
    from eagle3lib.training.checkpoints import list_checkpoints

    small = DrafterConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                          head_dim=8, vocab_size=64, draft_vocab_size=32)
    d = Eagle3Drafter(small)
    d.set_vocab(torch.arange(32) * 2)
    root = tiny_disk / "checkpoints"
    save_drafter(d.state_dict(), small, root / "step_00000001", {"step": 1})
    before = tree_digest(root)
    big = DrafterConfig(hidden_size=256, intermediate_size=512, num_attention_heads=2, num_key_value_heads=1,
                        head_dim=128, vocab_size=64, draft_vocab_size=32)
    d = Eagle3Drafter(big)
    d.set_vocab(torch.arange(32) * 2)
    with pytest.raises(CheckpointError, match=r"step_00000002: cannot write the checkpoint .*earlier checkpoints"):
        save_drafter(d.state_dict(), big, root / "step_00000002", {"step": 2})
    assert tree_digest(root) == before and [s for s, _ in list_checkpoints(root)] == [1]


def test_disk_full_during_generate_names_the_shard(tiny_disk):
    from eagle3lib.data.records import ShardWriter, iter_records

    with ShardWriter(tiny_disk / "gen", 10_000) as w:
        w.write({"id": "a", "status": "ok"})
        with pytest.raises(OSError, match=r"shard-00000.jsonl: cannot append a record .*written so far are kept"):
            for i in range(100_000):
                w.write({"id": f"x{i}", "status": "ok", "pad": "y" * 1000})
    ids = [r["id"] for _, _, r in iter_records(tiny_disk / "gen")]
    assert ids[0] == "a" and len(ids) > 10


def test_resume_falls_back_past_a_damaged_checkpoint(tmp_path, one_thread, capsys):
    from test_golden_loss import _store, _verifier

    from eagle3lib.config.stages import open_stage
    from eagle3lib.training.loop import train

    run = tmp_path / "run"
    run.mkdir()
    _store(run / "extract")
    over = {"verifier.model": str(_verifier(tmp_path / "verifier")), "train.max_steps": 6, "train.ckpt_every": 2,
            "train.keep_checkpoints": 3, "train.log_every": 1, "train.nproc_per_node": 1, "train.threads": 1,
            "train.draft_vocab_size": 128, "train.packed_row_tokens": 128, "train.batch_rows": 2,
            "train.val_fraction": 0.0}
    train(open_stage("train", "tiny", run, over))
    newest = run / "train" / "checkpoints" / "step_00000006" / "model.safetensors"
    newest.write_bytes(newest.read_bytes()[:1000])  # e.g. the disk filled up while it was copied
    m = train(open_stage("train", "tiny", run, {**over, "train.max_steps": 8}))
    out = capsys.readouterr().out
    assert m["figures"]["resumed_from_step"] == 4 and m["figures"]["steps"] == 8
    assert f"skipped a damaged checkpoint: {newest}: damaged weights" in out
    # a hand-edited metrics record (a step that is not a number) was a TypeError traceback on the next resume
    from eagle3lib.stages.train import main as train_main

    metrics = run / "train" / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    lines[1] = json.dumps({**json.loads(lines[1]), "step": "two"})
    metrics.write_text("\n".join(lines) + "\n")
    argv = ["--profile", "tiny", "--run-dir", str(run), "--overrides-json", json.dumps({**over, "train.max_steps": 10})]
    assert train_main(argv) == 1
    assert f"[train] error: {metrics}:2: step is 'two', not a number; fix or delete that line" in capsys.readouterr().err


def test_a_complete_stage_whose_declared_outputs_are_gone_is_not_skipped(tmp_path):
    """A deleted train/final was "complete, skipped"; a forced evaluate then blamed evaluate.checkpoint, never set.
    Every stage's declared outputs are checked before it is skipped (intermediate checkpoints excepted: users delete
    them to save space, and nothing reads them once the stage is complete)."""
    import shutil

    from eagle3lib.config.stages import get_stage
    from eagle3lib.core.manifest import StageTimer, read_manifest
    from eagle3lib.pipeline.plan import damaged_outputs, decide

    def runs(stage):
        return decide(stage, run, None, force=False).action != "skip"

    run = tmp_path / "run"
    (run / "train" / "final").mkdir(parents=True)
    (run / "train" / "checkpoints" / "step_9").mkdir(parents=True)
    (run / "train" / "metrics.jsonl").write_text("{}\n")
    StageTimer(run / "train", {}).finish({"steps": 9}, {"checkpoint": "final", "metrics": "metrics.jsonl",
                                                        "last_step_checkpoint": "checkpoints/step_9",
                                                        "references": str(tmp_path / "elsewhere")})
    assert not runs(get_stage("train"))
    shutil.rmtree(run / "train" / "checkpoints")
    assert not runs(get_stage("train"))
    shutil.rmtree(run / "train" / "final")
    assert runs(get_stage("train"))
    assert damaged_outputs(run / "train", read_manifest(run / "train"), get_stage("train")) == \
        "its outputs final are missing"
