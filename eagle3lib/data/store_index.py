"""A hidden-state store's files and their names, the index over them, and the repairs a resumed run makes.

See eagle3lib/data/hidden_store.py for the layout. Shard and index names carry the writing rank (a lone writer's
have none), so the writers of a multi-process extraction never share a file; every reader takes the union of all
indexes and of complete shards not yet indexed.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from eagle3lib.core.atomic import write_text_atomic

FORMAT = "eagle3lib-hidden-v1"
STORE_META = "store.json"
INDEX = "index.jsonl"
SHARDS_DIR = "shards"
SHARD_RE = re.compile(r"^shard-(?:r(\d+)-)?(\d{5,})\.safetensors$")  # groups: writer rank (None: a lone writer), number
RANK_INDEX_RE = re.compile(r"^index-r(\d+)\.jsonl$")


class StoreError(ValueError):
    """A hidden-state store is missing, inconsistent, or does not match what is being written."""


# ------------------------------------------------------------------------------------------------------ index scan


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


DAMAGED_HINT = "delete it and run the extract stage again: it extracts the samples of a missing shard again"


def _shard_header(path: Path) -> dict[str, Any]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            md = f.metadata() or {}
    except Exception as e:  # SafetensorError (truncated, overwritten), OSError
        raise StoreError(f"{path}: damaged hidden-state shard ({type(e).__name__}: {e}); {DAMAGED_HINT}") from None
    if md.get("format") != FORMAT:
        raise StoreError(f"{path}: not an eagle3lib hidden-state shard (format {md.get('format')!r})")
    return {"shard": path.name, "ids": json.loads(md["ids"]), "lengths": json.loads(md["lengths"]),
            "loss_tokens": int(md.get("loss_tokens", 0)), "bytes": path.stat().st_size}


def shard_order(name: str) -> tuple[int, int]:
    """Sort key of a shard name: a lone writer's shards first, then rank by rank, each in writing order."""
    m = SHARD_RE.match(name)
    return (-1 if m.group(1) is None else int(m.group(1)), int(m.group(2)))


def shard_name(rank: int | None, number: int) -> str:
    return f"shard-{number:05d}.safetensors" if rank is None else f"shard-r{rank:05d}-{number:05d}.safetensors"


def index_name(rank: int | None) -> str:
    return INDEX if rank is None else f"index-r{rank:05d}.jsonl"


def _index_files(root: Path) -> list[Path]:
    ranks = sorted((p for p in root.iterdir() if RANK_INDEX_RE.match(p.name)), key=lambda p: p.name) if root.is_dir() else []
    return [root / INDEX, *ranks]


def read_index(root: Path, strict: bool = True) -> dict[str, dict[str, Any]]:
    """Shard name -> index entry, from index.jsonl, the rank indexes (a torn last line ignored) and any complete shard
    not yet indexed. strict=False (the writer): an unindexed shard that does not read is left for `_set_aside_damaged`."""
    entries: dict[str, dict[str, Any]] = {}
    for index in _index_files(root):
        if not index.exists():
            continue
        for line in index.read_text(encoding="utf-8").splitlines():
            try:
                e = json.loads(line)
            except json.JSONDecodeError:
                continue  # torn last line of a killed writer
            if isinstance(e, dict) and "shard" in e:
                entries[e["shard"]] = e
    shard_dir = root / SHARDS_DIR
    if shard_dir.is_dir():
        for p in shard_dir.iterdir():
            if SHARD_RE.match(p.name) and p.name not in entries:
                try:
                    entries[p.name] = _shard_header(p)  # renamed but not indexed: killed between the two steps
                except StoreError:
                    if strict:
                        raise
                    entries[p.name] = {"shard": p.name, "ids": [], "lengths": [], "loss_tokens": 0, "bytes": -1}
    return dict(sorted(entries.items(), key=lambda kv: shard_order(kv[0])))


def read_store_meta(root: str | Path) -> dict[str, Any]:
    path = Path(root) / STORE_META
    if not path.exists():
        raise StoreError(f"{path}: no hidden-state store here (run the extract stage first)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise StoreError(f"{path}: not valid JSON ({e})") from e


def _set_aside_damaged(shard_dir: Path, entries: dict[str, dict[str, Any]]) -> list[str]:
    """Shards listed but missing, cut short or unreadable are moved to shards/.damaged-NAME and dropped from `entries`,
    so a resumed run extracts their samples again instead of trusting them (and says so)."""
    damaged = []
    for name, e in list(entries.items()):
        path = shard_dir / name
        ok = path.exists() and path.stat().st_size == e.get("bytes", -1)
        if ok:
            try:
                _shard_header(path)
            except StoreError:
                ok = False
        if not ok:
            if path.exists():
                os.replace(path, shard_dir / f".damaged-{name}")
            del entries[name]
            damaged.append(name)
    return damaged


def store_problems(root: str | Path, expected_samples: int | None = None) -> list[str]:
    """What is wrong with a store its manifest calls complete (cheap: names and sizes, no tensor read): a missing
    store.json, indexed shards missing or of another size, fewer samples than the manifest counted. The extract
    stage's resume repairs each (`repair_store`) and extracts only the samples they held."""
    root = Path(root)
    problems = [] if (root / STORE_META).exists() else [f"{STORE_META} is missing"]
    try:
        entries = read_index(root, strict=False)
    except OSError as e:
        return [*problems, f"its index cannot be read ({e})"]
    bad = [name for name, e in entries.items()
           if not (root / SHARDS_DIR / name).exists() or (root / SHARDS_DIR / name).stat().st_size != e.get("bytes", -1)]
    if bad:
        problems.append(f"{len(bad)} shard(s) missing or damaged ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})")
    held = store_totals({k: v for k, v in entries.items() if k not in bad})["samples"]
    if expected_samples is not None and held < expected_samples:
        problems.append(f"{expected_samples - held} of its {expected_samples} samples are not in a sound shard")
    return problems


def repair_store(root: str | Path) -> list[str]:
    """Make a store clean for appending, while no writer runs: remove temporary files of killed writers, set damaged
    shards aside (returned: their samples are extracted again), and merge every index into index.jsonl (written
    atomically, then the rank indexes removed; a kill in between leaves shards listed twice, which reads as once)."""
    root = Path(root)
    shard_dir = root / SHARDS_DIR
    shard_dir.mkdir(parents=True, exist_ok=True)
    for p in shard_dir.iterdir():
        if p.name.startswith(".") and p.name.endswith(".tmp"):
            p.unlink(missing_ok=True)
    entries = read_index(root, strict=False)
    damaged = _set_aside_damaged(shard_dir, entries)
    index = root / INDEX
    text = index.read_text(encoding="utf-8") if index.exists() else ""
    rank_indexes = _index_files(root)[1:]
    if rank_indexes or text.count("\n") != len(entries) or (text and not text.endswith("\n")):
        write_text_atomic(index, "".join(json.dumps(e) + "\n" for e in entries.values()))
        fsync_dir(root)
        for p in rank_indexes:
            p.unlink(missing_ok=True)
    return damaged


def store_totals(entries: dict[str, dict[str, Any]]) -> dict[str, int]:
    """Samples, tokens, the longest sample, loss tokens, bytes and shards over index entries (each shard counted
    once)."""
    e = list(entries.values())
    return {"samples": sum(len(x["ids"]) for x in e), "tokens": sum(sum(x["lengths"]) for x in e),
            "longest_sample_tokens": max((max(x["lengths"], default=0) for x in e), default=0),
            "loss_tokens": sum(x["loss_tokens"] for x in e), "bytes": sum(x["bytes"] for x in e), "shards": len(e)}
