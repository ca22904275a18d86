"""TTT attention whose memory grows linearly with the sample length ("flash"; `auto` uses it beyond short samples).

FlashAttention's algorithm (tiles, log-sum-exp, recompute in the backward) written in plain torch for the TTT masks,
directly on the packed rows [B, S]: no [S, S] or [L, L] scores, probabilities or masks are kept for the backward,
only q, k, v, the TTT diagonals, the output and one log-sum-exp per query. Each group of query blocks' scores against
its key windows are built, used and freed, once in the forward and once in the backward, so the transient memory is
one group's worth (`BLOCK_ELEMENTS`) whatever the length.

Math, one query i at TTT step k (c = 1/sqrt(head dim); start(i) = the first position of i's sample):
    keys   step-0 keys s in [start(i), i] (block-causal; padding sees only itself) + i's own keys d_1..d_k of steps
           1..k (the diagonals; eagle3lib/model/ttt_attention.ttt_mask is the same mask written out densely)
    a_is = c q_i.k_s,  e_ij = c q_i.d_j,  lse_i = log(sum_s exp a_is + sum_j exp e_ij)
    o_i  = sum_s P_is v_s + sum_j p_ij w_j,     P_is = exp(a_is - lse_i), p_ij = exp(e_ij - lse_i)
Backward (FlashAttention's identities; Delta_i = dO_i . o_i, the softmax's Jacobian applied without forming it):
    dA_is = P_is (dO_i . v_s - Delta_i),  dE_ij = p_ij (dO_i . w_j - Delta_i)
    dq_i = c (sum_s dA_is k_s + sum_j dE_ij d_j),  dk_s = c sum_i dA_is q_i,  dv_s = sum_i P_is dO_i
    dd_j[i] = c dE_ij q_i,  dw_j[i] = p_ij dO_i
A query block [qs, qe) of one row needs keys only from start(qs) (the earliest sample start among its queries) to qe,
so the work is about sum over samples of L^2 / 2, as in the per-sample "doc" layout, without its [n_samples, longest]
padding; blocks are grouped under shared key windows (`make_plan`) so short samples run as a few batched matmuls.

GQA: the g = heads / kv_heads query heads of one KV head are stacked into one matmul ([nkv, G, g * C, D] @ windows
[nkv, G, D, W]), so keys are never expanded. MLA drafters pass q/k of width nope + rope and v of width v_head_dim: both work.
Exactness against incremental decoding and against the dense layouts: tests/test_ttt_flash.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

BLOCK_ELEMENTS = 1 << 23  # scores per query block (heads x block x span): 32 MiB in fp32; a few such tensors are alive
# at once in the backward. Larger is faster on short rows (fewer Python steps), never more memory per token.
MIN_BLOCK, MAX_BLOCK = 16, 256  # query-block bounds: tiny blocks waste time in Python; blocks much longer than the
# samples (or than 256 on long ones) waste work above the causal diagonal (measured: benchmarks/long_context.py)


def sample_starts(doc: torch.Tensor) -> torch.Tensor:
    """long [B, S]: first position of each token's sample (padding: itself). Non-decreasing along each row."""
    B, S = doc.shape
    pos = torch.arange(S, device=doc.device).expand(B, S)
    new = torch.ones_like(doc, dtype=torch.bool)
    new[:, 1:] = (doc[:, 1:] != doc[:, :-1]) | (doc[:, 1:] < 0)
    return torch.where(new, pos, torch.zeros_like(pos)).cummax(dim=1).values


def block_size(heads: int, span: int, block_elements: int = BLOCK_ELEMENTS) -> int:
    """Query-block length (a power of two): heads x block x span scores stay near `block_elements`, and a block is
    no longer than the longest sample (`span`), rounded down."""
    c = max(1, min(block_elements // max(1, heads * span), span))
    c = 1 << (c.bit_length() - 1)
    return max(MIN_BLOCK, min(MAX_BLOCK, c))


@dataclass(frozen=True)
class Plan:
    """How one call is tiled: query blocks of `block` tokens, in groups (row, first block, end block, window) whose
    blocks each attend to the `window` keys ending at the block's end (a multiple of `block`, at least the block's own
    key span: its earliest query's sample start to its end). Short samples: many blocks share one small window and run
    as one batched matmul; a long sample: windows grow along it and groups hold fewer blocks."""

    doc: torch.Tensor  # [B, S] sample ids (-1 padding)
    block: int
    groups: list[tuple[int, int, int, int]]
    left: int  # the widest window minus one block: left padding of the key-gradient accumulators


def make_plan(doc: torch.Tensor, heads: int, block_elements: int = BLOCK_ELEMENTS, block: int | None = None) -> Plan:
    B, S = doc.shape
    starts = sample_starts(doc)
    span = int((torch.arange(S, device=doc.device) - starts).max()) + 1 if doc.numel() else 1
    C = block or block_size(heads, span, block_elements)
    nblk = -(-S // C)
    lo = starts[:, ::C].tolist()  # each block's earliest key; one host sync per call
    groups, left = [], 0
    for b in range(B):
        needs = [-(-((n + 1) * C - lo[b][n]) // C) * C for n in range(nblk)]  # each block's key span, in blocks
        # short samples: one window for the whole row (few large matmuls); long ones: windows that grow along it
        waste = 1.5 if nblk * max(needs) <= 1.5 * sum(needs) else 1.25
        n0, W, needed = 0, C, 0
        for n, need in enumerate(needs):
            grown = max(W, need)
            # a block joins the group while the shared window wastes little work and the scores fit the budget
            if n > n0 and ((n + 1 - n0) * grown > waste * (needed + need)
                           or (n + 1 - n0) * C * grown * heads > block_elements):
                groups.append((b, n0, n, W))
                n0, grown, needed = n, need, 0
            W, needed = grown, needed + need
            left = max(left, W - C)
        groups.append((b, n0, nblk, W))
    return Plan(doc, C, groups, left)


def _rows(x: torch.Tensor, a: int, e: int, fill=0) -> torch.Tensor:
    """x[..., a:e, :] along dim -2 (dim -1 for 1-D), with `fill` where [a, e) leaves [0, len)."""
    dim = x.dim() - 2 if x.dim() > 1 else 0
    n = x.shape[dim]
    y = x.narrow(dim, max(a, 0), max(0, min(e, n) - max(a, 0)))
    if a >= 0 and e <= n:
        return y
    pad = (max(0, -a), max(0, e - n))
    return F.pad(y, ((0, 0) + pad) if dim else pad, value=fill)


class _Group:
    """Views of one group's tensors: queries [nkv, G, g*C, D], key/value windows [nkv, G, W, D], the mask."""

    def __init__(self, plan: Plan, b: int, n0: int, n1: int, W: int, nkv: int):
        C = plan.block
        self.C, self.W, self.G, self.nkv = C, W, n1 - n0, nkv
        self.qa, self.qe = n0 * C, n1 * C  # query positions (the last block may run past the row: zero padding)
        self.ka = self.qa + C - W  # first key of the first window
        dev = plan.doc.device
        qp = torch.arange(self.qa, self.qe, device=dev).view(self.G, C, 1)
        kp = torch.arange(self.ka, self.qe, device=dev).unfold(0, W, C)[:, None]  # [G, 1, W]
        dq = _rows(plan.doc[b], self.qa, self.qe, -2).view(self.G, C, 1)
        dk = _rows(plan.doc[b], self.ka, self.qe, -2).unfold(0, W, C)[:, None]
        self.visible = ((kp <= qp) & (dk == dq) & (dq >= 0)) | (kp == qp)  # [G, C, W]

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """[h, S, D] -> [nkv, G, g * C, D]: the g query heads of one KV head stacked, per block."""
        h, D = x.shape[0], x.shape[-1]
        g = h // self.nkv
        y = _rows(x, self.qa, self.qe).reshape(self.nkv, g, self.G, self.C, D).transpose(1, 2)
        return y.reshape(self.nkv, self.G, g * self.C, D)

    def unqueries(self, y: torch.Tensor, S: int) -> torch.Tensor:
        """[nkv, G, g * C, D] -> [h, valid positions, D]."""
        nkv, G, gC, D = y.shape
        y = y.view(nkv, G, gC // self.C, self.C, D).transpose(1, 2).reshape(-1, G * self.C, D)
        return y[:, : min(self.qe, S) - self.qa]

    def windows(self, x: torch.Tensor) -> torch.Tensor:
        """[nkv, S, D] -> [nkv, G, W, D] (a view of one padded copy)."""
        return _rows(x, self.ka, self.qe).unfold(1, self.W, self.C).transpose(-1, -2)

    def diagonal(self, x: torch.Tensor) -> torch.Tensor:
        """[nkv, S, D] -> [nkv, G, 1, C, D]: each query's own key/value of a later TTT step."""
        return _rows(x, self.qa, self.qe).view(self.nkv, self.G, 1, self.C, x.shape[-1])

    def fold(self, acc: torch.Tensor, dw: torch.Tensor, left: int) -> None:
        """acc [nkv, left + S + C, D] += the window gradients dw [nkv, G, W, D] at their keys (windows overlap)."""
        C, W, G = self.C, self.W, self.G
        base = left + self.ka
        if G <= W // C:  # few wide windows: one contiguous add each
            for n in range(G):
                acc[:, base + n * C : base + n * C + W] += dw[:, n]
        else:  # many narrow ones: one add per window offset
            for j in range(W // C):
                acc[:, base + j * C : base + j * C + G * C] += dw[:, :, j * C : (j + 1) * C].reshape(dw.shape[0], -1,
                                                                                                      dw.shape[-1])


class _TTTFlash(torch.autograd.Function):
    """o = TTT attention(q, k0, v0, diagonals); see the module docstring for the math. Shapes: q [B, nh, S, Dq],
    k0 [B, nkv, S, Dq], v0 [B, nkv, S, Dv], each diagonal [B, nkv, S, Dq] (keys) / [B, nkv, S, Dv] (values)."""

    @staticmethod
    def forward(ctx: Any, plan: Plan, q, k0, v0, *diag):
        n = len(diag) // 2
        kd, vd = diag[:n], diag[n:]
        B, nh, S, Dq = q.shape
        nkv, Dv = k0.shape[1], v0.shape[3]
        scale = Dq**-0.5
        acc = torch.promote_types(q.dtype, torch.float32)  # softmax and sums: fp32 at least (fp64 in the tests)
        out = q.new_empty(B, nh, S, Dv)
        lse = torch.empty(B, nh, S, dtype=acc, device=q.device)
        for b, n0, n1, W in plan.groups:
            grp = _Group(plan, b, n0, n1, W, nkv)
            qg = grp.queries(q[b])
            p, pd, lse_g = _probs(grp, qg, grp.windows(k0[b]), [grp.diagonal(x[b]) for x in kd], scale, None, acc)
            o = torch.matmul(p.to(v0.dtype).flatten(2, 3), grp.windows(v0[b])).view(p.shape[:-1] + (Dv,))
            for j in range(n):
                o = o + pd[..., j, None].to(v0.dtype) * grp.diagonal(vd[j][b])
            a, e = grp.qa, min(grp.qe, S)
            out[b, :, a:e] = grp.unqueries(o.flatten(2, 3), S)
            lse[b, :, a:e] = grp.unqueries(lse_g.flatten(2, 3)[..., None], S)[..., 0]
        ctx.save_for_backward(q, k0, v0, out, lse, *diag)
        ctx.plan, ctx.n = plan, n
        return out

    @staticmethod
    def backward(ctx: Any, dout):
        q, k0, v0, out, lse, *diag = ctx.saved_tensors
        plan, n = ctx.plan, ctx.n
        kd, vd = diag[:n], diag[n:]
        B, nh, S, Dq = q.shape
        nkv, Dv = k0.shape[1], v0.shape[3]
        scale = Dq**-0.5
        acc = lse.dtype
        f = dict(dtype=acc, device=q.device)
        pad = plan.left + S + plan.block  # key gradients, padded for the windows that start before 0 or end after S
        dq = torch.zeros(q.shape, **f)
        dk0, dv0 = torch.zeros(B, nkv, pad, Dq, **f), torch.zeros(B, nkv, pad, Dv, **f)
        dkd = [torch.zeros(x.shape, **f) for x in kd]
        dvd = [torch.zeros(x.shape, **f) for x in vd]
        dout = dout.contiguous()
        for b, n0, n1, W in plan.groups:
            grp = _Group(plan, b, n0, n1, W, nkv)
            qg = grp.queries(q[b])
            kw, vw = grp.windows(k0[b]), grp.windows(v0[b])
            kdg = [grp.diagonal(x[b]) for x in kd]
            p, pd, _ = _probs(grp, qg, kw, kdg, scale, grp.queries(lse[b][..., None])[..., 0].view(
                nkv, grp.G, -1, grp.C), acc)
            dog = grp.queries(dout[b])  # [nkv, G, g*C, Dv]
            do5 = dog.view(p.shape[:-1] + (Dv,)).to(acc)
            delta = (do5 * grp.queries(out[b]).view(do5.shape).to(acc)).sum(-1)  # [nkv, G, g, C]
            dp = torch.matmul(dog, vw.transpose(-1, -2)).to(acc).view(p.shape)
            da = (p * (dp - delta[..., None])).flatten(2, 3)  # masked keys: P = 0 -> 0
            dqg = torch.matmul(da.to(k0.dtype), kw).to(acc).view(do5.shape[:-1] + (Dq,))
            grp.fold(dk0[b], torch.matmul(da.transpose(-1, -2).to(q.dtype), qg).to(acc) * scale, plan.left)
            grp.fold(dv0[b], torch.matmul(p.flatten(2, 3).transpose(-1, -2).to(dout.dtype), dog).to(acc), plan.left)
            q5 = qg.view(dqg.shape).to(acc)
            a, e = grp.qa, min(grp.qe, S)
            for j in range(n):
                de = pd[..., j] * ((do5 * grp.diagonal(vd[j][b]).to(acc)).sum(-1) - delta)  # [nkv, G, g, C]
                dqg = dqg + de[..., None] * kdg[j].to(acc)
                dkd[j][b, :, a:e] = grp.unqueries((de[..., None] * q5 * scale).sum(2, keepdim=True).flatten(2, 3), S)
                dvd[j][b, :, a:e] = grp.unqueries((pd[..., j, None] * do5).sum(2, keepdim=True).flatten(2, 3), S)
            dq[b, :, a:e] = grp.unqueries((dqg * scale).flatten(2, 3), S)
        L0 = plan.left
        grads = [dq.to(q.dtype), dk0[:, :, L0 : L0 + S].to(k0.dtype), dv0[:, :, L0 : L0 + S].to(v0.dtype)]
        grads += [x.to(y.dtype) for x, y in zip(dkd, kd, strict=True)] + [x.to(y.dtype) for x, y in zip(dvd, vd, strict=True)]
        return (None, *grads)


def _probs(grp: _Group, qg, kw, kdg, scale, lse, acc):
    """Probabilities of one group in dtype `acc`: (P [nkv, G, g, C, W], p [nkv, G, g, C, n] of the diagonals,
    lse [nkv, G, g, C]). Given `lse` (the backward) they are recomputed from it instead of normalised again."""
    nkv, G, gC, D = qg.shape
    shape = (nkv, G, gC // grp.C, grp.C)
    a = torch.matmul(qg, kw.transpose(-1, -2)).to(acc).view(shape + (grp.W,)) * scale
    a = a.masked_fill(~grp.visible[:, None], float("-inf"))
    q5 = qg.view(shape + (D,)).to(acc)
    e = torch.stack([(q5 * x.to(acc)).sum(-1) for x in kdg], dim=-1) * scale if kdg else a.new_empty(shape + (0,))
    if lse is not None:
        return torch.exp(a - lse[..., None]), torch.exp(e - lse[..., None]), lse
    m = torch.maximum(a.amax(-1), e.amax(-1)) if kdg else a.amax(-1)  # finite: every query sees itself
    p, pd = torch.exp(a - m[..., None]), torch.exp(e - m[..., None])
    z = p.sum(-1) + pd.sum(-1)
    return p.div_(z[..., None]), pd / z[..., None], m + torch.log(z)


def scatter_rows(x: torch.Tensor, b: torch.Tensor, i: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """[1, h, N, D] of the selected positions (b, i) -> [B, h, S, D] (zeros elsewhere), differentiably."""
    out = x.new_zeros(*shape, x.shape[1], x.shape[3]).index_put((b, i), x[0].transpose(0, 1))
    return out.transpose(1, 2)


class FlashTTTAttention:
    """The `attend` callback of one TTT forward over packed rows [B, S] (the drafter's layers call it; see
    eagle3lib/model/ttt_attention.py for the other layouts and the interface). Step 0 attends on every position; step
    k >= 1 gets the queries of the selected positions `rows` (flattened row-major), lays them out on the packed rows
    (zeros elsewhere: those outputs are never read), and keeps its keys as the diagonals of later steps."""

    def __init__(self, doc: torch.Tensor, num_layers: int, block_elements: int = BLOCK_ELEMENTS):
        self.doc = doc
        self.block_elements = block_elements
        self._plans: dict[int, Plan] = {}  # per head count (the same for every layer of a drafter)
        self.k0: list[torch.Tensor | None] = [None] * num_layers
        self.v0: list[torch.Tensor | None] = [None] * num_layers
        self.kd: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.vd: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]
        self.step = 0
        self._b = self._i = None

    def set_step(self, step: int, rows: torch.Tensor | None) -> None:
        self.step = step
        if step > 0:
            self._b, self._i = rows.nonzero(as_tuple=True)

    def _dense(self, x: torch.Tensor) -> torch.Tensor:
        return scatter_rows(x, self._b, self._i, self.doc.shape)

    def __call__(self, idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        nh = q.shape[1]
        if nh not in self._plans:
            self._plans[nh] = make_plan(self.doc, nh, self.block_elements)
        plan = self._plans[nh]
        if self.step == 0:
            self.k0[idx], self.v0[idx] = k, v
            return _TTTFlash.apply(plan, q, k, v)
        self.kd[idx].append(self._dense(k))
        self.vd[idx].append(self._dense(v))
        o = _TTTFlash.apply(plan, self._dense(q), self.k0[idx], self.v0[idx], *self.kd[idx], *self.vd[idx])
        return o[self._b, :, self._i].transpose(0, 1)[None]  # [1, nh, N, Dv]
