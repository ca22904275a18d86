"""Run a coroutine to completion from synchronous code, including inside a Jupyter kernel (which already runs a loop)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any


def run_coroutine(coro):
    """asyncio.run, also from inside a running event loop (a Jupyter kernel has one): then in a thread of its own.

    An interrupt of the waiting thread (Jupyter's stop button) cancels the coroutine and waits for it to unwind, so the
    shard writer is closed and no request is left running.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    loop = asyncio.new_event_loop()
    task = loop.create_task(coro)
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["value"] = loop.run_until_complete(task)
        except BaseException as e:  # re-raised in the calling thread
            out["error"] = e
        finally:
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    thread = threading.Thread(target=target, name="async-run", daemon=True)
    thread.start()
    try:
        while thread.is_alive():
            thread.join(0.5)
    except BaseException:
        loop.call_soon_threadsafe(task.cancel)
        thread.join()
        raise
    if "error" in out:
        raise out["error"]
    return out["value"]
