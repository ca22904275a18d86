"""Speculative decoding in the library, gpt-fast style: one sequence, an HF verifier with a KV cache, a pluggable drafter.

One round (after a prefill that produced the first new token):
    1. the drafter proposes K tokens d_1..d_K (chain drafting: each conditioned on the previous ones), with their
       proposal distributions q_1..q_K (or None: greedy proposals, q one-hot, as vLLM's EAGLE drafter by default);
    2. ONE verifier forward over [last committed token, d_1..d_K] with the KV cache gives p_1..p_{K+1}
       (p_i: the verifier's distribution for the token at the position of d_i; p_{K+1}: the "bonus" position);
    3. accept d_1.. left to right (greedy: d_i == argmax p_i; sampled: the rejection rule below); at the first
       rejection emit a correction token, if all K are accepted emit a bonus token from p_{K+1};
    4. crop the verifier's KV cache (HF DynamicCache) to the committed tokens: rejected drafts leave no trace.
Every round emits accepted + 1 tokens, so the acceptance length tau = 1 + accepted / rounds, in [1, K+1].

Accounting is vLLM's (v1 scheduler, spec-decode counters): each round drafts all K tokens even near max_tokens or
an EOS, and counts everything the verifier accepted; the output is then cut at max_new_tokens or after an EOS token.
The prefill round drafts nothing and is not a round. accepted_per_pos[i] counts rounds with more than i accepted,
like vllm:spec_decode_num_accepted_tokens_per_pos.

Drafters (the `Drafter` protocol): `EagleDrafter` (a trained EAGLE-3 drafter fed with the verifier's auxiliary hidden
states, captured by forward pre-hooks on the verifier's decoder layers, exactly as vLLM feeds it), `LMDrafter` (a
small causal LM, or the verifier itself: the oracle whose greedy proposals are always accepted) and `RandomDrafter`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from eagle3lib.model.verifier import LayerCapture, decoder_layers

# ---------------------------------------------------------------------------------------------------- the protocol


@dataclass
class DraftInput:
    """What the drafter sees at the start of a round.

    tokens: every committed token id (prompt + generated), [n]. The last one (the token the previous round emitted)
            has not been through the verifier yet.
    aux:    the verifier's auxiliary hidden states [m, len(aux_layer_ids), H] of positions aux_start..n-2, the
            committed positions it has computed since the previous round (None if the drafter asked for none).
    """

    tokens: torch.Tensor
    aux: torch.Tensor | None
    aux_start: int


@dataclass
class Proposal:
    tokens: torch.Tensor  # int64 [k], ids in the verifier's vocabulary
    probs: torch.Tensor | None = None  # [k, V] proposal distributions q over the verifier's vocabulary; None = one-hot


class Drafter(Protocol):
    aux_layer_ids: Sequence[int] | None  # verifier layers whose input hidden states the drafter needs (None: none)

    def reset(self) -> None:
        """Forget the previous sequence."""

    def propose(self, inp: DraftInput, k: int, temperature: float, generator: torch.Generator) -> Proposal:
        """k draft tokens continuing inp.tokens."""


# ---------------------------------------------------------------------------------------------------- the verifier


def crop_cache(cache: Any, length: int) -> None:
    """Keep the first `length` positions of an HF cache (transformers 5: crop(-n) removes n; crop(+n) is deprecated)."""
    extra = cache.get_seq_length() - length
    if extra > 0:
        cache.crop(-extra)


class Verifier:
    """An HF causal LM run incrementally with a DynamicCache; inside `capturing(ids)` it also returns the hidden
    states entering those decoder layers (layer id k = the input of decoder layer k = HF `output_hidden_states[k]`)."""

    def __init__(self, model: Any):
        self.model = model
        self.cache: Any = None
        cfg = getattr(model.config, "text_config", None) or model.config
        self.vocab_size = int(cfg.vocab_size)
        self.num_layers = int(cfg.num_hidden_layers)
        self.hidden_size = int(cfg.hidden_size)
        self._capture: LayerCapture | None = None

    @contextmanager
    def capturing(self, aux_layer_ids: Sequence[int] | None):
        """Forward pre-hooks that record the input hidden states of the given decoder layers while active."""
        ids = list(aux_layer_ids or [])
        capture = LayerCapture(decoder_layers(self.model), ids, final=False) if ids else None
        old, self._capture = self._capture, capture
        try:
            yield self
        finally:
            if capture is not None:
                capture.remove()
            self._capture = old

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache()

    @property
    def length(self) -> int:
        return 0 if self.cache is None else int(self.cache.get_seq_length())

    def crop(self, length: int) -> None:
        crop_cache(self.cache, length)

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Append ids [T] to the cache. Returns (fp32 logits [T or 1, V], aux hidden states [T, n_aux, H] or None)."""
        dev = self.model.device
        out = self.model(input_ids=ids.to(dev)[None], past_key_values=self.cache, use_cache=True,
                         logits_to_keep=1 if last_only else 0)
        self.cache = out.past_key_values
        logits = out.logits[0].float()
        aux = self._capture.aux()[0] if self._capture is not None else None
        return logits, aux


# ------------------------------------------------------------------------------------------------------- drafters


class EagleDrafter:
    """A trained EAGLE-3 drafter (eagle3lib.model.drafter.Eagle3Drafter), driven like vLLM's EAGLE-3 proposer.

    Its KV cache holds one "step-0" entry per committed position t: hidden = fc(aux[t]), input token = token t+1,
    position t. A round first adds the step-0 entries of the positions the verifier has computed since the previous
    round; the output at the last one gives draft 1. Drafts 2..K feed the drafter's own hidden state back with the
    previous draft token at position t+j. Those K-1 entries are dropped at the start of the next round (vLLM
    overwrites them with the step-0 entries of the same positions once they are verified).
    """

    def __init__(self, drafter: Any, sample: bool = False):
        from eagle3lib.model.drafter import DrafterKVCache

        self.drafter = drafter.eval()
        self.aux_layer_ids = list(drafter.config.aux_layer_ids)
        self.sample = sample  # False: argmax proposals (vLLM's default draft_sample_method="greedy")
        self._cache_cls = DrafterKVCache
        self.reset()

    def reset(self) -> None:
        self.cache = self._cache_cls(self.drafter.config.num_layers)
        self.n_ctx = 0  # step-0 entries in the cache (committed positions)

    @torch.inference_mode()
    def propose(self, inp: DraftInput, k: int, temperature: float, generator: torch.Generator) -> Proposal:
        d = self.drafter
        dev = d.fc.weight.device
        if inp.aux is None or inp.aux_start != self.n_ctx:
            raise RuntimeError(f"EagleDrafter: expected hidden states from position {self.n_ctx}, got {inp.aux_start}")
        self.cache.truncate(self.n_ctx)  # drop the previous round's drafted entries
        m = inp.aux.shape[0]
        pos = torch.arange(self.n_ctx, self.n_ctx + m, device=dev)
        nxt = inp.tokens[self.n_ctx + 1 : self.n_ctx + m + 1].to(dev)  # step 0 at position t takes token t+1
        hidden = d.combine(inp.aux.to(dev))
        if d.config.parallel_drafting:
            return self._propose_parallel(hidden, nxt, pos, k, temperature, generator)
        logits, feed = d.step(hidden[None], nxt[None], pos[None], self.cache)
        self.n_ctx += m
        logits, h = logits[0, -1:], feed[:, -1:]
        toks, probs = [], []
        for j in range(k):
            draft_id, q = _pick(logits[0], temperature if self.sample else 0.0, generator)
            tok = d.draft_to_target(draft_id.view(1))  # draft-vocabulary id -> verifier id (what is embedded and fed)
            toks.append(tok.view(()))
            if q is not None:
                probs.append(q)
            if j + 1 < k:
                logits, h = d.step(h, tok.view(1, 1), torch.tensor([[self.n_ctx - 1 + j + 1]], device=dev), self.cache)
                logits = logits[0]
        return self._proposal(toks, probs, k)

    def _propose_parallel(self, hidden, nxt, pos, k: int, temperature: float, generator) -> Proposal:
        """P-EAGLE: the new context positions and k-1 masked slots after them in ONE drafter forward (vLLM's
        parallel_drafting round); draft j is read from the output at the last context position + j. The masked slots'
        cache entries lie beyond n_ctx and are dropped by the next round's truncate."""
        d = self.drafter
        m = hidden.shape[0]
        mh, mids = d.mask_inputs(k - 1)
        h = torch.cat([hidden, mh.to(hidden.dtype)])
        ids = torch.cat([nxt, mids])
        p = torch.arange(int(pos[0]), int(pos[0]) + m + k - 1, device=pos.device)
        logits, _ = d.step(h[None], ids[None], p[None], self.cache)
        self.n_ctx += m
        toks, probs = [], []
        for row in logits[0, m - 1 :]:
            draft_id, q = _pick(row, temperature if self.sample else 0.0, generator)
            toks.append(d.draft_to_target(draft_id.view(1)).view(()))
            if q is not None:
                probs.append(q)
        return self._proposal(toks, probs, k)

    def _proposal(self, toks: list[torch.Tensor], probs: list[torch.Tensor], k: int) -> Proposal:
        d = self.drafter
        tokens = torch.stack(toks).cpu()
        if not probs:
            return Proposal(tokens)
        # q over the draft vocabulary -> the verifier's vocabulary (zero outside the draft vocabulary)
        qd = torch.stack(probs).cpu()
        q = torch.zeros(k, d.config.vocab_size)
        q[:, d.draft_ids.cpu()] = qd
        return Proposal(tokens, q)


class LMDrafter:
    """A causal LM as drafter, with its own KV cache. With the verifier itself and greedy proposals it is the oracle:
    its proposals are the verifier's greedy tokens, so greedy speculative decoding accepts all of them (tau = K+1)."""

    aux_layer_ids = None

    def __init__(self, model: Any, sample: bool = False):
        self.model = model.eval()
        self.sample = sample
        self.reset()

    def reset(self) -> None:
        from transformers import DynamicCache

        self.cache = DynamicCache()
        self.n_ctx = 0  # committed tokens in the cache

    @torch.inference_mode()
    def propose(self, inp: DraftInput, k: int, temperature: float, generator: torch.Generator) -> Proposal:
        crop_cache(self.cache, self.n_ctx)
        n = inp.tokens.numel()
        ids = inp.tokens[self.n_ctx : n]
        self.n_ctx = n
        toks, probs = [], []
        for j in range(k):
            out = self.model(input_ids=ids.to(self.model.device)[None], past_key_values=self.cache, use_cache=True,
                             logits_to_keep=1)
            self.cache = out.past_key_values
            tok, q = _pick(out.logits[0, -1].float(), temperature if self.sample else 0.0, generator)
            toks.append(tok.cpu())
            if q is not None:
                probs.append(q.cpu())
            ids = tok.view(1)
            if j + 1 == k:
                break
        return Proposal(torch.stack(toks), torch.stack(probs) if probs else None)


class RandomDrafter:
    """Context-free proposals from a fixed distribution q over the vocabulary (uniform by default): with a real
    verifier almost nothing is accepted, tau close to 1. `greedy=True` always proposes the mode of q (q one-hot)."""

    aux_layer_ids = None

    def __init__(self, vocab_size: int, probs: torch.Tensor | None = None, greedy: bool = False):
        self.q = torch.full((vocab_size,), 1.0 / vocab_size) if probs is None else (probs / probs.sum()).float()
        if self.q.numel() != vocab_size:
            raise ValueError(f"probs has {self.q.numel()} entries, vocab_size is {vocab_size}")
        self.greedy = greedy

    def reset(self) -> None:
        pass

    def propose(self, inp: DraftInput, k: int, temperature: float, generator: torch.Generator) -> Proposal:
        if self.greedy:
            return Proposal(self.q.argmax().repeat(k))
        tokens = torch.multinomial(self.q, k, replacement=True, generator=generator)
        return Proposal(tokens, self.q.expand(k, -1))


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """argmax (and q = None, one-hot) at temperature 0; else a sample from softmax(logits / T) and that distribution."""
    if temperature <= 0:
        return logits.argmax(-1), None
    q = torch.softmax(logits.float() / temperature, dim=-1)
    tok = torch.multinomial(q.cpu(), 1, generator=generator)[0]
    return tok.to(logits.device), q


# ------------------------------------------------------------------------------------------- the accept/reject step


def accept_greedy(draft: torch.Tensor, logits: torch.Tensor) -> tuple[int, int]:
    """Greedy verification. draft [K]; logits [K+1, V] (row i: the position of draft i; row K: the bonus position).

    Accept drafts while they equal the verifier's argmax; the token after them is the argmax at the first mismatch
    (the correction) or at the bonus position. The committed tokens are exactly what greedy decoding would produce.
    Returns (accepted count n, next token).
    """
    target = logits.argmax(-1)
    n = 0
    while n < draft.numel() and int(draft[n]) == int(target[n]):
        n += 1
    return n, int(target[n])


def accept_sampled(draft: torch.Tensor, q: torch.Tensor | None, logits: torch.Tensor, temperature: float,
                   generator: torch.Generator) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al. 2023; Chen et al. 2023): the output has the verifier's distribution.

    p_i = softmax(logits_i / T), q_i = the drafter's proposal distribution (one-hot at d_i for greedy proposals).
    For i = 1..K:  accept d_i with probability min(1, p_i(d_i) / q_i(d_i));
                   on rejection emit y ~ norm(max(0, p_i - q_i)) and stop.
    If all K are accepted, emit the bonus token y ~ p_{K+1}.
    Why it is exact: P(emit y at i) = q(y) min(1, p(y)/q(y)) + P(reject) * max(0, p(y)-q(y)) / sum_z max(0, p(z)-q(z))
                   = min(p(y), q(y)) + max(0, p(y) - q(y)) = p(y),
    because P(reject) = 1 - sum_z min(p(z), q(z)) = sum_z max(0, p(z) - q(z)).
    With a one-hot q the rule accepts d with probability p(d) and otherwise samples from p with d removed.
    Returns (accepted count n, next token).
    """
    p = torch.softmax(logits.float() / temperature, dim=-1).cpu()
    K = draft.numel()
    u = torch.rand(K, generator=generator, dtype=torch.float64)
    for i in range(K):
        x = int(draft[i])
        q_x = 1.0 if q is None else float(q[i, x])
        p_x = float(p[i, x])
        if q_x > 0 and u[i].item() * q_x < p_x:  # u < p/q  <=>  accepted with probability min(1, p/q)
            continue
        if q is None:
            residual = p[i].clone()
            residual[x] = 0.0  # max(0, p - onehot(x))
        else:
            residual = torch.clamp(p[i] - q[i].to(p.dtype), min=0.0)
        total = float(residual.sum())
        if total <= 0:  # p == q up to rounding: rejection had probability ~0; p itself is the right distribution
            residual, total = p[i], float(p[i].sum())
        y = torch.multinomial(residual / total, 1, generator=generator)
        return i, int(y)
    return K, int(torch.multinomial(p[K], 1, generator=generator))


# ------------------------------------------------------------------------------------------------------- the loops


@dataclass
class DecodeResult:
    tokens: list[int]  # generated ids (cut at max_new_tokens; an EOS token is kept and ends the list)
    seconds: float
    rounds: int = 0  # verification rounds (each drafted K tokens)
    accepted: int = 0  # draft tokens accepted over all rounds
    accepted_per_pos: list[int] = field(default_factory=list)  # rounds with more than i accepted, i = 0..K-1
    accepted_per_round: list[int] = field(default_factory=list)  # accepted drafts of each round, in order: with the
    # prompt length it places every round at its context length (eagle3lib.data.context_buckets.py)
    forwards: int = 0  # verifier forward passes (prefill included)

    @property
    def tau(self) -> float | None:
        """Tokens per verification round, bonus/correction token included (vLLM: 1 + accepted / drafts)."""
        return 1.0 + self.accepted / self.rounds if self.rounds else None


def _finish(new: list[int], max_new_tokens: int, eos: set[int]) -> tuple[list[int], bool]:
    """Cut at max_new_tokens and after the first EOS; done when either was reached."""
    for i, t in enumerate(new[:max_new_tokens]):
        if t in eos:
            return new[: i + 1], True
    return new[:max_new_tokens], len(new) >= max_new_tokens


def _first(logits_row: torch.Tensor, temperature: float, generator: torch.Generator) -> int:
    if temperature <= 0:
        return int(logits_row.argmax())
    return int(torch.multinomial(torch.softmax(logits_row.float() / temperature, -1).cpu(), 1, generator=generator))


def plain_decode(verifier: Verifier, prompt: Sequence[int], max_new_tokens: int, *, eos: Sequence[int] = (),
                 temperature: float = 0.0, generator: torch.Generator | None = None) -> DecodeResult:
    """The baseline: one token per verifier forward, KV-cached."""
    generator = generator or torch.Generator().manual_seed(0)
    eos_set = set(eos)
    t0 = time.perf_counter()
    verifier.reset()
    logits, _ = verifier.forward(torch.as_tensor(list(prompt), dtype=torch.long), last_only=True)
    new = [_first(logits[-1], temperature, generator)]
    forwards = 1
    new, done = _finish(new, max_new_tokens, eos_set)
    while not done:
        logits, _ = verifier.forward(torch.tensor([new[-1]]), last_only=True)
        forwards += 1
        new, done = _finish(new + [_first(logits[-1], temperature, generator)], max_new_tokens, eos_set)
    return DecodeResult(new, time.perf_counter() - t0, forwards=forwards)


def speculative_decode(verifier: Verifier, drafter: Drafter, prompt: Sequence[int], max_new_tokens: int, k: int, *,
                       eos: Sequence[int] = (), temperature: float = 0.0,
                       generator: torch.Generator | None = None) -> DecodeResult:
    """Chain speculative decoding of one sequence; greedy at temperature 0, else speculative sampling."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    generator = generator or torch.Generator().manual_seed(0)
    eos_set = set(eos)
    t0 = time.perf_counter()
    verifier.reset()
    drafter.reset()
    res = DecodeResult([], 0.0, accepted_per_pos=[0] * k)
    with verifier.capturing(drafter.aux_layer_ids):
        tokens = torch.as_tensor(list(prompt), dtype=torch.long)
        logits, aux = verifier.forward(tokens, last_only=True)  # prefill: aux for every prompt position
        res.forwards = 1
        first = _first(logits[-1], temperature, generator)
        tokens = torch.cat([tokens, torch.tensor([first])])
        new, done = _finish([first], max_new_tokens, eos_set)
        aux_start = 0
        while not done:
            n = tokens.numel()  # committed; the verifier's cache holds n - 1 of them
            prop = drafter.propose(DraftInput(tokens, aux, aux_start), k, temperature, generator)
            draft = prop.tokens.to(torch.long).view(-1)[:k]
            if draft.numel() != k:
                raise RuntimeError(f"{type(drafter).__name__} proposed {draft.numel()} tokens, expected {k}")
            # one verifier pass over [last committed token, d_1..d_K] at positions n-1..n-1+K
            logits, aux_all = verifier.forward(torch.cat([tokens[-1:], draft]))
            res.forwards += 1
            if temperature <= 0:
                n_acc, nxt = accept_greedy(draft, logits)
            else:
                n_acc, nxt = accept_sampled(draft, prop.probs, logits, temperature, generator)
            res.rounds += 1
            res.accepted += n_acc
            res.accepted_per_round.append(n_acc)
            for i in range(n_acc):
                res.accepted_per_pos[i] += 1
            emitted = draft[:n_acc].tolist() + [nxt]
            tokens = torch.cat([tokens, torch.tensor(emitted)])
            verifier.crop(n + n_acc)  # keep the last committed token and the accepted drafts; drop the rejected
            # hidden states now known for the committed positions n-1 .. n-1+n_acc (the emitted token has none yet)
            aux = None if aux_all is None else aux_all[: n_acc + 1]
            aux_start = n - 1
            new, done = _finish(new + emitted, max_new_tokens, eos_set)
    res.tokens = new
    res.seconds = time.perf_counter() - t0
    return res


# --------------------------------------------------------------------------------------------------------- summary


def summarize_runs(results: Sequence[DecodeResult], k: int) -> dict[str, Any]:
    """Pooled over sequences, as vLLM's counters pool over requests: tau = 1 + sum(accepted) / sum(rounds);
    accept_rate_pos_i = rounds with >= i accepted / rounds (i = 1..K): the share of rounds whose first i drafts were
    all accepted, the measured counterpart of the training-time full accuracy at step i-1."""
    rounds = sum(r.rounds for r in results)
    accepted = sum(r.accepted for r in results)
    per_pos = [sum(r.accepted_per_pos[i] for r in results if len(r.accepted_per_pos) > i) for i in range(k)]
    out: dict[str, Any] = {
        "sequences": len(results),
        "rounds": rounds,
        "draft_tokens": rounds * k,
        "accepted": accepted,
        "output_tokens": sum(len(r.tokens) for r in results),
        "seconds": sum(r.seconds for r in results),
        "tau": 1.0 + accepted / rounds if rounds else None,
        "accepted_per_pos": per_pos,
        "accept_rate_pos": [c / rounds if rounds else None for c in per_pos],
    }
    return out
