"""The tiny verifiers' recipe: a small chat model trained on the procedural corpus, and the code that trains it.
Everything in this file (and tokenizer.py, the chat format, the corpus, and for a subclass recipe its own module)
determines the weights; `recipe_key` hashes it.

`TinyRecipe` is the dense Qwen3-architecture verifier; `eagle3lib.tiny.kimi.TinyKimiRecipe` subclasses it for the
DeepSeek-V3 (MLA + MoE) twin of Kimi-K2.5, overriding the model config, the chat format and a per-step hook.

Deterministic (fixed seeds, fixed step count, single-process fp32, a fixed thread count). The output directory is a
plain HF checkpoint (config.json, model.safetensors, tokenizer files, generation_config.json) that transformers and
vLLM load, plus `build_report.json` with what the build measured.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

from eagle3lib.core.atomic import write_json_atomic
from eagle3lib.tiny import corpus
from eagle3lib.tiny.chat_format import QWEN3, ChatFormat
from eagle3lib.tiny.tokenizer import save_hf_tokenizer, train_tokenizer

FIRST_LOSSES = 20  # training losses kept exactly in the build report


@dataclass(frozen=True)
class TinyRecipe:
    hidden_size: int = 192  # small enough for ~3,500 training tokens/s on 2 cores, wide enough to learn the corpus
    intermediate_size: int = 512  # ~2.7x hidden, the usual SwiGLU ratio
    num_hidden_layers: int = 8  # >= 7 so the EAGLE-3 layers {2, L//2, L-3} = {2, 4, 5} are distinct
    num_attention_heads: int = 3  # head_dim 64: a size every vLLM CPU attention backend supports
    num_key_value_heads: int = 1  # GQA like real Qwen3 models, so the drafter's KV layout is exercised
    head_dim: int = 64  # see num_attention_heads
    max_position_embeddings: int = 2048  # the longest context the tiny profile serves
    bpe_vocab: int = 2048  # upper bound; BPE stops earlier when the corpus has no more merges
    vocab_multiple: int = 64  # pad the embedding like real models do (tokenizer length < vocab_size)
    tokenizer_samples: int = 20_000  # corpus samples the BPE is trained on
    train_seed: int = 1  # corpus seed for training; held-out uses heldout_seed
    heldout_seed: int = 2  # a different seed gives a disjoint draw from the same distribution
    heldout_samples: int = 300  # enough for a stable held-out loss in seconds
    seq_len: int = 256  # packed training rows; covers the longest two-turn dialogue
    batch_size: int = 16  # rows per step: 4,096 tokens
    steps: int = 260  # ~1.06M tokens, ~4-5 min here; loss plateaus near this point
    lr: float = 3e-3  # high lr is fine for a model this small with warmup
    warmup_steps: int = 20  # avoids early divergence at lr 3e-3
    weight_decay: float = 0.05  # mild; the corpus is large relative to the model
    init_seed: int = 0  # weight initialisation
    threads: int = 2  # fixed so the float summation order, hence the weights, do not depend on the machine's cores

    name: ClassVar[str] = "tiny"  # the builtin's name (builtin:tiny) and its folder under assets/ and the cache
    chat_format: ClassVar[ChatFormat] = QWEN3  # special tokens, template, end of turn

    def model(self, vocab: int, tok: Any) -> Any:
        """The untrained HF model (seeded by the caller)."""
        from transformers import Qwen3Config, Qwen3ForCausalLM

        return Qwen3ForCausalLM(Qwen3Config(
            vocab_size=vocab,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings,
            rope_theta=10000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            bos_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        ))

    def step_hook(self, model: Any) -> Any:
        """Called with the model before training; returns a callable run after each optimizer step, or None."""
        return None

    def report_extra(self, model: Any) -> dict[str, Any]:
        """Recipe-specific figures for build_report.json."""
        return {}


def _code_fingerprint(path: Path) -> str:
    """The module's code without comments, docstrings or formatting: an edit that cannot change the weights does not
    change the key (and does not cost every user a rebuild)."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree)


def recipe_key(recipe: TinyRecipe) -> str:
    """Hash of what determines the weights: the recipe and its chat format, this module's, the tokenizer's and a
    subclass recipe's code, and the corpus itself (sampled, so a comment edit in corpus.py does not cost a rebuild but
    any change to the dialogues does)."""
    h = hashlib.sha256(json.dumps([asdict(recipe), asdict(recipe.chat_format)], sort_keys=True).encode())
    here = Path(__file__).parent
    files = [here / "tokenizer.py", here / "recipe.py"]
    own = Path(inspect.getfile(type(recipe)))
    if own not in files:
        files.append(own)
    for path in files:
        h.update(_code_fingerprint(path).encode())
    for i in range(500):
        h.update(json.dumps(corpus.sample(recipe.train_seed, i), sort_keys=True).encode())
    return h.hexdigest()[:12]


def _render(tok, sample: dict) -> str:
    return tok.apply_chat_template(sample["messages"], tokenize=False)


def _packed_rows(tok, seed: int, seq_len: int, n_rows: int, separator: str = "<|endoftext|>"):
    """Rows of `seq_len` tokens cut from rendered dialogues, each followed by `separator` (standard LM pretraining
    packing)."""
    import torch

    sep = tok.convert_tokens_to_ids(separator)
    buf: list[int] = []
    i = 0
    rows = []
    while len(rows) < n_rows:
        while len(buf) < seq_len:
            buf += tok(_render(tok, corpus.sample(seed, i)))["input_ids"] + [sep]
            i += 1
        rows.append(buf[:seq_len])
        buf = buf[seq_len:]
    return torch.tensor(rows)


def _assistant_tokens(tok, messages: list[dict]) -> tuple[list[int], list[bool]]:
    """Token ids of a rendered dialogue and the mask of what the assistant produces. Templates with {% generation %}
    markers: transformers' mask; others (Kimi's): each assistant turn is what its message adds after the generation
    prompt of the turns before it (special tokens split the BPE, so token prefixes line up)."""
    if "{%- generation" in (tok.chat_template or ""):
        enc = tok.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
        return list(enc["input_ids"]), [bool(m) for m in enc["assistant_masks"]]
    ids = list(tok.apply_chat_template(messages, return_dict=True)["input_ids"])
    mask = [False] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            start = len(tok.apply_chat_template(messages[:i], add_generation_prompt=True, return_dict=True)["input_ids"])
            end = len(tok.apply_chat_template(messages[: i + 1], return_dict=True)["input_ids"])
            mask[start:end] = [True] * (end - start)
    return ids, mask


def heldout_loss(model, tok, recipe: TinyRecipe) -> float:
    """Mean next-token loss on assistant tokens of held-out dialogues: what the drafter will be trained to predict."""
    import torch

    total, count = 0.0, 0
    model.eval()
    with torch.no_grad():
        for s in corpus.samples(recipe.heldout_seed, recipe.heldout_samples):
            ids_list, mask_list = _assistant_tokens(tok, s["messages"])
            ids = torch.tensor([ids_list])
            mask = torch.tensor(mask_list[1:], dtype=torch.bool)
            logits = model(input_ids=ids).logits[0, :-1]
            nll = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")
            total += nll[mask].sum().item()
            count += int(mask.sum())
    return total / max(count, 1)


def build_tiny_verifier(recipe: TinyRecipe, out_dir: Path, *, progress: bool = True, max_steps: int | None = None) -> dict:
    """Tokenizer, weights and build_report.json into out_dir. `max_steps`: stop training early and return the report
    without saving the model (the check that a rebuild reproduces the shipped weights' first losses)."""
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoTokenizer, GenerationConfig

    t_start = time.time()
    torch.set_num_threads(recipe.threads)
    out_dir.mkdir(parents=True, exist_ok=True)

    def flat(s: dict) -> str:
        return "\n".join(f"{m.get('reasoning_content', '')}\n{m['content']}" for m in s["messages"])

    fmt = recipe.chat_format
    bpe = train_tokenizer((flat(s) for s in corpus.samples(recipe.train_seed, recipe.tokenizer_samples)), recipe.bpe_vocab,
                          fmt)
    save_hf_tokenizer(bpe, out_dir, recipe.max_position_embeddings, fmt)
    tok = AutoTokenizer.from_pretrained(out_dir)
    assert tok.chat_template == fmt.template
    vocab = math.ceil(len(tok) / recipe.vocab_multiple) * recipe.vocab_multiple

    torch.manual_seed(recipe.init_seed)
    model = recipe.model(vocab, tok)
    n_params = sum(p.numel() for p in model.parameters())

    n_steps = recipe.steps if max_steps is None else max_steps
    rows = _packed_rows(tok, recipe.train_seed, recipe.seq_len, n_steps * recipe.batch_size,  # the first rows alike
                        fmt.separator)
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.95), weight_decay=recipe.weight_decay)

    def lr_at(step: int) -> float:  # linear warmup, cosine decay to 10%
        if step < recipe.warmup_steps:
            return recipe.lr * (step + 1) / recipe.warmup_steps
        p = (step - recipe.warmup_steps) / max(1, recipe.steps - recipe.warmup_steps)
        return recipe.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * p)))

    after_step = recipe.step_hook(model)
    t_train = time.time()
    losses = []
    model.train()
    bar = tqdm(range(n_steps), desc="tiny verifier", disable=not progress, mininterval=5)
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        x = rows[step * recipe.batch_size : (step + 1) * recipe.batch_size]
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
    train_s = time.time() - t_train
    if max_steps is not None:
        return {"recipe_key": recipe_key(recipe), "first_losses": losses}
    train_tokens = recipe.steps * recipe.batch_size * recipe.seq_len

    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    eos = [tok.convert_tokens_to_ids(t) for t in fmt.stop]
    GenerationConfig(eos_token_id=eos, pad_token_id=tok.pad_token_id, do_sample=False).save_pretrained(out_dir)
    report = {
        "name": f"eagle3lib-{recipe.name}-{model.config.model_type}",
        "recipe": asdict(recipe),
        "recipe_key": recipe_key(recipe),
        "parameters": n_params,
        "vocab_size": vocab,
        "tokenizer_size": len(tok),
        "train_tokens": train_tokens,
        "train_seconds": round(train_s, 1),
        "train_tokens_per_s": round(train_tokens / train_s, 1),
        "final_train_loss": round(sum(losses[-10:]) / 10, 4),
        "train_loss_curve": [round(x, 4) for x in losses[:: max(1, len(losses) // 50)]],
        "first_losses": losses[:FIRST_LOSSES],  # exact: a rebuild's first steps must reproduce them
        "heldout_loss": round(heldout_loss(model, tok, recipe), 4),
        **recipe.report_extra(model),
        "build_seconds": round(time.time() - t_start, 1),
    }
    write_json_atomic(out_dir / "build_report.json", report)
    return report
