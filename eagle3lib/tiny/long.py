"""The tiny-long verifier: the dense tiny verifier taught to answer from documents of up to 16K tokens.

Built from the tiny verifier's weights and tokenizer (eagle3lib/tiny/recipe.py) by continued training on a mix of
  - its own corpus rows (256 tokens, as it was trained), so it keeps answering chat, code and math as before, and
  - long-document dialogues (the task, below): an animal and a country mentioned once each in filler, questions
    about them, answers that name what the document mentions and go on about it; loss on the answers only.
Training at 8K-16K real tokens costs ~20 s a step on 2 cores, so phase 1 trains on batches of documents of 60-400
tokens, most of them spread over a 16K-position span: position ids jump by random gaps at paragraph breaks
(paragraphs keep contiguous positions, so what is local stays local), so the model learns to find a mention at
relative distances up to 16K without paying for the tokens in between. Phase 2 trains on single documents of 1-3K
real tokens, where the mention has to win a softmax over thousands of other tokens. Measured at build (build_report.json
`retrieval_accuracy`, before and after): on real documents of ~1K, 3.5K, 7K and 14K tokens, the share whose mention
the verifier names (chance: 1 in 8 animals or 12 countries) and the share of answer tokens predicted right.

`max_position_embeddings` 16,384 (RoPE theta 10,000 with head_dim 64: the slowest rotation's period is ~47K positions,
so 16K positions stay distinguishable without rope scaling).
"""

from __future__ import annotations

import json
import math
import random
import re
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

from eagle3lib.core.atomic import write_json_atomic
from eagle3lib.tiny import corpus
from eagle3lib.tiny.recipe import FIRST_LOSSES, TinyRecipe, _assistant_tokens, _packed_rows, recipe_key

# ------------------------------------------------------------------------------------------------------- the task
# The tiny verifiers never read their prompts for content (asked about camels they answer about cats), so their
# drafters were never measured where real drafters do best: answers that quote a long prompt. Here a document of
# filler paragraphs (the tiny corpus's own answers, so every word is in the tokenizer) hides a few facts, "<Name> has
# <n> <items>.", and the user asks how many items one person has. The verifier must find the fact thousands of tokens
# back and copy its number; the drafter must do the same from the verifier's hidden states. A sample is a pure
# function of (the random stream, target length), like eagle3lib/tiny/corpus.py's.

TOKENS_PER_PARAGRAPH = 15  # measured: a document of N paragraphs is ~15 N tokens with the tiny tokenizer
FILLER_SEED = 99  # filler paragraphs come from this corpus seed (not the training or held-out dialogues' seeds)


_MENTIONS = re.compile(r"\b(" + "|".join([*corpus.ANIMALS, *corpus.CAPITALS, *corpus.CAPITALS.values()]) + r")",
                       re.IGNORECASE)


def _filler(r: random.Random) -> str:
    """A paragraph from the tiny corpus's answers that names no animal, country or capital: the document's one
    mention of each is then the only one."""
    while True:
        text = corpus.sample(FILLER_SEED, r.randrange(10**6))["messages"][-1]["content"]
        if not _MENTIONS.search(text):
            return text


def _answer(kind: str, animal: str, country: str) -> tuple[str, str]:
    """(reasoning, content) of the answer to the question about the document's animal or country."""
    if kind == "animal":
        adj, home, food, _ = corpus.ANIMALS[animal]
        a = animal.capitalize()
        return (f"I look for an animal in the text. It mentions {animal}s. {a}s are {adj}, live in {home} and eat "
                f"{food}.", f"The text mentions {animal}s. {a}s are {adj} animals. They live in {home} and eat {food}.")
    cap = corpus.CAPITALS[country]
    return (f"I look for a country in the text. It mentions {country}. The capital of {country} is {cap}.",
            f"The text mentions {country}. The capital of {country} is {cap}.")


def long_sample(r: random.Random, target_tokens: int, questions: int = 1) -> dict[str, Any]:
    """One conversation about a document of about `target_tokens` tokens that mentions one animal and one country,
    once each, anywhere: `questions` (1 or 2) user turns ask which animal / which country, and each answer names it
    and goes on with what the verifier knows of it (its tiny corpus: what the animal eats, the country's capital).

    Finding a word of a kind (an animal) is one attention head whose query asks for the kind, whatever the distance;
    a name-to-value lookup ("Eli has 42 coins") needs a previous-token head composed with a matching one, which this
    model did not learn in minutes of training (measured: the looked-up token right at chance after 400 steps)."""
    n_para = max(4, target_tokens // TOKENS_PER_PARAGRAPH)
    animal, country = r.choice(list(corpus.ANIMALS)), r.choice(list(corpus.CAPITALS))
    paras = [f"A friend saw some {animal}s today.", f"Another friend flew to {country}."]
    while len(paras) < n_para:
        paras.append(_filler(r))
    r.shuffle(paras)
    doc = "\n".join(paras)
    kinds = r.sample(["animal", "country"], min(questions, 2))
    messages: list[dict[str, str]] = []
    for j, kind in enumerate(kinds):
        q = f"Which {kind} does the text mention?"
        reasoning, content = _answer(kind, animal, country)
        messages.append({"role": "user", "content": f"Read this text.\n\n{doc}\n\n{q}" if j == 0 else q})
        messages.append({"role": "assistant", "content": content, "reasoning_content": reasoning})
    return {"messages": messages, "answers": [animal + "s" if k == "animal" else country for k in kinds]}


def long_prompts(seed: int, lengths: list[int], prefix: str) -> list[dict[str, Any]]:
    """Prompt records (one user turn, category "long-doc") for documents of the given target lengths."""
    out = []
    for i, target in enumerate(lengths):
        s = long_sample(random.Random(seed * 1_000_003 + i), target)
        out.append({"id": f"{prefix}{i:03d}", "category": "long-doc", "messages": s["messages"][:1]})
    return out


def write_long_prompt_files(out_dir, seed: int = 11) -> None:
    """The shipped tiny-long prompt sets (eagle3lib/assets/prompts/long-*.jsonl.zst): the training set mixes the tiny
    training prompts (short chat, code, math: most of the drafter's trained tokens) with documents of 1-4K and 8-16K
    tokens; the held-out set has documents in each evaluation bucket (<4K, 4K-8K, 8K-16K) and a few short prompts.

    Regenerate with `python -c "from eagle3lib.tiny.long import write_long_prompt_files; write_long_prompt_files('eagle3lib/assets/prompts')"`.
    """
    import zstandard

    out = Path(out_dir)
    r = random.Random(seed)
    short = [json.loads(x) for x in (out / "train.jsonl").read_text().splitlines()[:200]]
    train = short + long_prompts(seed, [r.randint(1000, 4000) for _ in range(40)], "lm") \
        + long_prompts(seed + 1, [r.randint(8000, 15000) for _ in range(8)], "ll")
    held_short = [json.loads(x) for x in (out / "heldout.jsonl").read_text().splitlines()[:4]]
    heldout = held_short + long_prompts(seed + 2, [r.randint(1500, 3500) for _ in range(4)], "hs") \
        + long_prompts(seed + 3, [r.randint(5000, 7500) for _ in range(4)], "hm") \
        + long_prompts(seed + 4, [r.randint(9000, 15000) for _ in range(4)], "hl")
    for name, part in (("long-train.jsonl.zst", train), ("long-heldout.jsonl.zst", heldout)):
        text = "".join(json.dumps(p) + "\n" for p in part).encode()
        (out / name).write_bytes(zstandard.ZstdCompressor(level=19).compress(text))


# ----------------------------------------------------------------------------------------------------- the recipe


@dataclass(frozen=True)
class TinyLongRecipe(TinyRecipe):
    max_position_embeddings: int = 16384  # the longest context tiny-long serves (params/tiny-long.yaml)
    long_steps: int = 600  # phase 1 steps, short documents in a batch: ~6 min on 2 cores
    long_lr: float = 2e-3  # below the from-scratch 3e-3: the base weights are already trained
    long_warmup_steps: int = 10  # the optimizer state starts empty
    short_rows: int = 2  # 256-token corpus rows per step, beside the documents: keeps the base skills
    docs_per_step: int = 4  # document dialogues per step (a padded batch): retrieval is learned from many examples
    doc_tokens_min: int = 60  # trained document lengths (real tokens) ...
    doc_tokens_max: int = 400  # ... short: many retrievals per second of compute (the gaps give the distances)
    real_steps: int = 250  # phase 2 steps, one document of real length each: ~4 min. Phase 1 alone finds a mention in
    # 50% of 1K-token documents and ~10% of 7K ones (the softmax over thousands of real tokens dilutes what a few
    # hundred trained it for); 50 steps of phase 2 took a probe to 88% at 3.5K and 62% at 7K
    real_tokens_min: int = 1000  # phase 2 document lengths (real tokens) ...
    real_tokens_max: int = 3000  # ... ~1-2 s a step
    questions: int = 2  # questions per trained document: both (animal, country), two answers for one document
    gap_prob: float = 0.7  # share of documents spread over a longer position span (the rest keep true positions)
    gap_span: int = 16000  # spread documents span up to this many positions (<= max_position_embeddings)
    long_seed: int = 1  # the long dialogues' stream; evaluation documents use seeds 1000 + length
    eval_lengths: tuple[int, ...] = (1000, 3500, 7000, 14000)  # retrieval_accuracy measured at these document lengths
    eval_docs: int = 8  # documents per length for retrieval_accuracy

    name: ClassVar[str] = "tiny-long"

    def build(self, out_dir: Path, progress: bool = True) -> dict[str, Any]:
        """Continued training of the tiny verifier (tiny_verifier_path calls this instead of training from zero)."""
        return build_long_verifier(self, out_dir, progress=progress)


def _gapped_positions(ids: list[int], newline_ids: set[int], span: int, gen: Any) -> Any:
    """Position ids 0..n-1 plus random gaps at newline tokens, so the sequence spans `span` positions in all."""
    import torch

    n = len(ids)
    nl = [i for i, t in enumerate(ids) if t in newline_ids]
    gaps = torch.zeros(n, dtype=torch.long)
    if nl and span > n:
        where = torch.multinomial(torch.ones(len(nl)), span - n, replacement=True, generator=gen)
        gaps[torch.tensor(nl)] = torch.bincount(where, minlength=len(nl))
    return torch.arange(n) + gaps.cumsum(0)


def _document_batch(recipe: TinyLongRecipe, tok: Any, r: random.Random, gen: Any, newline: set[int], phase: int):
    """A step's document dialogues, right-padded: ids, labels (the answers only), gapped positions, mask. Phase 1:
    `docs_per_step` short ones; phase 2: one of real length."""
    import torch

    seqs = []
    n_docs, lo, hi = ((recipe.docs_per_step, recipe.doc_tokens_min, recipe.doc_tokens_max) if phase == 1
                      else (1, recipe.real_tokens_min, recipe.real_tokens_max))
    for _ in range(n_docs):
        s = long_sample(r, r.randint(lo, hi), recipe.questions)
        ids, mask = _assistant_tokens(tok, s["messages"])
        span = r.randint(len(ids), recipe.gap_span) if r.random() < recipe.gap_prob else len(ids)
        seqs.append((ids, mask, _gapped_positions(ids, newline, span, gen)))
    n = max(len(ids) for ids, _, _ in seqs)
    x = torch.full((len(seqs), n), tok.pad_token_id)
    labels = torch.full((len(seqs), n), -100)
    pos = torch.zeros((len(seqs), n), dtype=torch.long)
    att = torch.zeros((len(seqs), n), dtype=torch.long)
    for i, (ids, mask, p) in enumerate(seqs):
        x[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(ids)] = torch.tensor(ids).masked_fill(~torch.tensor(mask), -100)
        pos[i, : len(ids)] = p
        att[i, : len(ids)] = 1
    return x, labels, pos, att


def retrieval_accuracy(model: Any, tok: Any, recipe: TinyLongRecipe) -> dict[str, dict[str, float]]:
    """Per document length: the share of documents whose mention the verifier retrieves (the animal or country
    predicted right after "It mentions", its first appearance in the answer; chance 1 in 8 or 12), the share of all answer tokens
    predicted right (teacher-forced argmax), and the documents' mean length in tokens."""
    import torch

    out = {}
    model.eval()
    with torch.no_grad():
        for target in recipe.eval_lengths:
            r = random.Random(1000 + target)
            ok = n = found = length = 0
            for _ in range(recipe.eval_docs):
                s = long_sample(r, target)
                ids, mask = _assistant_tokens(tok, s["messages"])
                pred = model(input_ids=torch.tensor([ids])).logits[0].argmax(-1)
                word = tok(" " + s["answers"][0], add_special_tokens=False)["input_ids"]  # " camels", " Kenya"
                first = next(i for i in range(1, len(ids)) if mask[i] and ids[i] == word[0])  # "It mentions ^"
                found += int(pred[first - 1] == ids[first])
                m = torch.tensor(mask[1:])
                ok += int((pred[:-1][m] == torch.tensor(ids[1:])[m]).sum())
                n += int(m.sum())
                length += len(ids)
            out[str(target)] = {"doc_tokens": round(length / recipe.eval_docs), "retrieved": round(found / recipe.eval_docs, 3),
                                "answer_tokens": round(ok / n, 3)}
    return out


def build_long_verifier(recipe: TinyLongRecipe, out_dir: Path, *, progress: bool = True,
                        max_steps: int | None = None) -> dict[str, Any]:
    """The tiny verifier (built or from the cache), its tokenizer with the longer maximum, continued training, weights
    and build_report.json into out_dir. `max_steps`: stop early and return the first losses without measuring or
    saving (the check that a rebuild reproduces the shipped build)."""
    import torch
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle3lib.tiny.build import tiny_verifier_path
    t_start = time.time()
    torch.set_num_threads(recipe.threads)
    base = tiny_verifier_path(TinyRecipe(), progress=progress)
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():  # tokenizer files and generation_config; config and weights are written below
        if f.is_file() and f.name not in ("build_report.json", "model.safetensors", "config.json"):
            shutil.copy2(f, out_dir / f.name)
    tok = AutoTokenizer.from_pretrained(base, model_max_length=recipe.max_position_embeddings)
    tok.save_pretrained(out_dir)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="sdpa")
    model.config.max_position_embeddings = recipe.max_position_embeddings
    before = retrieval_accuracy(model, tok, recipe) if max_steps is None else None

    newline = {i for t, i in tok.get_vocab().items() if "\n" in tok.convert_tokens_to_string([t])}
    total = recipe.long_steps + recipe.real_steps
    rows = _packed_rows(tok, recipe.train_seed + 100, recipe.seq_len, total * recipe.short_rows,
                        recipe.chat_format.separator)  # a corpus stream the base model did not train on
    opt = torch.optim.AdamW(model.parameters(), lr=recipe.long_lr, betas=(0.9, 0.95), weight_decay=recipe.weight_decay)
    r = random.Random(recipe.long_seed)
    gen = torch.Generator().manual_seed(recipe.long_seed)
    torch.manual_seed(recipe.init_seed)
    losses, tokens, t_train = [], 0, time.time()
    model.train()
    for step in tqdm(range(total if max_steps is None else max_steps), desc="tiny-long verifier",
                     disable=not progress, mininterval=5):
        warm = min(1.0, (step + 1) / recipe.long_warmup_steps)  # warmup, then cosine to 10%
        for g in opt.param_groups:
            g["lr"] = recipe.long_lr * warm * (0.1 + 0.45 * (1 + math.cos(math.pi * step / total)))
        x, labels, pos, att = _document_batch(recipe, tok, r, gen, newline, 1 if step < recipe.long_steps else 2)
        loss_long = model(input_ids=x, labels=labels, position_ids=pos, attention_mask=att).loss
        short = rows[step * recipe.short_rows : (step + 1) * recipe.short_rows]
        loss_short = model(input_ids=short, labels=short).loss
        (loss_long + loss_short).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append([loss_long.item(), loss_short.item()])
        tokens += int(att.sum()) + short.numel()
    if max_steps is not None:
        return {"recipe_key": recipe_key(recipe), "first_losses": [a + b for a, b in losses]}
    train_s = time.time() - t_train
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    from eagle3lib.tiny.recipe import heldout_loss

    report = {
        "name": f"eagle3lib-{recipe.name}-{model.config.model_type}",
        "recipe": asdict(recipe),
        "recipe_key": recipe_key(recipe),
        "base_recipe_key": base.name,
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocab_size": model.config.vocab_size,
        "tokenizer_size": len(tok),
        "train_tokens": tokens,
        "train_seconds": round(train_s, 1),
        "train_tokens_per_s": round(tokens / train_s, 1),
        "final_train_loss": round(sum(x[1] for x in losses[-20:]) / 20, 4),  # the corpus rows: comparable to the base's
        "final_train_loss_long": round(sum(x[0] for x in losses[-20:]) / 20, 4),  # the documents' answers
        "train_loss_curve": [round(x[1], 4) for x in losses[:: max(1, len(losses) // 50)]],
        "train_loss_curve_long": [round(x[0], 4) for x in losses[:: max(1, len(losses) // 50)]],
        "first_losses": [x[0] + x[1] for x in losses[:FIRST_LOSSES]],
        "heldout_loss": round(heldout_loss(model, tok, recipe), 4),  # the base corpus: kept near the base's
        "retrieval_accuracy_before": before,
        "retrieval_accuracy": retrieval_accuracy(model, tok, recipe),
        "build_seconds": round(time.time() - t_start, 1),
    }
    write_json_atomic(out_dir / "build_report.json", report)
    return report
