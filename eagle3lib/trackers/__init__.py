"""Experiment trackers: the train stage's metrics.jsonl records, also logged where teams already watch runs.

`train.report_to: [tensorboard, wandb, mlflow]` (each behind its pyproject extra). The JSONL file stays the record of
truth: a tracker gets the same records, rank 0 only, and a resumed run catches each tracker up from the file, so no
tracker ever holds a step twice. `base.py` has the shared rules, `run.py` the set of trackers of one training run,
one module per tracker with its writer and a reader of what that tracker wrote (tests and learning curves use it).
"""
