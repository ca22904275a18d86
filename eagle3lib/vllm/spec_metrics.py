"""vLLM's speculative-decoding counters on its Prometheus `/metrics` endpoint, and the acceptance they imply.

Exported names (vllm 0.32, checked against a live server; Prometheus adds `_total` to counters), one series per engine:
  vllm:spec_decode_num_drafts_total                     rounds that verified a draft (prefill steps are not rounds)
  vllm:spec_decode_num_draft_tokens_total               draft tokens proposed (K per round)
  vllm:spec_decode_num_accepted_tokens_total            draft tokens accepted
  vllm:spec_decode_num_accepted_tokens_per_pos_total{position="i"}   rounds that accepted more than i drafts
Counters only grow: a measurement is the difference of two snapshots. tau = 1 + accepted / drafts (the bonus or
correction token of each round included), and accept_rate_pos_{i+1} = accepted_per_pos[i] / drafts.
Beside them, two counters that say whose requests moved them: vllm:request_success_total (finished requests, summed
over finish reasons) and vllm:prompt_tokens_total. A measurement that sent n requests with P prompt tokens between
two snapshots, on a server nobody else uses, sees exactly n and P; more means other traffic shared the counters.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import httpx

PREFIX = "vllm:spec_decode_"
_LINE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)")
_POS = re.compile(r'position="(\d+)"')


class MetricsError(RuntimeError):
    pass


@dataclass
class SpecCounters:
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    accepted_per_pos: list[float] = field(default_factory=list)
    requests: float = 0.0  # finished requests (vllm:request_success_total), any client's
    prompt_tokens: float = 0.0  # vllm:prompt_tokens_total, any client's

    def __sub__(self, before: SpecCounters) -> SpecCounters:
        n = max(len(self.accepted_per_pos), len(before.accepted_per_pos))
        a = self.accepted_per_pos + [0.0] * (n - len(self.accepted_per_pos))
        b = before.accepted_per_pos + [0.0] * (n - len(before.accepted_per_pos))
        return SpecCounters(self.drafts - before.drafts, self.draft_tokens - before.draft_tokens,
                            self.accepted - before.accepted, [x - y for x, y in zip(a, b, strict=True)],
                            self.requests - before.requests, self.prompt_tokens - before.prompt_tokens)

    def __add__(self, other: SpecCounters) -> SpecCounters:
        return self - SpecCounters(-other.drafts, -other.draft_tokens, -other.accepted,
                                   [-x for x in other.accepted_per_pos], -other.requests, -other.prompt_tokens)

    def summary(self) -> dict[str, Any]:
        d = self.drafts
        return {
            "rounds": int(d),
            "draft_tokens": int(self.draft_tokens),
            "accepted": int(self.accepted),
            "tau": 1.0 + self.accepted / d if d else None,
            "accepted_per_pos": [int(x) for x in self.accepted_per_pos],
            "accept_rate_pos": [x / d if d else None for x in self.accepted_per_pos],
        }


def parse_metrics(text: str) -> SpecCounters | None:
    """The spec-decode counters summed over engines; None when the server exports none (no speculator configured)."""
    c = SpecCounters()
    per_pos: dict[int, float] = {}
    found = False
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        if m.group("name") == "vllm:request_success_total":
            c.requests += float(m.group("value"))
            continue
        if m.group("name") == "vllm:prompt_tokens_total":
            c.prompt_tokens += float(m.group("value"))
            continue
        if not line.startswith(PREFIX):
            continue
        name, value = m.group("name")[len(PREFIX):], float(m.group("value"))
        if name == "num_drafts_total":
            c.drafts += value
        elif name == "num_draft_tokens_total":
            c.draft_tokens += value
        elif name == "num_accepted_tokens_total":
            c.accepted += value
        elif name == "num_accepted_tokens_per_pos_total":
            pos = _POS.search(m.group("labels") or "")
            if pos:
                per_pos[int(pos.group(1))] = per_pos.get(int(pos.group(1)), 0.0) + value
        else:
            continue
        found = True
    if not found:
        return None
    c.accepted_per_pos = [per_pos.get(i, 0.0) for i in range(max(per_pos) + 1)] if per_pos else []
    return c


def fetch_counters(base_url: str, headers: dict[str, str] | None = None, timeout_s: float = 10.0) -> SpecCounters:
    """Snapshot of a server's counters; raises MetricsError naming the URL when /metrics fails or has none."""
    url = f"{base_url}/metrics"
    try:
        r = httpx.get(url, headers=headers or {}, timeout=timeout_s)
    except httpx.HTTPError as e:
        raise MetricsError(f"cannot read {url}: {type(e).__name__}: {e}") from e
    if r.status_code != 200:
        raise MetricsError(f"{url} answered HTTP {r.status_code}: {r.text[:200]}")
    c = parse_metrics(r.text)
    if c is None:
        raise MetricsError(f"{url} has no {PREFIX}* counters: the server runs without a speculator "
                           "(start it with --speculative-config)")
    return c
