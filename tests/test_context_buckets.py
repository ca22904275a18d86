# .venv/bin/python -m pytest -q tests/test_context_buckets.py
"""Acceptance per context-length bucket (eagle3lib/data/context_buckets.py): labels, the context of each round of a
real speculative decode (checked against the tokens the decode actually committed), and the pooled per-bucket tau,
whose rounds and accepted drafts add up to the whole decode's. The vLLM side (prompts grouped per bucket, counters
per group) runs in the tiny pipeline (tests/test_pipeline.py) and the tiny-long one (tests/test_tiny_long.py)."""

from __future__ import annotations

from dataclasses import asdict

import pytest

from eagle3lib.data.context_buckets import bucket_key, bucket_labels, bucket_of, library_buckets, round_contexts


def test_labels_and_keys():
    assert bucket_labels([4096, 8192]) == ["<4K", "4K-8K", ">=8K"]
    assert bucket_labels([100]) == ["<100", ">=100"]
    assert [bucket_of(n, [4096, 8192]) for n in (0, 4095, 4096, 8191, 8192, 10**6)] == \
        ["<4K", "<4K", "4K-8K", "4K-8K", ">=8K", ">=8K"]
    assert [bucket_key(x) for x in bucket_labels([4096, 16384])] == ["ctx_lt4K", "ctx_4K_16K", "ctx_ge16K"]


def test_round_contexts():
    # prompt 10: the prefill emits token 11; a round accepting 2 emits 3
    assert round_contexts(10, [2, 0, 3]) == [11, 14, 15]
    assert round_contexts(10, []) == []


def test_rounds_add_up_and_contexts_are_the_committed_lengths():
    """A real decode (tiny verifier, an untrained drafter and an LM drafter at the verifier itself, so rounds accept
    a varying number): the per-round record reproduces accepted and accepted_per_pos, and each round's context is the
    number of tokens committed before it."""
    import torch

    from eagle3lib.model.speculative import LMDrafter, Verifier, speculative_decode, summarize_runs
    from eagle3lib.model.verifier import load_hf_model
    from eagle3lib.tiny.build import tiny_verifier_path

    torch.manual_seed(0)
    model = load_hf_model(str(tiny_verifier_path()), "float32")
    prompt = list(range(5, 45))
    res = speculative_decode(Verifier(model), LMDrafter(model), prompt, 24, 3, temperature=1.5,
                             generator=torch.Generator().manual_seed(1))
    assert len(res.accepted_per_round) == res.rounds and sum(res.accepted_per_round) == res.accepted
    assert res.accepted_per_pos == [sum(a > i for a in res.accepted_per_round) for i in range(3)]
    ctx = round_contexts(len(prompt), res.accepted_per_round)
    assert ctx[0] == len(prompt) + 1 and all(b - a >= 1 for a, b in zip(ctx, ctx[1:], strict=False))
    assert ctx[-1] < len(prompt) + 24 + 4  # the last round starts before max_new_tokens (a round emits <= K+1)

    rec = {"prompt_tokens": len(prompt), "greedy": asdict(res)}
    edge = ctx[len(ctx) // 2]
    b = library_buckets([rec, rec], "greedy", [edge], 3)
    assert set(b) == {f"<{edge}", f">={edge}"}
    assert sum(x["rounds"] for x in b.values()) == 2 * res.rounds
    assert sum(x["accepted"] for x in b.values()) == 2 * res.accepted
    whole = summarize_runs([res, res], 3)
    pooled = sum(x["tau"] * x["rounds"] for x in b.values()) / sum(x["rounds"] for x in b.values())
    assert pooled == pytest.approx(whole["tau"])


def test_old_records_without_rounds_give_no_buckets():
    """A library phase saved before accepted_per_round existed: no rounds to bucket, no error."""
    rec = {"prompt_tokens": 10, "greedy": {"tokens": [1], "seconds": 0.1, "rounds": 2, "accepted": 3}}
    assert library_buckets([rec], "greedy", [100], 3) == {}
