# .venv/bin/python tests/untrained_drafter.py TRAINED_CKPT OUT   (a step of tests/pipeline_runs.py's real_run)
"""The drafter a run starts from: the trained checkpoint's shape and draft vocabulary, its fc and decoder layer at
their random initialisation, the lm_head warm-started from the verifier's rows, as the trainer builds it before its
first step. Served beside the trained one, it is the floor a few training steps must clear."""

from __future__ import annotations

import sys

import torch

from eagle3lib.model.checkpoint import load_drafter, save_drafter
from eagle3lib.model.drafter import Eagle3Drafter, init_from_verifier
from eagle3lib.model.verifier import load_verifier_head, resolve_model


def main(trained: str, out: str) -> None:
    model, cfg = load_drafter(trained)
    torch.manual_seed(0)
    fresh = Eagle3Drafter(cfg)
    fresh.set_vocab(model.d2t + torch.arange(cfg.draft_vocab_size))
    init_from_verifier(fresh, load_verifier_head(resolve_model(cfg.verifier)))
    save_drafter(fresh.state_dict(), cfg, out)


if __name__ == "__main__":
    main(*sys.argv[1:3])
