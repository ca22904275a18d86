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
