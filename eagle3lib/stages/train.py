"""The train stage: the EAGLE-3 drafter trained on the extract stage's hidden states, one process or many (torchrun).

  run(ctx)   what the notebook calls: `python -m eagle3lib.stages.train` in a subprocess, under torchrun when
             train.nproc_per_node * nnodes > 1; streams its console lines and returns the manifest
  python -m eagle3lib.stages.train --profile P --run-dir R [--set train.key=value ...]     (one rank; torchrun runs this)

The loop itself, its outputs and its resume rules: eagle3lib/training/loop.py; the launching:
eagle3lib/training/launch.py.
"""

from __future__ import annotations

import sys

from eagle3lib.config.stages import open_rank_stage
from eagle3lib.trackers.base import TrackerError
from eagle3lib.training.launch import launch
from eagle3lib.training.loop import TrainingError, TrainingInterrupted, train
from eagle3lib.training.metrics import MetricsError

run = launch  # what the notebook calls


def main(argv: list[str] | None = None) -> int:
    """One training process (what torchrun starts)."""
    ctx = open_rank_stage("train", argv, "Train the EAGLE-3 drafter")
    try:
        train(ctx)
    except TrainingInterrupted as e:
        print(f"[train] {e}", flush=True)
        return 0
    except (TrainingError, TrackerError, MetricsError) as e:
        print(f"[train] error: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
