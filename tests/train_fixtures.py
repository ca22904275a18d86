"""A small real hidden-state store for the train tests: conversations rendered with the tiny verifier's chat template
(assistant-token mask from `return_assistant_tokens_mask`), run through the verifier with HF (forward hooks: the input
of each feature layer, the output of the last layer before the final norm) and written with HiddenStateWriter.

Conversations: by default dialogues of the tiny verifier's own corpus (a seed it was not trained on), whose assistant
turns are what the verifier predicts; `generate=True` answers the shipped prompts (builtin:tiny-train) with the
verifier's greedy HF generation instead, which is exact but ~10x slower on 2 busy cores. The training targets are the
verifier's distributions either way.

Built once per (verifier, size, source) into .cache/test-train-store/<key>/ (atomically, under a file lock); delete the
folder to rebuild.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

from eagle3lib.core.paths import REPO_ROOT, cache_dir

AUX_IDS = [2, 4, 5]


def _generate(model, tok, prompts: list[list[dict]], max_new_tokens: int, batch: int = 16) -> list[str]:
    tok.padding_side = "left"
    out: list[str] = []
    for s in range(0, len(prompts), batch):
        texts = [tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts[s : s + batch]]
        enc = tok(texts, return_tensors="pt", padding=True)
        with torch.no_grad():
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tok.pad_token_id, eos_token_id=[tok.eos_token_id, tok.pad_token_id])
        for row in gen[:, enc["input_ids"].shape[1] :]:
            out.append(tok.decode(row, skip_special_tokens=False))
    return out


def _split_answer(text: str, eos: str, pad: str) -> tuple[str, str] | None:
    text = text.split(eos)[0].replace(pad, "")
    if "<think>" not in text or "</think>" not in text:
        return None
    reasoning = text.split("<think>", 1)[1].split("</think>", 1)[0].strip("\n")
    content = text.split("</think>", 1)[1].lstrip("\n")
    return reasoning, content


def _conversations(model, tok, n_samples: int, generate: bool, max_new_tokens: int, seed: int):
    """(id, messages) pairs."""
    if not generate:
        from eagle3lib.tiny import corpus

        return [(f"c{seed}-{i}", s["messages"]) for i, s in enumerate(corpus.samples(1000 + seed, n_samples))]
    from eagle3lib.data.datasets import load_conversations

    convs = load_conversations("builtin:tiny-train", max_samples=n_samples, shuffle=True, seed=seed)
    prompts = [c.prompt() for c in convs]
    out = []
    for c, p, ans in zip(convs, prompts, _generate(model, tok, prompts, max_new_tokens), strict=True):
        parts = _split_answer(ans, tok.eos_token, tok.pad_token)
        if parts is not None:
            out.append((c.id, p + [{"role": "assistant", "reasoning_content": parts[0], "content": parts[1]}]))
    return out


def build_store(out_dir: Path, verifier: Path, n_samples: int, generate: bool = False, max_new_tokens: int = 160,
                seed: int = 0) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle3lib.data.hidden_store import HiddenSample, HiddenStateWriter

    torch.manual_seed(seed)
    tok = AutoTokenizer.from_pretrained(verifier)
    model = AutoModelForCausalLM.from_pretrained(verifier, dtype=torch.float32).eval()
    convs = _conversations(model, tok, n_samples, generate, max_new_tokens, seed)
    layers = model.model.layers
    captured: dict[str, torch.Tensor] = {}
    hooks = [layers[k].register_forward_pre_hook(
        lambda _m, args, kwargs, k=k: captured.__setitem__(f"aux{k}", (args[0] if args else kwargs["hidden_states"])),
        with_kwargs=True) for k in AUX_IDS]
    hooks.append(layers[-1].register_forward_hook(
        lambda _m, _a, out: captured.__setitem__("final", out[0] if isinstance(out, tuple) else out)))
    meta = {"verifier": str(verifier), "hidden_size": model.config.hidden_size, "vocab_size": model.config.vocab_size,
            "num_layers": model.config.num_hidden_layers, "aux_layer_ids": AUX_IDS}
    kept = 0
    with HiddenStateWriter(out_dir, meta, samples_per_shard=64) as w:
        for sid, msgs in convs:
            enc = tok.apply_chat_template(msgs, return_dict=True, return_assistant_tokens_mask=True)
            ids = torch.tensor(enc["input_ids"])
            with torch.no_grad():
                model(input_ids=ids[None])
            aux = torch.stack([captured[f"aux{k}"][0] for k in AUX_IDS], dim=1)
            w.add(HiddenSample(sid, ids, torch.tensor(enc["assistant_masks"], dtype=torch.bool),
                               aux.to(torch.bfloat16), captured["final"][0].to(torch.bfloat16)))
            kept += 1
    for h in hooks:
        h.remove()
    return {"samples": kept}


def cached_store(verifier: Path, n_samples: int, generate: bool = False, max_new_tokens: int = 160) -> Path:
    """The store for (verifier, n_samples, source), built on first use into .cache/test-train-store/."""
    from eagle3lib.core.paths import cache_dir

    key = hashlib.sha256(f"{verifier.name}|{n_samples}|{generate}|{max_new_tokens}|{AUX_IDS}|v2".encode()).hexdigest()[:12]
    root = cache_dir() / "test-train-store"
    out = root / key
    if (out / "store.json").exists() and (out / ".complete").exists():
        return out
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / ".complete").exists():
            tmp = root / f".tmp-{key}-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            build_store(tmp, verifier, n_samples, generate, max_new_tokens)
            (tmp / ".complete").write_text("ok\n")
            shutil.rmtree(out, ignore_errors=True)
            os.replace(tmp, out)
    return out


def make_run_dir(tmp: Path, store: Path) -> Path:
    """A run directory whose extract stage is the given store (symlinked: no copy)."""
    run = tmp
    run.mkdir(parents=True, exist_ok=True)
    link = run / "extract"
    if not link.exists():
        link.symlink_to(store, target_is_directory=True)
    return run


# The shared drafter's training (conftest's `train_dir`, the interop tests' source, the data-scaling test's 1.0 point):
# one process (torchrun's start costs more than it saves here) and no intermediate checkpoints (they are deleted).
SHARED_TRAIN = {"train.epochs": 3, "train.nproc_per_node": 1, "train.ckpt_every": 1000}


def shared_trained_run(tiny_verifier: Path) -> Path:
    """RUN/train of the tests' shared drafter (SHARED_TRAIN), trained once into .cache/."""
    return cached_trained_run(tiny_verifier, SHARED_TRAIN)


def cached_trained_run(tiny_verifier: Path, train: dict) -> Path:
    """RUN/train of a real training run (3 epochs, ~285 samples of the train tests' store), built once into
    .cache/test-evaluate-train/<key>/ (keyed by the training code, so a change there retrains)."""
    src = hashlib.sha256()
    for name in ("model/drafter.py", "model/checkpoint.py", "training/loop.py", "model/ttt.py", "model/ttt_attention.py", "model/ttt_flash.py",
                 "data/packing.py", "model/draft_vocab.py", "training/best.py", "training/figures.py"):
        src.update((REPO_ROOT / "eagle3lib" / name).read_bytes())
    src.update(json.dumps([tiny_verifier.name, train]).encode())
    root = cache_dir() / "test-evaluate-train"
    out = root / src.hexdigest()[:12]
    if (out / "train" / "manifest.json").exists():
        return out / "train"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "train" / "manifest.json").exists():
            tmp = root / f".tmp-{out.name}-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            run = make_run_dir(tmp, cached_store(tiny_verifier, 300))
            from eagle3lib.config.stages import open_stage
            from eagle3lib.training.loop import train as run_train

            run_train(open_stage("train", "tiny", run, train))
            shutil.rmtree(tmp / "train" / "checkpoints", ignore_errors=True)
            (tmp / "extract").unlink()
            shutil.rmtree(out, ignore_errors=True)
            os.replace(tmp, out)
            for old in root.iterdir():  # drafters of older training code
                if old.is_dir() and old != out and not old.name.startswith(".tmp-"):
                    shutil.rmtree(old, ignore_errors=True)
    return out / "train"


def fake_store(path: Path, n: int, hidden: int = 192, vocab: int = 1472, nan_sample: int | None = None,
                meta_extra: dict | None = None) -> Path:
    """n random samples of 40 tokens in a real store (the verifier's shapes by default; errors are tested with others)."""
    from eagle3lib.data.hidden_store import HiddenSample, HiddenStateWriter

    g = torch.Generator().manual_seed(0)
    meta = {"verifier": "x", "hidden_size": hidden, "vocab_size": vocab, "num_layers": 8, "aux_layer_ids": [2, 4, 5],
            **(meta_extra or {})}
    with HiddenStateWriter(path, meta, samples_per_shard=16) as w:
        for i in range(n):
            T = 40
            aux = torch.randn(T, 3, hidden, generator=g)
            fin = torch.randn(T, hidden, generator=g)
            if i == nan_sample:
                aux[20, 1, 7] = float("nan")  # e.g. an overflow in extraction; reaches every later position's output
            w.add(HiddenSample(f"s{i}", torch.randint(0, min(vocab, 1400), (T,), generator=g),
                               torch.arange(T) > 10, aux.bfloat16(), fin.bfloat16()))
    return path
