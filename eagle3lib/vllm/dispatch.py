"""Spreading prompts over several OpenAI-compatible servers, each answered exactly once.

Every server ("lane") runs `share` workers, so it never has more than its share of the concurrency in flight (a
server's batch is what it can hold; a fast server does not soak up a slow one's share, it simply finishes its own
prompts sooner and takes more of them from the shared queue). A prompt belongs to one worker at a time, and only the
worker that got its answer records it, so nothing is answered twice:

- One server: requests retry per `eagle3lib.vllm.client` (a server that is down is waited for, up to
  the caller's wait: generate.server_down_wait_s), exactly as without this module.
- Several servers: a refused connection means that server is down. Its worker puts the prompt back at the head of
  the queue (another server answers it), and the lane's workers stop taking prompts and probe its /health every few
  seconds; a server that comes back (restarted by its operator) takes prompts again. Requests that die mid-flight
  (the connection dropped) are retried on the same server first, and move as soon as it refuses connections. When
  every server has been down for server_down_wait_s, the run stops with ServerUnreachable (and resumes later).

vLLM's own `--data-parallel-size` is the other way to use several GPUs groups behind one URL: it needs none of this.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx

from eagle3lib.vllm.client import ServerUnreachable

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
                                            f"connections for {down_wait_s:g} s (the wait allowed)")
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
