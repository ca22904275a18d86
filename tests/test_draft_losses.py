# .venv/bin/python -m pytest -q tests/test_draft_losses.py
"""The drafter's losses (eagle3lib/model/draft_losses.py) against direct torch formulas, values and gradients, over odd
shapes and chunk sizes, with a tolerance per dtype; through the training module: every loss trains one batch down,
the reported loss_k is the chosen loss, and the hidden-state term changes the gradient, not the report."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from eagle3lib.kernels import draft_kl_loss
from test_train_model import VD, H, V, make_drafter, packed_batch

from eagle3lib.model.draft_losses import draft_loss, hidden_state_loss
from eagle3lib.model.ttt import TTTModel, counted_per_step, summarize

LOSSES = ["kl", "reverse_kl", "jsd", "tv", "ce_argmax"]
TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def reference(z: torch.Tensor, t: torch.Tensor, loss: str) -> torch.Tensor:
    """Per-row losses written the way a paper writes them, through torch's own KL and cross-entropy where they exist."""
    log_q, log_p = F.log_softmax(z.double(), -1), F.log_softmax(t.double(), -1)
    p, q = log_p.exp(), log_q.exp()
    if loss == "kl":
        return F.kl_div(log_q, log_p, reduction="none", log_target=True).sum(-1)
    if loss == "reverse_kl":
        return F.kl_div(log_p, log_q, reduction="none", log_target=True).sum(-1)
    if loss == "jsd":
        m = (p + q) / 2
        return 0.5 * F.kl_div(m.log(), p, reduction="none").sum(-1) + 0.5 * F.kl_div(m.log(), q, reduction="none").sum(-1)
    if loss == "tv":
        return (p - q).abs().sum(-1) / 2
    return F.cross_entropy(z.double(), t.argmax(-1), reduction="none")


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize(("n", "hid", "vocab", "chunk"), [(7, 5, 11, 3), (1, 8, 3, 16), (33, 16, 97, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_values_and_gradients_match_the_reference(loss, n, hid, vocab, chunk, dtype):
    g = torch.Generator().manual_seed(n * 31 + vocab)
    h0, w0 = torch.randn(n, hid, generator=g), torch.randn(vocab, hid, generator=g) * 0.5
    t = torch.randn(n, vocab, generator=g) * 2
    rw = (torch.rand(n, generator=g) > 0.3).float()  # some rows not counted
    h, w = h0.to(dtype).clone().requires_grad_(), w0.to(dtype).clone().requires_grad_()
    got, am = draft_loss(h, w, t, rw, loss, chunk_rows=chunk)
    got.backward()
    hr = h0.to(dtype).double().requires_grad_()  # the same (rounded) inputs, in float64
    wr = w0.to(dtype).double().requires_grad_()
    want = (reference(hr @ wr.t(), t, loss) * rw.double()).sum()
    want.backward()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.double(), want.detach(), **tol)
    torch.testing.assert_close(h.grad.double(), hr.grad, **tol)
    torch.testing.assert_close(w.grad.double(), wr.grad, **tol)
    assert torch.equal(am, (h.detach().float() @ w.detach().float().t()).argmax(-1))


def test_forward_kl_equals_the_kernel_path():
    """The torch path's "kl" is the fused kernel's definition (kernels/draft_loss.py), so a run may switch."""
    g = torch.Generator().manual_seed(0)
    h, w, t = torch.randn(19, 8, generator=g), torch.randn(13, 8, generator=g), torch.randn(19, 13, generator=g)
    rw = torch.ones(19)
    ours, _ = draft_loss(h, w, t, rw, "kl", chunk_rows=4)
    kernel = draft_kl_loss(h, w, t, rw, kind="kl", reduction="sum", backend="torch").loss
    torch.testing.assert_close(ours, kernel.float(), atol=1e-5, rtol=1e-5)


def test_bounds_that_define_each_loss():
    """Identical distributions cost 0 under every loss; JSD is at most log 2 and TV at most 1, however far apart."""
    t = torch.randn(5, 9) * 3
    for loss in ("kl", "reverse_kl", "jsd", "tv"):
        zero, _ = draft_loss(t, torch.eye(9), t, torch.ones(5), loss)  # h W^T = t: the drafter is the verifier
        assert abs(float(zero)) < 1e-5, loss
    far = torch.full((5, 9), -50.0)
    far[:, 0] = 50.0
    near = torch.full((5, 9), -50.0)
    near[:, 1] = 50.0
    jsd, _ = draft_loss(far, torch.eye(9), near, torch.ones(5), "jsd")
    tv, _ = draft_loss(far, torch.eye(9), near, torch.ones(5), "tv")
    assert float(jsd) / 5 == pytest.approx(torch.log(torch.tensor(2.0)).item(), abs=1e-4)
    assert float(tv) / 5 == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize("loss", LOSSES)
def test_every_loss_trains_one_batch_and_is_the_reported_loss(loss, one_thread):  # tiny model: one thread is fastest
    torch.manual_seed(0)
    d = make_drafter(seed=2)
    W = torch.randn(V, H) * 3
    W[1::2] = 0
    W[2 * VD :] = 0
    m = TTTModel(d, torch.ones(H), W, 1e-6, 3, 0.8, loss=loss)
    mb = packed_batch([[20, 12], [30]], S=32, seed=11)
    den = torch.tensor(counted_per_step(mb.loss_mask, mb.doc, 3), dtype=torch.float32)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=5e-3)
    with torch.no_grad():
        _, stats0 = m(mb, den)
    for _ in range(60):
        loss_value, _ = m(mb, den)
        loss_value.backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        total, stats = m(mb, den)
    before, after = summarize(stats0, 0.8), summarize(stats, 0.8)
    assert after["loss"] < 0.5 * before["loss"] and after["full_acc_0"] > before["full_acc_0"], (before, after)
    assert float(total) == pytest.approx(after["loss"], rel=1e-4)  # the optimised loss is the one reported


def test_the_hidden_state_term_changes_the_gradient_not_the_report(one_thread):
    d = make_drafter(seed=3)
    W = torch.randn(V, H)
    mb = packed_batch([[12, 9]], S=24, seed=5)
    den = torch.tensor(counted_per_step(mb.loss_mask, mb.doc, 3), dtype=torch.float32)
    grads, reports = [], []
    for weight in (0.0, 1.0):
        m = TTTModel(d, torch.ones(H), W, 1e-6, 3, 0.8, hidden_weight=weight)
        loss, stats = m(mb, den)
        loss.backward()
        grads.append(d.fc.weight.grad.clone())
        reports.append(summarize(stats.detach(), 0.8)["loss"])
        d.zero_grad()
    assert reports[0] == pytest.approx(reports[1]) and not torch.allclose(grads[0], grads[1])
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    assert float(hidden_state_loss(x, y, torch.tensor([1.0, 0, 1, 1]))) == pytest.approx(
        float(((x - y) ** 2).mean(-1)[[0, 2, 3]].sum()), rel=1e-6)


def test_the_loss_table_is_what_the_config_accepts():
    from typing import get_args

    from eagle3lib.config.train import Loss
    from eagle3lib.model.draft_losses import LOSSES as TABLE

    assert list(get_args(Loss)) == list(TABLE) == LOSSES


def test_jsd_gradient_is_finite_where_both_distributions_underflow():
    """Far-apart logits make p and q both 0.0 in fp32 at most entries: log((p + q) / 2) would be -inf there and its
    gradient NaN; the log-sum-exp form keeps every gradient finite."""
    z = torch.zeros(2, 64)
    z[:, 0] = 200.0  # q puts all its mass on token 0 ...
    t = torch.zeros(2, 64)
    t[:, 1] = 200.0  # ... p all of its on token 1: every other entry underflows in both
    z.requires_grad_(True)
    from eagle3lib.model.draft_losses import row_losses

    row_losses(z, t, "jsd").sum().backward()
    assert torch.isfinite(z.grad).all()
