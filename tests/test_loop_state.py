# Run: .venv/bin/python -m pytest -q tests/test_loop_state.py
"""The training loop's resumable counters go through a checkpoint and come back whole: every field, by name. Progress
was saved with every field but restored positionally, so a counter added to it would be saved and silently reset."""

from __future__ import annotations

import io
from dataclasses import fields

import torch

from eagle3lib.training.progress import Progress, Window


def _through_a_file(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)  # as checkpoints are read: no pickled objects


def test_progress_round_trips_every_field_by_name():
    saved = Progress(**{f.name: type(f.default)(7 + i) for i, f in enumerate(fields(Progress))})
    assert all(getattr(saved, f.name) != f.default for f in fields(Progress))
    assert Progress.from_state(_through_a_file(saved.state())) == saved
    # a checkpoint made before a counter existed: that counter starts from its default, the others are kept
    old = {k: v for k, v in saved.state().items() if k != "counted_step0"}
    assert Progress.from_state(old) == Progress(**{**saved.state(), "counted_step0": 0})


def test_the_logging_window_round_trips_every_count():
    w = Window(3, "cpu")
    w.stats += torch.arange(w.stats.numel(), dtype=torch.float64).reshape(w.stats.shape)
    for i, name in enumerate(k for k in list(vars(w)) if k != "stats"):  # every attribute, COUNTS or not
        setattr(w, name, 11 + i)
    back = Window(3, "cpu", _through_a_file(w.state()))
    assert torch.equal(back.stats, w.stats)
    assert {k: v for k, v in vars(back).items() if k != "stats"} == {k: v for k, v in vars(w).items() if k != "stats"}


def test_the_loop_state_round_trips_through_a_checkpoint():
    """Progress, window and best travel together: what `state` writes, `from_state` reads back whole."""
    from eagle3lib.training.best import Best
    from eagle3lib.training.progress import LoopState

    loop = LoopState.start(2, "cpu")
    loop.progress = Progress(**{f.name: type(f.default)(3 + i) for i, f in enumerate(fields(Progress))})
    loop.window.tokens, loop.window.steps = 40, 4
    loop.best = Best(**{f.name: f.default for f in fields(Best)})
    loop.best.take({"step": 9, "epoch": 1.5, "tau_est": 2.25}, {"tau_est": 2.5, "cond_acc_0": 0.7, "cond_acc_1": 0.4}, 2)
    back = LoopState.from_state(_through_a_file(loop.state(elapsed_s=loop.progress.elapsed_s)), 2, "cpu")
    assert back.progress == loop.progress and back.best == loop.best
    assert (back.window.tokens, back.window.steps) == (40, 4) and torch.equal(back.window.stats, loop.window.stats)


def test_the_checkpoint_store_owns_what_it_saved_and_resumes_it(tmp_path):
    """The store saves the module and optimizer it is handed, knows the step and folder it saved last, reopens the
    newest one with its training state, keeps `keep` of them, and clears an earlier run's folders when starting over."""
    from eagle3lib.model.drafter import DrafterConfig, Eagle3Drafter
    from eagle3lib.training.checkpoints import CheckpointStore
    from eagle3lib.training.optimizer import make_optimizer

    cfg = DrafterConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                        head_dim=8, vocab_size=64, draft_vocab_size=32)
    drafter = Eagle3Drafter(cfg)
    drafter.set_vocab(torch.arange(32) * 2)
    opt = make_optimizer(drafter, "adamw", 1e-3, (0.9, 0.95), 0.0, foreach=False)
    store = CheckpointStore(tmp_path, keep=2, rank=0)
    assert (store.saved_step, store.last) == (-1, None) and store.open(resume=True) is None
    for step in (3, 6, 9):
        path = store.save(step, drafter, opt, cfg, {"step": step, "marker": f"s{step}"})
        assert (store.saved_step, store.last) == (step, path) and path.name == f"step_{step:08d}"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000006", "step_00000009"]
    again = CheckpointStore(tmp_path, keep=2, rank=0)
    path, state, weights, damaged = again.open(resume=True)
    assert (again.saved_step, again.last, state["marker"], damaged) == (9, path, "s9", [])
    assert "optimizer" in state and torch.equal(weights["fc.weight"], drafter.state_dict()["fc.weight"])
    (tmp_path / "final").mkdir()
    assert CheckpointStore(tmp_path, keep=2, rank=0).open(resume=False) is None  # starting over: nothing to resume
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "final").exists()
