"""MkDocs hook (mkdocs.yml `hooks:`): replaces `<!-- parameters -->` with the whole parameter reference and
`<!-- parameters: SECTION -->` with one section's table, generated from the config classes at build time
(eagle3lib/config/reference.py), with the shipped profiles' values beside the defaults."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from eagle3lib.config.reference import markdown, section_markdown

PARAMS = Path(__file__).resolve().parent.parent / "params"
ONE = re.compile(r"<!-- parameters: (\w+) -->")


def _profiles() -> dict:
    out = {}
    for p in sorted(PARAMS.glob("*.yaml")):
        raw = yaml.safe_load(p.read_text())
        if isinstance(raw, dict) and "hardware" not in p.stem:
            out[p.stem] = {k: v for k, v in raw.items() if isinstance(v, dict)}
    return out


def on_page_markdown(text: str, **_kw) -> str:
    if "<!-- parameters" not in text:
        return text
    profiles = _profiles()
    text = text.replace("<!-- parameters -->", markdown(profiles))
    return ONE.sub(lambda m: section_markdown(m.group(1), profiles), text)
