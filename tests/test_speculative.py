# .venv/bin/python -m pytest -q tests/test_speculative.py
"""Library speculative decoding (eagle3lib.model.speculative): greedy output equals the verifier's greedy output token for
token, speculative sampling has the verifier's distribution (chi-square on tiny random models, fixed seeds), tau stays
in [1, K+1], an oracle drafter reaches K+1, a random one stays near 1, and the EAGLE drafter's incremental state equals
a from-scratch recomputation. Real models only: the tiny verifier, tiny random Qwen3 models; no server."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from eagle3lib.data.datasets import load_conversations
from eagle3lib.model.drafter import DrafterConfig, DrafterKVCache, Eagle3Drafter, init_from_verifier
from eagle3lib.model.speculative import (
    DraftInput,
    EagleDrafter,
    LMDrafter,
    Proposal,
    RandomDrafter,
    Verifier,
    accept_sampled,
    plain_decode,
    speculative_decode,
)
from eagle3lib.model.verifier import load_hf_model, load_tokenizer, load_verifier_head

AUX = [2, 4, 5]
EOS = [2, 0]


pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py


@pytest.fixture(scope="module")
def tiny(tiny_verifier):
    model = load_hf_model(str(tiny_verifier), "float32")
    tok = load_tokenizer(str(tiny_verifier))
    prompts = []
    for c in load_conversations("builtin:tiny-heldout")[:3]:
        prompts.append(tok.apply_chat_template(c.prompt(), add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"])
    return model, prompts


@pytest.fixture(scope="module")
def untrained_drafter(tiny_verifier, tiny):
    """An EAGLE-3 drafter initialised from the verifier (embedding, lm_head rows, norm) with random fc/attention: it
    proposes plausible tokens, some accepted, most not, which exercises every path of the loop."""
    model, _ = tiny
    vc = model.config
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=vc.hidden_size, intermediate_size=vc.intermediate_size,
                        num_attention_heads=vc.num_attention_heads, num_key_value_heads=vc.num_key_value_heads,
                        head_dim=vc.head_dim, vocab_size=vc.vocab_size, draft_vocab_size=512, aux_layer_ids=AUX)
    d = Eagle3Drafter(cfg)
    d.set_vocab(torch.arange(512))
    init_from_verifier(d, load_verifier_head(str(tiny_verifier)))
    return d.eval()


def _check_counts(r, k: int) -> None:
    assert r.rounds > 0
    assert 1.0 <= r.tau <= k + 1
    per = r.accepted_per_pos
    assert len(per) == k and all(a >= b for a, b in zip(per, per[1:], strict=False)) and per[0] <= r.rounds
    assert sum(per) == r.accepted  # rounds with > i accepted, summed over i = accepted drafts
    assert r.forwards == r.rounds + 1  # one verifier pass per round plus the prefill


# ------------------------------------------------------------------------------------------------------ greedy


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_equals_verifier_greedy_token_for_token(tiny, untrained_drafter, k):
    model, prompts = tiny
    v = Verifier(model)
    drafters = {"eagle": EagleDrafter(untrained_drafter), "random": RandomDrafter(model.config.vocab_size)}
    for ids in prompts:
        ref = plain_decode(v, ids, 40, eos=EOS)
        assert len(ref.tokens) >= 20
        for name, d in drafters.items():
            r = speculative_decode(v, d, ids, 40, k, eos=EOS, generator=torch.Generator().manual_seed(1))
            assert r.tokens == ref.tokens, (name, k)
            _check_counts(r, k)


def test_oracle_gives_k_plus_1_and_random_gives_about_1(tiny):
    model, prompts = tiny
    v = Verifier(model)
    for k in (1, 3):
        rs = [speculative_decode(v, LMDrafter(model), ids, 40, k, eos=EOS) for ids in prompts]
        assert all(r.tokens == plain_decode(v, ids, 40, eos=EOS).tokens for r, ids in zip(rs, prompts, strict=True))
        assert all(r.tau == k + 1 for r in rs)  # every draft of every round accepted
        assert all(r.accepted_per_pos == [r.rounds] * k for r in rs)
    for temperature in (0.0, 0.8):
        rs = [speculative_decode(v, RandomDrafter(model.config.vocab_size), ids, 40, 3, eos=EOS,
                                 temperature=temperature, generator=torch.Generator().manual_seed(i))
              for i, ids in enumerate(prompts)]
        for r in rs:
            _check_counts(r, 3)
        tau = 1 + sum(r.accepted for r in rs) / sum(r.rounds for r in rs)
        assert tau < 1.05, (temperature, tau)  # uniform proposals over 1472 tokens vs a peaked verifier


def test_eagle_drafter_state_equals_recomputation(tiny, untrained_drafter):
    """The drafter's incremental state (step-0 entries added as positions are committed, draft entries dropped each
    round) gives the same proposals as recomputing everything from the committed tokens, in every round."""
    model, prompts = tiny
    v = Verifier(model)
    d = untrained_drafter
    inner = EagleDrafter(d)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    class Recording:
        aux_layer_ids = inner.aux_layer_ids

        def reset(self) -> None:
            inner.reset()

        def propose(self, inp: DraftInput, k: int, temperature: float, generator) -> Proposal:
            p = inner.propose(inp, k, temperature, generator)
            seen.append((inp.tokens.clone(), p.tokens.clone()))
            return p

    speculative_decode(v, Recording(), prompts[0], 40, 3, eos=EOS)
    assert len(seen) > 10
    for tokens, proposed in seen:
        with torch.no_grad():
            hs = model(input_ids=tokens[None, :-1], output_hidden_states=True).hidden_states
            aux = torch.stack([hs[i][0] for i in AUX], dim=1)  # id k = HF hidden_states[k] = input of layer k
            n = tokens.numel()
            cache = DrafterKVCache(d.config.num_layers)
            logits, feed = d.step(d.combine(aux)[None], tokens[None, 1:], torch.arange(n - 1)[None], cache)
            lg, h, ref = logits[0, -1], feed[:, -1:], []
            for j in range(3):
                t = d.draft_to_target(lg.argmax().view(1))
                ref.append(int(t))
                lg, h = d.step(h, t.view(1, 1), torch.tensor([[n - 2 + j + 1]]), cache)
                lg = lg[0, 0]
        assert proposed.tolist() == ref


def test_eagle_probabilistic_proposals_are_proper_distributions(tiny, untrained_drafter):
    """draft_sampling="probabilistic": drafts sampled from q (draft vocabulary mapped to the verifier's), q given along."""
    model, prompts = tiny
    inner = EagleDrafter(untrained_drafter, sample=True)
    checked = []

    class Checking:
        aux_layer_ids = inner.aux_layer_ids

        def reset(self) -> None:
            inner.reset()

        def propose(self, inp, k, temperature, generator):
            p = inner.propose(inp, k, temperature, generator)
            assert p.probs is not None and p.probs.shape == (k, model.config.vocab_size)
            torch.testing.assert_close(p.probs.sum(-1), torch.ones(k))
            assert bool((p.probs[torch.arange(k), p.tokens] > 0).all())  # every draft has q > 0
            assert bool((p.probs[:, 512:] == 0).all())  # nothing outside the draft vocabulary (ids 0..511 here)
            checked.append(k)
            return p

    r = speculative_decode(Verifier(model), Checking(), prompts[0], 32, 3, eos=EOS, temperature=0.8,
                           generator=torch.Generator().manual_seed(0))
    _check_counts(r, 3)
    assert len(checked) == r.rounds


# ------------------------------------------------------------------------------------------------------ sampled


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson chi-square goodness of fit; cells with expected count < min_expected are pooled into one.
    p-value = Q(df/2, chi2/2), the regularized upper incomplete gamma function."""
    n = counts.sum()
    exp = probs.double() * n
    small = exp < min_expected
    obs = torch.cat([counts[~small].double(), counts[small].double().sum().view(1)])
    exp = torch.cat([exp[~small], exp[small].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))


def test_accept_sampled_rule_has_the_verifier_distribution():
    """The accept/reject step alone, many draws: the emitted token ~ p for a sampled q and for a one-hot q, while the
    classic bug (on rejection, resample from p instead of norm(max(0, p - q))) is clearly rejected by the same test."""
    V, N = 6, 8000
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(1, V, generator=g) * 1.5
    p = torch.softmax(logits[0], -1)
    q = torch.softmax(torch.randn(V, generator=g) * 1.5, -1)
    counts_q, counts_onehot = torch.zeros(V), torch.zeros(V)
    two = torch.cat([logits, logits])  # row 0: the draft's position, row 1: bonus (never used when K=1 rejects)
    for _ in range(N):
        d = torch.multinomial(q, 1, generator=g)
        n, y = accept_sampled(d, q[None], two, 1.0, g)
        counts_q[y if n == 0 else int(d)] += 1  # the token at the draft's position: the draft or the correction
        d1 = q.argmax().view(1)
        n1, y1 = accept_sampled(d1, None, two, 1.0, g)
        counts_onehot[y1 if n1 == 0 else int(d1)] += 1
    assert chi2_pvalue(counts_q, p) > 1e-3
    assert chi2_pvalue(counts_onehot, p) > 1e-3
    buggy = torch.minimum(p, q) + (1 - torch.minimum(p, q).sum()) * p
    assert chi2_pvalue(counts_q, buggy) < 1e-6  # the test has the power to see a wrong residual


def random_qwen3(seed: int, V: int = 6) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False)
    m = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for prm in m.parameters():
            if prm.dim() > 1:
                prm.normal_(0, 0.5)  # spread, context-dependent distributions (the default init is near uniform)
    return m


def exact_marginals(model, prompt: list[int], temperature: float) -> list[torch.Tensor]:
    """Distributions of new tokens 1, 2, 3 under ancestral sampling from the model (enumerated, V^2 continuations)."""
    V = model.config.vocab_size
    P = torch.tensor(prompt)
    with torch.no_grad():
        p1 = torch.softmax(model(input_ids=P[None]).logits[0, -1] / temperature, -1).double()
        a = torch.arange(V)
        x2 = torch.cat([P.repeat(V, 1), a[:, None]], 1)
        p2_given = torch.softmax(model(input_ids=x2).logits[:, -1] / temperature, -1).double()  # [a, b]
        ab = torch.cartesian_prod(a, a)
        x3 = torch.cat([P.repeat(V * V, 1), ab], 1)
        p3_given = torch.softmax(model(input_ids=x3).logits[:, -1] / temperature, -1).double().view(V, V, V)
    m2 = p1 @ p2_given
    joint12 = p1[:, None] * p2_given
    m3 = torch.einsum("ab,abc->c", joint12, p3_given)
    return [p1, m2, m3]


@pytest.mark.parametrize("proposals", ["model-sampled", "fixed-greedy"])
def test_sampled_speculative_decoding_matches_verifier_distribution(proposals):
    """A tiny random verifier and drafter pair (V=6). Tokens 2 and 3 come out of the accept/reject rounds (token 1 is the
    prefill's); their marginals over 1000 seeded runs must match the verifier's exact marginals."""
    verifier_model, prompt, T, K, N = random_qwen3(1), [1, 2, 3, 4], 1.0, 2, 1000
    if proposals == "model-sampled":
        drafter = LMDrafter(random_qwen3(2), sample=True)  # q = the drafter model's softmax, sampled
    else:
        drafter = RandomDrafter(6, torch.tensor([0.05, 0.1, 0.4, 0.2, 0.15, 0.1]), greedy=True)  # q one-hot
    v = Verifier(verifier_model)
    exact = exact_marginals(verifier_model, prompt, T)
    counts = torch.zeros(3, 6)
    accepted = rounds = 0
    g = torch.Generator().manual_seed(1234)
    for _ in range(N):
        r = speculative_decode(v, drafter, prompt, 3, K, temperature=T, generator=g)
        assert len(r.tokens) == 3 and 1 <= r.tau <= K + 1
        for i, t in enumerate(r.tokens):
            counts[i, t] += 1
        accepted, rounds = accepted + r.accepted, rounds + r.rounds
    rate = accepted / (rounds * K)
    assert 0.1 < rate < 0.9, rate  # both acceptance and rejection happen often: the test sees both branches
    for i in range(3):
        pv = chi2_pvalue(counts[i], exact[i])
        assert pv > 1e-3, (i, pv, counts[i] / N, exact[i])
