# .venv/bin/python -m pytest -q tests/test_train_model.py
"""The drafter, the TTT attention/alignment and the loss, on small random models (no verifier needed, seconds)."""

from __future__ import annotations

import math

import pytest
import torch

from eagle3lib.data.packing import MicroBatch
from eagle3lib.model.drafter import DrafterConfig, DrafterKVCache, Eagle3Drafter
from eagle3lib.model.ttt import (
    TTTModel,
    counted_per_step,
    counted_positions,
    run_ttt,
    step_token_ids,
    summarize,
    used_rows,
)
from eagle3lib.model.ttt_attention import ttt_mask

H, V, VD = 32, 50, 20


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


def make_drafter(seed: int = 0, **kw) -> Eagle3Drafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig(hidden_size=H, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        vocab_size=V, draft_vocab_size=VD, ttt_steps=3, **kw)
    d = Eagle3Drafter(cfg)
    d.reset_parameters(std=0.2)  # large enough that attention patterns matter
    d.set_vocab(torch.arange(0, 2 * VD, 2))
    d.embed_tokens.normal_()
    return d


def packed_batch(lengths_per_row: list[list[int]], S: int, seed: int = 0) -> MicroBatch:
    g = torch.Generator().manual_seed(seed)
    B = len(lengths_per_row)
    doc = torch.full((B, S), -1)
    pos = torch.zeros(B, S, dtype=torch.long)
    for b, lens in enumerate(lengths_per_row):
        off = 0
        for d, n in enumerate(lens):
            doc[b, off : off + n] = d
            pos[b, off : off + n] = torch.arange(n)
            off += n
    real = doc >= 0
    return MicroBatch(torch.randn(B, S, 3, H, generator=g), torch.randn(B, S, H, generator=g),
                      torch.randint(0, V, (B, S), generator=g) * real, (torch.rand(B, S, generator=g) > 0.25) & real,
                      pos, doc, int(real.sum()), sum(len(x) for x in lengths_per_row))


# ------------------------------------------------------------------------------------------------------ the mask


def brute_force_mask(doc: torch.Tensor, step: int) -> torch.Tensor:
    B, S = doc.shape
    m = torch.zeros(B, S, (step + 1) * S, dtype=torch.bool)
    for b in range(B):
        for q in range(S):
            for j in range(step + 1):
                for s in range(S):
                    if j == 0:
                        ok = s == q or (doc[b, q] >= 0 and doc[b, s] == doc[b, q] and s <= q)
                    else:
                        ok = s == q  # the query's own key written at step j
                    m[b, q, j * S + s] = ok
    return m


@pytest.mark.parametrize("step", [0, 1, 3])
def test_ttt_mask_matches_brute_force(step):
    doc = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, -1, -1], [0, 0, 0, 0, 0, 0, 0, 1, 1, 1]])
    assert torch.equal(ttt_mask(doc, step), brute_force_mask(doc, step))


def test_step_alignment_helpers():
    ids = torch.tensor([[10, 11, 12, 13, 20, 21, 22]])
    doc = torch.tensor([[0, 0, 0, 0, 1, 1, 1]])
    lm = torch.tensor([[0, 1, 1, 1, 0, 1, 1]], dtype=torch.bool)
    # step 0 at t takes token t+1 of the same sample; step 1 takes t+2
    assert step_token_ids(ids, doc, 0).tolist() == [[11, 12, 13, 0, 21, 22, 0]]
    assert step_token_ids(ids, doc, 1).tolist() == [[12, 13, 0, 0, 22, 0, 0]]
    # step k at t predicts token t+2+k: counted iff it exists in the same sample and is loss-masked
    assert counted_positions(lm, doc, 0).tolist() == [[True, True, False, False, True, False, False]]
    assert counted_positions(lm, doc, 1).tolist() == [[True, False, False, False, False, False, False]]


# ------------------------------------------- TTT equals vLLM-style incremental drafting (alignment + attention)


def reference_drafts(d: Eagle3Drafter, aux, ids, K: int) -> dict[tuple[int, int], torch.Tensor]:
    """What vLLM computes for one sample: after position t, a KV cache holding step-0 entries of positions 0..t, then
    K-1 drafted steps at positions t+1.. fed with the ground-truth next tokens. Returns {(t, k): draft logits}."""
    T = ids.shape[0]
    out = {}
    with torch.no_grad():
        g0 = d.combine(aux[None])  # [1, T, H]
        for t in range(T - 1):
            cache = DrafterKVCache(d.config.num_layers)
            # context step 0 for positions 0..t: hidden fc(a_s), token x_{s+1}, position s
            logits, feed = d.step(g0[:, : t + 1], ids[None, 1 : t + 2], torch.arange(t + 1)[None], cache)
            out[(t, 0)] = logits[0, t]
            h = feed[:, t : t + 1]
            for k in range(1, K):
                if t + 1 + k > T - 1:
                    break
                logits, h = d.step(h, ids[None, t + 1 + k : t + 2 + k], torch.tensor([[t + k]]), cache)
                out[(t, k)] = logits[0, 0]
    return out


MLA = {"drafter_layer": "mla", "q_lora_rank": 16, "kv_lora_rank": 24, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
       "v_head_dim": 12}


@pytest.mark.parametrize("mode", ["flash", "doc", "doc-sdpa", "dense", "sdpa"])
@pytest.mark.parametrize("flags", [{}, {"norm_output": True, "norm_before_residual": True, "num_layers": 2}, MLA])
def test_packed_ttt_equals_incremental_decoding(mode, flags):
    d = make_drafter(**flags).eval()
    K = 3
    mb = packed_batch([[7, 9, 5], [12]], S=23)
    B, S = mb.ids.shape
    # every position whose step-k input exists
    geo = [(mb.doc >= 0) & (step_token_ids(torch.ones_like(mb.ids), mb.doc, k) > 0) for k in range(K)]
    used = used_rows(geo)
    got = {}
    with torch.no_grad():
        for k, sel, out in run_ttt(d, mb.aux, mb.ids, mb.pos, mb.doc, used, mode):
            b_idx, i_idx = sel.nonzero(as_tuple=True)
            logits = d.logits(out)
            for n in range(len(b_idx)):
                got[(int(b_idx[n]), int(i_idx[n]), k)] = logits[n]
    checked = 0
    for b in range(B):
        for doc_id in range(int(mb.doc[b].max()) + 1):
            where = (mb.doc[b] == doc_id).nonzero().flatten()
            s0 = int(where[0])
            ref = reference_drafts(d, mb.aux[b, where], mb.ids[b, where], K)
            for (t, k), lg in ref.items():
                torch.testing.assert_close(got[(b, s0 + t, k)], lg, atol=2e-5, rtol=1e-4)
                checked += 1
    assert checked > 60


def test_row_subsetting_changes_nothing():
    """Steps >= 1 run only on the rows whose outputs are used; the outputs of those rows are unchanged."""
    d = make_drafter().eval()
    mb = packed_batch([[10, 8], [6, 6, 5]], S=18, seed=3)
    K = 3
    counted = [counted_positions(mb.loss_mask, mb.doc, k) for k in range(K)]
    geo = [(mb.doc >= 0) & (step_token_ids(torch.ones_like(mb.ids), mb.doc, k) > 0) for k in range(K)]
    with torch.no_grad():
        full = {k: (sel, out) for k, sel, out in run_ttt(d, mb.aux, mb.ids, mb.pos, mb.doc, used_rows(geo))}
        sub = {k: (sel, out) for k, sel, out in run_ttt(d, mb.aux, mb.ids, mb.pos, mb.doc, used_rows(counted))}
    for k, (sel, out) in sub.items():
        fsel, fout = full[k]
        dense = torch.zeros(*fsel.shape, H)
        dense[fsel] = fout
        torch.testing.assert_close(out, dense[sel], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------- the loss


def test_loss_and_metrics_by_hand():
    """Loss, accuracies and tau recomputed with plain Python from the drafter's logits and the verifier's targets."""
    d = make_drafter(seed=1).eval()
    torch.manual_seed(5)
    W = torch.randn(V, H)
    norm_w = torch.rand(H) + 0.5
    K, decay = 3, 0.8
    m = TTTModel(d, norm_w, W, 1e-6, K, decay, out_of_vocab="mask").eval()
    mb = packed_batch([[9, 7], [14]], S=16, seed=7)
    den = torch.tensor(counted_per_step(mb.loss_mask, mb.doc, K), dtype=torch.float32)
    with torch.no_grad():
        loss, stats = m(mb, den)
        # hand computation
        geo = [(mb.doc >= 0) & (step_token_ids(torch.ones_like(mb.ids), mb.doc, k) > 0) for k in range(K)]
        outs = {}
        for k, sel, out in run_ttt(d, mb.aux, mb.ids, mb.pos, mb.doc, used_rows(geo)):
            b_idx, i_idx = sel.nonzero(as_tuple=True)
            lg = d.logits(out)
            for n in range(len(b_idx)):
                outs[(int(b_idx[n]), int(i_idx[n]), k)] = lg[n].tolist()
    draft_ids = d.draft_ids.tolist()

    def verifier_logits(b, i):
        x = mb.final[b, i].double()
        x = x / math.sqrt(float((x * x).mean()) + 1e-6) * norm_w.double()
        return (W.double() @ x).tolist()

    total = 0.0
    n_k, kl_k, full_k, prev_k = [0] * K, [0.0] * K, [0] * K, [0] * K
    B, S = mb.ids.shape
    for b in range(B):
        for t in range(S):
            prefix = True
            for k in range(K):
                j = t + 1 + k  # the verifier position whose distribution step k learns
                if not (j + 1 < S and mb.doc[b, t] >= 0 and mb.doc[b, j + 1] == mb.doc[b, t]):
                    break
                full_logits = verifier_logits(b, j)
                v_arg = max(range(V), key=lambda v: full_logits[v])
                tl = [full_logits[v] for v in draft_ids]
                zt = max(tl)
                p = [math.exp(x - zt) for x in tl]
                p = [x / sum(p) for x in p]
                q_logits = outs[(b, t, k)]
                zq = max(q_logits)
                lse = zq + math.log(sum(math.exp(x - zq) for x in q_logits))
                kl = sum(pv * (math.log(pv) - (ql - lse)) for pv, ql in zip(p, q_logits, strict=True) if pv > 0)
                d_arg = draft_ids[max(range(VD), key=lambda v: q_logits[v])]
                correct = d_arg == v_arg and v_arg in draft_ids
                if bool(mb.loss_mask[b, j + 1]):
                    n_k[k] += 1
                    prev_k[k] += prefix
                    full_k[k] += prefix and correct
                    if v_arg in draft_ids:  # out_of_vocab="mask": out-of-vocab positions add nothing to the loss
                        kl_k[k] += kl
                prefix = prefix and correct
    for k in range(K):
        total += decay**k * kl_k[k] / n_k[k]
    assert abs(float(loss) - total) < 1e-4 * max(1.0, total)
    assert stats[0].tolist() == n_k
    assert stats[2].tolist() == full_k and stats[3].tolist() == prev_k
    s = summarize(stats, decay)
    assert abs(s["loss"] - total) < 1e-4 * max(1.0, total)
    assert abs(s["tau_est"] - (1 + sum(f / n for f, n in zip(full_k, n_k, strict=True)))) < 1e-12


def test_overfit_one_batch():
    """The full training module drives the loss of one batch near zero and the accuracies to their ceiling."""
    torch.manual_seed(0)
    d = make_drafter(seed=2)
    W = torch.randn(V, H) * 3  # peaked targets: no near-ties in the verifier's argmax
    W[1::2] = 0  # logit 0 outside the draft vocab (even ids < 2 VD): the verifier argmax lands inside it almost surely,
    W[2 * VD :] = 0  # so accuracy can reach 1
    m = TTTModel(d, torch.ones(H), W, 1e-6, 3, 0.8)
    mb = packed_batch([[20, 12], [30]], S=32, seed=11)
    den = torch.tensor(counted_per_step(mb.loss_mask, mb.doc, 3), dtype=torch.float32)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=5e-3)
    first = None
    for i in range(250):
        if i == 200:
            for g in opt.param_groups:
                g["lr"] = 5e-4
        loss, _ = m(mb, den)
        first = first if first is not None else float(loss.detach())
        loss.backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        loss, stats = m(mb, den)
    s = summarize(stats, 0.8)
    assert float(loss) < 0.01 * first
    assert s["full_acc_0"] >= 0.95 and s["tau_est"] > 3.0  # random guessing: ~1.05


def test_kv_cache_truncate_and_draft_to_target():
    d = make_drafter().eval()
    cache = DrafterKVCache(1)
    aux = torch.randn(1, 6, 3, H)
    ids = torch.randint(0, V, (1, 6))
    logits, _ = d.step(d.combine(aux), ids, torch.arange(6)[None], cache)
    assert len(cache) == 6
    cache.truncate(4)
    again, _ = d.step(d.combine(aux[:, 4:]), ids[:, 4:], torch.arange(4, 6)[None], cache)
    torch.testing.assert_close(again[0], logits[0, 4:], atol=1e-5, rtol=1e-5)
    assert d.draft_to_target(torch.tensor([0, 3])).tolist() == [0, 6]


@pytest.mark.parametrize("kind", ["kl", "ce"])
def test_torch_loss_path_matches_the_kernels_reference(kind):
    """The train stage's CPU loss (the reference with its hand-written backward) = the autograd reference: value,
    argmax, gradients."""
    from eagle3lib.kernels.draft_loss import draft_kl_loss_reference

    torch.manual_seed(0)
    h = torch.randn(37, H, requires_grad=True)
    W = torch.randn(VD, H, requires_grad=True)
    t = torch.randn(37, VD) * 3
    w = (torch.rand(37) > 0.3).float()
    fast = draft_kl_loss_reference(h, W, t, w, kind=kind, reduction="sum", manual_backward=True)
    (fast.loss * 1.7).backward()
    gh, gW = h.grad.clone(), W.grad.clone()
    h.grad = W.grad = None
    ref = draft_kl_loss_reference(h, W, t, w, kind=kind, reduction="sum")
    (ref.loss * 1.7).backward()
    torch.testing.assert_close(fast.loss, ref.loss, rtol=1e-5, atol=1e-5)
    assert torch.equal(fast.argmax, ref.argmax)
    torch.testing.assert_close(gh, h.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(gW, W.grad, rtol=1e-4, atol=1e-5)


def test_doc_layout_falls_back_to_dense_when_cheaper():
    from eagle3lib.model.ttt_attention import DocAttention, TTTAttention, make_attention

    many_short = torch.tensor([[0] * 4 + [1] * 4 + [2] * 4 + [3] * 4])
    one_long = torch.tensor([[0] * 13 + [1] + [2] + [3]])
    assert isinstance(make_attention(many_short, 1, "doc"), DocAttention)  # 4 x 4^2 < 16^2
    assert isinstance(make_attention(one_long, 1, "doc"), TTTAttention)  # 4 x 13^2 > 16^2


def test_draft_vocab_and_mappings():
    from eagle3lib.model.draft_vocab import build_draft_vocab

    counts = torch.tensor([5, 0, 9, 9, 1, 7, 0, 2])
    v = build_draft_vocab(counts, 4)
    assert v.draft_ids.tolist() == [0, 2, 3, 5]  # the 4 most frequent, ascending (ties by lower id)
    assert v.d2t.tolist() == [0, 1, 1, 2] and v.t2d.tolist() == [1, 0, 1, 1, 0, 1, 0, 0]
    assert (torch.arange(4) + v.d2t).tolist() == v.draft_ids.tolist()  # what vLLM computes
    assert abs(v.coverage - 30 / 33) < 1e-12


def test_packing_plan_is_balanced_and_deterministic():
    from types import SimpleNamespace

    from eagle3lib.data.packing import deal, make_plan, pack_rows, row_tokens

    g = torch.Generator().manual_seed(0)
    lengths = (torch.randint(20, 300, (400,), generator=g)).tolist() + [5000]  # one sample longer than a row
    rows = pack_rows(list(range(401)), lengths, 1024, True)
    assert sorted(i for r in rows for i in r) == list(range(401))  # every sample exactly once
    assert all(row_tokens(r, lengths, 1024) <= 1024 for r in rows)
    assert sum(lengths[:400]) / (1024 * (len(rows) - 1)) > 0.95  # first-fit-decreasing packs tightly
    per_rank = deal(rows[:8], lengths, 1024, world=2, micro_batch_rows=2)
    loads = [sum(row_tokens(r, lengths, 1024) for mb in p for r in mb) for p in per_rank]
    assert [len(p) for p in per_rank] == [2, 2] and abs(loads[0] - loads[1]) < 300
    cfg = SimpleNamespace(epochs=2.5, packed_row_tokens=1024, packing=True, seed=3, batch_rows=4)
    a, b = make_plan(list(range(401)), lengths, cfg), make_plan(list(range(401)), lengths, cfg)
    assert a.steps == b.steps and len(a.steps) == 3 and len(a.steps[2]) < len(a.steps[0])
    assert a.steps[0] != a.steps[1]  # a new order every epoch
    assert a.epoch_float(len(a.steps[0]) - 1) == 1.0


def test_plan_does_not_depend_on_the_store_order():
    """A resumed generate run finishes its prompts in another order, so the store's order differs; the split and the
    steps, by sample id, must not."""
    from types import SimpleNamespace

    from eagle3lib.data.packing import make_plan, split_samples

    g = torch.Generator().manual_seed(1)
    ids = [f"p{i:04d}" for i in range(300)]
    lengths = torch.randint(20, 300, (300,), generator=g).tolist()
    cfg = SimpleNamespace(epochs=2, packed_row_tokens=1024, packing=True, seed=0, batch_rows=2)

    def steps_by_id(order: list[int]) -> list:
        sid, ln = [ids[i] for i in order], [lengths[i] for i in order]
        split = split_samples(len(order), 0.05, 200, cfg.seed, sid)
        plan = make_plan(split.train, ln, cfg)
        return [sid[i] for i in split.val], [[[sid[i] for i in row] for row in st] for ep in plan.steps for st in ep]

    shuffled = torch.randperm(300, generator=g).tolist()
    assert steps_by_id(list(range(300))) == steps_by_id(shuffled)


def test_micro_batch_without_a_counted_position():
    """A row whose samples have no assistant token inside it (a long prompt cut at packed_row_tokens) contributes no
    loss and no gradient, instead of failing the step."""
    m = TTTModel(make_drafter(), torch.ones(H), torch.randn(V, H), 1e-6, 3, 0.8)
    mb = packed_batch([[20, 12]], S=32)
    mb.loss_mask[:] = False
    loss, stats = m(mb, torch.ones(3))
    loss.backward()
    assert float(loss) == 0.0 and float(stats.sum()) == 0.0


def test_draft_target_logits_train_on_the_draft_rows_and_validate_on_all():
    """train.target_logits=draft: in training the loss is the full-vocabulary one with out_of_vocab="keep" (the same
    draft-vocabulary targets, nothing masked) and no position counts as outside; in eval mode it is the full path."""
    W = torch.randn(V, H, generator=torch.Generator().manual_seed(3)) * 3  # many argmaxes outside the even-id vocab
    mb = packed_batch([[9, 7], [14]], S=16, seed=7)
    den = torch.tensor(counted_per_step(mb.loss_mask, mb.doc, 3), dtype=torch.float32)

    def run(target_logits: str, out_of_vocab: str, train: bool):
        m = TTTModel(make_drafter(seed=1), torch.ones(H), W, 1e-6, 3, 0.8, out_of_vocab=out_of_vocab,
                     target_logits=target_logits).train(train)
        with torch.no_grad():
            return m(mb, den)

    loss_d, st_d = run("draft", "mask", True)
    loss_k, st_k = run("full", "keep", True)
    assert float(st_k[4].sum()) > 0 and float(st_d[4].sum()) == 0  # outside positions exist; draft cannot see them
    torch.testing.assert_close(loss_d, loss_k, rtol=1e-5, atol=1e-6)
    loss_e, st_e = run("draft", "mask", False)  # validation: exactly the full path
    loss_f, st_f = run("full", "mask", False)
    torch.testing.assert_close(loss_e, loss_f, rtol=0, atol=0)
    torch.testing.assert_close(st_e, st_f, rtol=0, atol=0)
