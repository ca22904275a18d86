"""Spreading prompts over several OpenAI-compatible servers, each answered exactly once.

Every server ("lane") runs `share` workers, so it never has more than its share of the concurrency in flight (a
server's batch is what it can hold; a fast server does not soak up a slow one's share, it simply finishes its own
prompts sooner and takes more of them from the shared queue). A prompt belongs to one worker at a time, and only the
worker that got its answer records it, so nothing is answered twice:

- One server: requests retry per `eagle3lib.vllm.client` (a server that is down is waited for, up to
  the caller's wait: generate.server_down_wait_s), exactly as without this module.
- Several servers: a refused connection (or no answer at all, not even to /health: a hung server) means that
  server is down. Its worker puts the prompt back at the head of
  the queue (another server answers it), and the lane's workers stop taking prompts and probe its /health every few
  seconds; a server that comes back (restarted by its operator) takes prompts again. Requests that die mid-flight
  (the connection dropped) are retried on the same server first, and move as soon as it refuses connections. When
  every server has been down for server_down_wait_s, the run stops with ServerUnreachable (and resumes later).

vLLM's own `--data-parallel-size` is the other way to use several GPUs groups behind one URL: it needs none of this.

A server that answers nothing (`StallWatch`): one stopped with SIGSTOP (or deadlocked) still accepts connections (the
kernel completes the handshake), so no request fails or times out before the read timeout, hours for reasoning
models: a generate run once printed nothing for 12 minutes while its prompts were recorded failed one by one. The
watch keeps, per server, when it last answered (any HTTP response, an error status included) and, while requests are
in flight, says so every `report_s` of silence; after `stop_s` of silence with no other server answering, it asks
each silent one's /health: when none answers, ServerUnreachable names them (the caller's run stops, resumable). A
server whose /health answers is alive and busy (long reasoning): it is waited for. Read timeouts from a hung server
are kept from using up the prompts' attempts by the client (eagle3lib/vllm/client.py).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx

from eagle3lib.vllm.client import ServerUnreachable, answers_health

PROBE_S = 2.0  # how often a down server's /health is asked


@dataclass
class Lane:
    """One server and what it did in this run (the manifest's `servers` rows)."""

    url: str  # its base URL, credentials stripped
    share: int  # requests it may have in flight: its part of generate.concurrency
    http: httpx.AsyncClient | None = None
    answered: int = 0  # prompts whose answer came from this server
    handed_back: int = 0  # prompts it was holding when it went down, answered elsewhere
    outages: int = 0  # times it was found down
    in_flight: int = 0
    max_in_flight: int = 0
    down_since: float | None = None

    def row(self) -> dict[str, Any]:
        return {"url": self.url, "share": self.share, "answered": self.answered, "handed_back": self.handed_back,
                "outages": self.outages, "max_in_flight": self.max_in_flight}


def shares(concurrency: int, n: int) -> list[int]:
    """`concurrency` split over n servers as evenly as possible, at least one each."""
    return [max(1, concurrency // n + (1 if i < concurrency % n else 0)) for i in range(n)]


async def _probe(lane: Lane) -> bool:
    try:
        r = await lane.http.get("/health", timeout=5.0)
    except httpx.HTTPError:
        return False
    return r.status_code == 200


async def dispatch(items: list[Any], lanes: list[Lane], send: Callable[[Lane, Any], Awaitable[Any]],
                   done: Callable[[Any, Any, Lane], None], down_wait_s: float, is_down: type[Exception]) -> None:
    """Answer every item: `send(lane, item)` returns the answer or raises `is_down` (the server refused the
    connection); `done(item, answer, lane)` records it, once per item. Raises ServerUnreachable when every server has
    been down for `down_wait_s`, and the first other error of a worker (the caller cancels the rest)."""
    queue = deque(items)
    left = len(items)
    wake = asyncio.Event()  # set when a prompt is handed back or the last one is answered

    def all_down_too_long() -> bool:
        since = [lane.down_since for lane in lanes]
        return all(s is not None for s in since) and time.monotonic() - max(since) >= down_wait_s

    async def worker(lane: Lane) -> None:
        nonlocal left
        while left:
            if lane.down_since is not None:
                if all_down_too_long():
                    raise ServerUnreachable(f"every verifier server ({', '.join(x.url for x in lanes)}) refused "
                                            f"connections or answered nothing for {down_wait_s:g} s (the wait allowed)")
                await asyncio.sleep(PROBE_S)
                if lane.down_since is not None and await _probe(lane):
                    lane.down_since = None  # back: take prompts again
                continue
            if not queue:
                wake.clear()
                try:
                    await asyncio.wait_for(wake.wait(), PROBE_S)  # a down server may still hand prompts back
                except TimeoutError:
                    pass
                continue
            item = queue.popleft()
            lane.in_flight += 1
            lane.max_in_flight = max(lane.max_in_flight, lane.in_flight)
            try:
                answer = await send(lane, item)
            except is_down:
                queue.appendleft(item)  # nobody recorded it: the next free worker of a live server takes it
                lane.handed_back += 1
                if lane.down_since is None:
                    lane.down_since = time.monotonic()
                    lane.outages += 1
                wake.set()
                continue
            finally:
                lane.in_flight -= 1
            done(item, answer, lane)
            lane.answered += 1
            left -= 1
            if not left:
                wake.set()

    workers = [asyncio.create_task(worker(lane)) for lane in lanes for _ in range(lane.share)]
    try:
        for finished in asyncio.as_completed(workers):
            await finished  # the first failure raises here
    finally:
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)


class StallWatch:
    """Silence per server (module doc): `answered(lane)` on every HTTP response, `run()` beside the requests; `say`
    gets each console line, without the caller's prefix."""

    def __init__(self, lanes: list[Lane], report_s: float, stop_s: float, health_timeout_s: float,
                 say: Callable[[str], None]):
        self.lanes, self.report_s, self.health_timeout_s, self.say = lanes, report_s, health_timeout_s, say
        self._check_after = max(stop_s, report_s)  # a stop is said on the console first, even with stop_s 0
        now = time.monotonic()
        self._heard = {lane.url: now for lane in lanes}
        self._next_report = {lane.url: report_s for lane in lanes}  # silence at which the next console line is due
        self._next_check = {lane.url: self._check_after for lane in lanes}  # silence at which /health is asked next

    def answered(self, lane: Lane) -> None:
        self._heard[lane.url] = time.monotonic()
        self._next_report[lane.url], self._next_check[lane.url] = self.report_s, self._check_after

    def _silence(self, lane: Lane, now: float) -> float:
        if not lane.in_flight:  # nothing awaited from it: idle, not silent
            self.answered(lane)
        return now - self._heard[lane.url]

    async def run(self) -> None:
        """Until cancelled; raises ServerUnreachable to stop the run."""
        poll_s = max(0.2, min(2.0, self.report_s / 4))
        while True:
            await asyncio.sleep(poll_s)
            now = time.monotonic()
            silence = {lane.url: self._silence(lane, now) for lane in self.lanes}
            for lane in self.lanes:
                s = silence[lane.url]
                if s >= self._next_report[lane.url]:
                    self._next_report[lane.url] = s + self.report_s
                    self.say(f"no answer completed for {s:.0f} s ({lane.in_flight} in flight); the server at "
                             f"{lane.url} may be hung")
            silent = [lane for lane in self.lanes if lane.in_flight and silence[lane.url] >= self._next_check[lane.url]]
            # another server still answering carries the run; a hung one's requests move when they time out
            if not silent or any(lane.in_flight and silence[lane.url] < self._check_after and lane.down_since is None
                                 for lane in self.lanes):
                continue
            alive = await asyncio.gather(*(answers_health(lane.http, self.health_timeout_s) for lane in silent))
            if not any(alive):
                raise ServerUnreachable(
                    "; ".join(f"verifier server {lane.url} answered nothing for {silence[lane.url]:.0f} s with "
                              f"{lane.in_flight} requests in flight, nor /health" for lane in silent)
                    + ": hung (stopped? deadlocked?) or down. The answers so far are kept: check the server, then "
                    "re-run to resume")
            for lane, ok in zip(silent, alive, strict=True):  # asked again after as long a silence
                self._next_check[lane.url] = silence[lane.url] + self._check_after
                if ok:
                    self.say(f"the server at {lane.url} answers /health but no request for "
                             f"{silence[lane.url]:.0f} s: answers longer than that (long reasoning?); waiting")
