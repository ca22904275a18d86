"""The generate stage's records: one JSON object per line in append-only shards `shard-00000.jsonl`, `shard-00001.jsonl`...

Record: {"id", "category", "status": "ok"|"truncated"|"empty"|"failed",
         "messages": [prompt messages..., {"role": "assistant", "content", "reasoning_content"}],  # assistant turn only
                                                                                                 # when a response came
         "finish_reason", "prompt_tokens", "completion_tokens", "error", "attempts", "reasoning_tokens",
         "answer_token_ids": the last assistant turn's tokens as generated (vLLM's return_token_ids), when the server
         returned them, "prompt_token_ids": the prompt of that turn as the server tokenized it (likewise)}
Only "ok" is training data by default (`iter_generated`); the latest record per id wins (a retried failure replaces
its first try), so readers see every prompt exactly once.

Crash safety without rewriting files: a record is appended as one whole line by a single `write()` on an O_APPEND file,
so a `kill -9` leaves at worst a torn *last* line (power loss: whatever the last fsync did not cover). Readers ignore a
last line without its trailing newline and any line that does not parse; a writer re-opening the folder first truncates
such a torn tail, so new records never get glued onto half of an old one. Records are never edited in place. One
writer per folder at a time, enforced with a lock file (`.writer.lock`, released by the kernel when the writer dies,
even by kill -9).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle3lib.core.atomic import write_error
from eagle3lib.data.datasets import Conversation

# partial: an answered turn of a conversation regenerated turn by turn (generate.turns: all) that has more to come;
# never training data, and the next run continues from it
STATUSES = ("ok", "truncated", "empty", "failed", "partial")
FINAL_STATUSES = ("ok", "truncated", "empty")  # outcomes of the model itself: asking again gives the same kind of answer
SHARD_RE = re.compile(r"^shard-(\d{5,})\.jsonl$")
LOCK_FILE = ".writer.lock"
# the ids of the prompts the latest generate run selected (generate.max_samples of them): a folder can hold records of
# more prompts, answered before max_samples was lowered, and those are not this run's data
PROMPT_IDS_FILE = "prompt_ids.json"


class ShardsLocked(RuntimeError):
    """Another process is appending to this folder."""


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.jsonl"


def list_shards(folder: str | Path) -> list[Path]:
    """Shards in write order (by number)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := SHARD_RE.match(p.name))]
    return [p for _, p in sorted(found)]


@dataclass
class ReadStats:
    records: int = 0  # lines that parsed into a JSON object
    torn_lines: int = 0  # lines ignored: a last line without newline, or unparseable/non-object lines
    torn_at: list[str] = field(default_factory=list)  # "shard-NNNNN.jsonl:line" of the first few

    def torn(self, path: Path, line: int) -> None:
        self.torn_lines += 1
        if len(self.torn_at) < 5:
            self.torn_at.append(f"{path.name}:{line}")


def iter_records(folder: str | Path, stats: ReadStats | None = None) -> Iterator[tuple[Path, int, dict[str, Any]]]:
    """(shard, line number from 1, record) for every complete record of every shard, in write order (duplicates too)."""
    stats = stats if stats is not None else ReadStats()
    for path in list_shards(folder):
        with open(path, "rb") as f:
            for line_no, raw in enumerate(f, 1):
                if not raw.endswith(b"\n"):  # torn tail: the writer died mid-line
                    stats.torn(path, line_no)
                    break
                if not raw.strip():
                    continue
                try:
                    rec = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError):
                    stats.torn(path, line_no)
                    continue
                if not isinstance(rec, dict):
                    stats.torn(path, line_no)
                    continue
                stats.records += 1
                yield path, line_no, rec


def _repair_tail(path: Path) -> tuple[int, int]:
    """Truncate a torn last line (no trailing newline, or not JSON). Returns (complete lines kept, bytes dropped).

    Streams the file (one line in memory at a time): shards of long reasoning traces run to hundreds of MB.
    """
    lines, offset, last_start, last = 0, 0, 0, b""
    with open(path, "rb") as f:
        for raw in f:
            last_start, last = offset, raw
            offset += len(raw)
            lines += 1
    size = offset
    torn = bool(last) and not last.endswith(b"\n")
    if not torn and last.strip():
        try:  # a complete-looking last line that does not parse is torn too (e.g. zero-filled after a power loss)
            json.loads(last)
        except (json.JSONDecodeError, UnicodeDecodeError):
            torn = True
    if torn:
        with open(path, "r+b") as f:
            f.truncate(last_start)
            f.flush()
            os.fsync(f.fileno())
        return lines - 1, size - last_start
    return lines, 0


class ShardWriter:
    """Appends JSON records to the folder's shards, rolling to a new shard every `records_per_shard` lines.

    Opening continues the last shard after repairing its tail. Every record is one `write()` of a whole line (flushed to
    the OS at once, so a killed process loses nothing it wrote); fsync runs at most every `fsync_interval_s` and on close.
    """

    def __init__(self, folder: str | Path, records_per_shard: int, fsync_interval_s: float = 1.0):
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.folder / LOCK_FILE, "a+")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.seek(0)
            holder = self._lock.read().strip() or "another process"
            self._lock.close()
            raise ShardsLocked(f"{self.folder} is being written by {holder}; one writer per folder at a time") from None
        self._lock.seek(0)
        self._lock.truncate()
        self._lock.write(f"pid {os.getpid()}\n")
        self._lock.flush()
        self.records_per_shard = records_per_shard
        self.fsync_interval_s = fsync_interval_s
        self.repaired_bytes = 0
        shards = list_shards(self.folder)
        if shards:
            self.index = int(SHARD_RE.match(shards[-1].name).group(1))
            self.lines, self.repaired_bytes = _repair_tail(shards[-1])
        else:
            self.index, self.lines = 0, 0
        self._fd: int | None = None
        self._last_sync = time.monotonic()

    @property
    def path(self) -> Path:
        return self.folder / shard_name(self.index)

    def _open(self) -> int:
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        return self._fd

    def write(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode()
        if self.lines >= self.records_per_shard:
            self._close_current()
            self.index += 1
            self.lines = 0
        fd = self._open()
        view = memoryview(line)
        try:
            while view:  # a regular-file write is whole in practice; loop for the partial-write contract anyway
                n = os.write(fd, view)
                view = view[n:]
        except OSError as e:  # disk full: what was written stays; a torn tail is cut by the next writer
            raise OSError(e.errno, f"{self.path}: cannot append a record ({write_error(self.path, e)}); the records "
                                   "written so far are kept and a re-run resumes after them") from None
        self.lines += 1
        if time.monotonic() - self._last_sync >= self.fsync_interval_s:
            self.sync()

    def sync(self) -> None:
        if self._fd is not None:
            os.fsync(self._fd)
        self._last_sync = time.monotonic()

    def _close_current(self) -> None:
        if self._fd is not None:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        self._close_current()
        if not self._lock.closed:
            self._lock.close()  # releases the lock

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------------- readers


def latest_records(gen_dir: str | Path, stats: ReadStats | None = None) -> dict[str, tuple[dict[str, Any], str]]:
    """id -> (its latest record, "shard-NNNNN.jsonl:line"), in order of first appearance; torn lines ignored."""
    out: dict[str, tuple[dict[str, Any], str]] = {}
    for path, line, rec in iter_records(gen_dir, stats):
        if isinstance(rec.get("id"), str):
            out[rec["id"]] = (rec, f"{path.name}:{line}")
    return out


def selected_prompt_ids(gen_dir: str | Path) -> set[str] | None:
    """The ids of the prompts the latest generate run selected; None for folders written before generate kept them."""
    path = Path(gen_dir) / PROMPT_IDS_FILE
    return set(json.loads(path.read_text())) if path.is_file() else None


def iter_generated(gen_dir: str | Path, statuses: Iterable[str] | None = ("ok",),
                   stats: ReadStats | None = None) -> Iterator[Conversation]:
    """The generated conversations (prompt + the verifier's assistant turn with `reasoning_content`), one per prompt id.

    Records are de-duplicated by id (the latest wins: a retried failure replaces its first try), torn lines ignored.
    `statuses=None` yields every status; a failed record has no assistant turn. `extra` holds status, finish_reason,
    prompt_tokens, completion_tokens, attempts, error, answer_token_ids (the last answer's generated ids, or None) and
    prompt_token_ids (its prompt as the server tokenized it, or None); `source` is "shard-NNNNN.jsonl:line".
    """
    wanted = None if statuses is None else set(statuses)
    if wanted is not None and (unknown := wanted - set(STATUSES)):
        raise ValueError(f"unknown status(es) {sorted(unknown)}; statuses are {STATUSES}")
    for rec, source in latest_records(gen_dir, stats).values():
        if wanted is not None and rec.get("status") not in wanted:
            continue
        extra = {k: rec.get(k) for k in ("status", "finish_reason", "prompt_tokens", "completion_tokens", "reasoning_tokens",
                                         "attempts", "error", "answer_token_ids", "prompt_token_ids")}
        yield Conversation(rec["id"], rec.get("messages") or [], rec.get("category"), f"{Path(gen_dir) / source}", extra,
                           rec.get("tools"))
