"""The parameter reference: every key of every profile section with its type, default, allowed range and the `# why`
comment written beside the field, read from the config classes themselves, so the documentation cannot drift from
the code (docs/hooks.py renders it into the site; tests/test_docs.py checks it lists every key).

The comment is the text after `#` on the field's last line, plus the comment lines right below it (a long why wraps
onto `    # ...` lines before the next field).
"""

from __future__ import annotations

import ast
import inspect
import json
import textwrap
from dataclasses import dataclass
from typing import Any, get_args

from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen
from pydantic import BaseModel

from eagle3lib.config.profile import SECTIONS, section_class


@dataclass
class Param:
    key: str  # the field's name
    type: str  # its annotation as written
    default: str  # repr of the default ("required" when none)
    range: str  # bounds from Field(...), e.g. "> 0", ">= 1, <= 8"
    why: str  # the comment beside the field


def field_comments(cls: type) -> dict[str, tuple[str, str]]:
    """field name -> (annotation as written in the source, its comment) for the fields a class declares itself."""
    src = textwrap.dedent(inspect.getsource(cls))
    lines = src.splitlines()
    out: dict[str, tuple[str, str]] = {}
    body = ast.parse(src).body[0].body
    for node in body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        last = lines[node.end_lineno - 1]
        words = [last.split("#", 1)[1].strip()] if "#" in last and _comment_starts(last) else []
        j = node.end_lineno
        while j < len(lines) and lines[j].strip().startswith("#"):
            words.append(lines[j].strip()[1:].strip())
            j += 1
        out[node.target.id] = (ast.get_source_segment(src, node.annotation) or "", " ".join(w for w in words if w))
    return out


def _comment_starts(line: str) -> bool:
    """True when the line's `#` begins a comment, not a character inside a string."""
    code, quote = line, None
    for ch in code:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch == "#":
            return True
    return False


def _range(metadata: list[Any]) -> str:
    parts = []
    for m in metadata:
        for kind, attr, sym in ((Gt, "gt", ">"), (Ge, "ge", ">="), (Lt, "lt", "<"), (Le, "le", "<=")):
            if isinstance(m, kind):
                parts.append(f"{sym} {getattr(m, attr)}")
        if isinstance(m, MinLen):
            parts.append(f"at least {m.min_length} items")
        if isinstance(m, MaxLen):
            parts.append(f"at most {m.max_length} items")
    return ", ".join(parts)


def _default(info: Any) -> str:
    if info.is_required():
        return "required"
    return _yaml(info.get_default(call_default_factory=True))


def _yaml(value: Any) -> str:
    """A value as it is written in a profile (one line)."""
    return json.dumps(_plain(value), ensure_ascii=False)


def _plain(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def params_of(cls: type[BaseModel]) -> list[Param]:
    """The fields of a config class in declaration order (inherited ones included, each with its own comment)."""
    comments: dict[str, tuple[str, str]] = {}
    for base in reversed(cls.__mro__):
        if isinstance(base, type) and issubclass(base, BaseModel) and base.__module__.startswith("eagle3lib"):
            comments.update(field_comments(base))
    out = []
    for name, info in cls.model_fields.items():
        written, why = comments.get(name, ("", ""))
        out.append(Param(name, written or str(info.annotation), _default(info), _range(info.metadata), why))
    return out


def nested_models(cls: type[BaseModel]) -> list[type[BaseModel]]:
    """Config classes used inside a section's fields (a list of ReferencePoint, say): documented below it."""
    found: list[type[BaseModel]] = []

    def visit(tp: Any) -> None:
        if isinstance(tp, type) and issubclass(tp, BaseModel) and tp not in found:
            found.append(tp)
        for arg in get_args(tp):
            visit(arg)

    for info in cls.model_fields.values():
        visit(info.annotation)
    return found


def reference() -> dict[str, list[Param]]:
    """section -> its parameters, for every section a profile can hold."""
    return {section: params_of(section_class(section)) for section in SECTIONS}


def _cell(text: str) -> str:
    """Table-safe: a pipe would end the cell, and `<think>` would be read as an HTML tag."""
    return text.replace("|", "\\|").replace("\n", " ").replace("<", "&lt;").replace(">", "&gt;")


def _code(text: str) -> str:
    """Inline code inside a table cell: HTML, so that a union's pipe (`str | None`) shows as a pipe (an escaped pipe in
    a Markdown code span keeps its backslash), and `<think>` as text."""
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "&#124;")
    return f"<code>{text.replace(chr(10), ' ')}</code>"


def markdown(profile_values: dict[str, dict[str, dict[str, Any]]] | None = None) -> str:
    """The reference as Markdown: one table per section (and per nested model), a column per shipped profile with
    the value it sets where it differs from the default."""
    out = []
    for section in SECTIONS:
        cls = section_class(section)
        doc = inspect.cleandoc(cls.__dict__.get("__doc__") or inspect.getmodule(cls).__doc__ or "")
        out += [f"## `{section}`", "", doc.split("\n\n")[0].replace("\n", " "), "", section_markdown(section, profile_values)]
    return "\n".join(out)


def section_markdown(section: str, profile_values: dict[str, dict[str, dict[str, Any]]] | None = None) -> str:
    """One section's table (and its nested models'), with a column per profile that sets a key of it."""
    profile_values = profile_values or {}
    cls = section_class(section)
    names = sorted(n for n, v in profile_values.items() if v.get(section))
    out = _table(params_of(cls), section, names, profile_values)
    for sub in nested_models(cls):
        out += [f"**{sub.__name__}** (an item of a `{section}` list)", ""]
        out += _table(params_of(sub), None, [], {})
    return "\n".join(out) + "\n"


def _table(params: list[Param], section: str | None, names: list[str], values: dict) -> list[str]:
    """key, type (and range), default and why side by side, readable at 1280 px; the shipped profiles that set a key
    come last, in one cell ("tiny: 8; kimi-k2.5: 64"), instead of a column each."""
    head = ["key", "type", "default", "why", *(["set by the shipped profiles"] if names else [])]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for p in params:
        shipped = []
        for n in names:
            v = values[n].get(section or "", {}).get(p.key, ...)
            if v is not ...:
                shipped.append(f"{n}: {_code(_yaml(v))}")
        kind = _code(p.type) + (f" ({_cell(p.range)})" if p.range else "")
        cells = [f"`{p.key}`", kind, _code(p.default), _cell(p.why), *(["; ".join(shipped)] if names else [])]
        rows.append("| " + " | ".join(cells) + " |")
    return [*rows, ""]
