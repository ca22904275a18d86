"""The generate stage's engine (its entry: eagle3lib/stages/generate.py): the verifier answers every training prompt,
reasoning included, and the answers become the data.

The drafter learns to predict the verifier's own outputs, so each prompt (a conversation up to its last user turn) is
sent to the verifier's OpenAI-compatible server at high concurrency (`eagle3lib.vllm.client`), either endpoints that
already run (`verifier.server_url`, one URL or a list) or a local vLLM server this stage starts and stops. Several
servers share the concurrency, and one that goes down hands its prompts to the others (`eagle3lib.vllm.dispatch`).

Output: RUN_DIR/generate/shard-NNNNN.jsonl, one record per prompt and try (`eagle3lib.data.records`: format, readers).
- ok: a response with reasoning or content that ended by itself; truncated: cut off by max_tokens (finish_reason
  "length") or, with generate.stop_loops, by the server once it looped (finish_reason "repetition"); empty: ended
  with neither reasoning nor content; failed: no response (HTTP 4xx with the server's message, or retries exhausted).
  Only "ok" is training data by default (`iter_generated`).
- Resume: a re-run skips every prompt whose latest record is ok/truncated/empty and sends the rest, including those
  recorded failed (`retry_failed`, mostly transient: server down, timeouts). A retried prompt gets a new record and the
  latest record per id wins, so readers see every prompt exactly once. A torn last line (kill -9 mid-write) is ignored
  by readers and truncated by the next writer. Records made with other settings (dataset, sampling, model) are never
  mixed in: the folder's `generate_key.json` must match, or the stage refuses to resume. One writer at a time: a
  second run on the same folder stops at once (`records.ShardsLocked`). `prompt_ids.json` names the prompts of the
  latest run: a run with a lower max_samples leaves the other records in place, and extract leaves them out.
- A local server that dies mid-run is restarted (`generate.server_restarts` times) while the requests retry; a server
  that answers nothing is said on the console and, hung, stops the run (`eagle3lib.vllm.dispatch.StallWatch`).
- A run whose every prompt failed (e.g. each request refused with HTTP 400) is not complete: the stage fails with the
  count and the first error; when some failed, the summary line names the first error.
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
import time
from collections import deque
from collections.abc import Callable
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from eagle3lib.config.generate import GenerateConfig
from eagle3lib.config.verifier import VerifierConfig
from eagle3lib.core.async_run import run_coroutine
from eagle3lib.core.atomic import write_json_atomic
from eagle3lib.core.manifest import StageTimer, read_manifest, update_manifest
from eagle3lib.core.progress import progress_bar
from eagle3lib.data.datasets import Conversation, DatasetError
from eagle3lib.data.generate_figures import dataset_figures
from eagle3lib.data.loops import repetition_detection
from eagle3lib.data.multi_turn import resume_turn
from eagle3lib.data.prompt_set import Prompts, load_prompts
from eagle3lib.data.records import (
    FINAL_STATUSES,
    PROMPT_IDS_FILE,
    STATUSES,
    ReadStats,
    ShardWriter,
    latest_records,
    list_shards,
)
from eagle3lib.generation.records import GenerateError, make_record
from eagle3lib.generation.run_key import KEY_FILE, check_run_key, run_key
from eagle3lib.vllm.client import RetryPolicy, ServerDown, ServerUnreachable, chat_payload, chat_with_retries
from eagle3lib.vllm.dispatch import Lane, StallWatch, dispatch, shares
from eagle3lib.vllm.endpoint import Endpoint, ServerError, http_client, verifier_endpoint
from eagle3lib.vllm.server import VLLMServer, verifier_endpoint_for_stage

# ------------------------------------------------------------------------------------------------------------ figures


@dataclass
class RunStats:
    generated: int = 0  # records written by this invocation
    output_tokens: int = 0  # completion tokens of those records
    retries: int = 0
    server_restarts: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    by_status: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STATUSES, 0))
    lanes: list[Lane] = field(default_factory=list)  # the servers, with what each answered
    first_failure: str | None = None  # "prompt ID at shard:line: error" of this run's first failed record


# ---------------------------------------------------------------------------------------------------------- the run


async def _answer_all(pending: list[Conversation], endpoints: list[Endpoint], cfg: GenerateConfig, writer: ShardWriter,
                      stats: RunStats, server: VLLMServer | None, server_restarts: int) -> float:
    """Answer `pending` on every endpoint, each with its share of `cfg.concurrency` (eagle3lib/vllm/dispatch.py);
    returns the wall time. Raises ServerUnreachable to stop."""
    # /health is answered at once by a live server: the connect timeout bounds it as well
    policy = RetryPolicy(cfg.max_attempts, cfg.backoff_base_s, cfg.backoff_max_s, cfg.server_down_wait_s,
                         cfg.connect_timeout_s)
    failover = len(endpoints) > 1
    lanes = [Lane(_strip_secrets(e.base_url), n) for e, n in zip(endpoints, shares(cfg.concurrency, len(endpoints)),
                                                                   strict=True)]
    stats.lanes = lanes
    pbar = progress_bar(total=len(pending), desc="generate", unit="sample", mininterval=5.0, disable=not cfg.progress,
                        file=sys.stderr)
    t0 = time.monotonic()
    window: deque[tuple[float, int]] = deque([(t0, 0)])
    watch = StallWatch(lanes, cfg.stall_report_s, cfg.server_down_wait_s, cfg.connect_timeout_s,
                       lambda line: _say(f"generate: {line}"))

    def on_retry(_reason: str) -> None:
        stats.retries += 1

    async def send(lane: Lane, conv: Conversation):
        stats.in_flight += 1
        stats.max_in_flight = max(stats.max_in_flight, stats.in_flight)
        try:
            return await chat_with_retries(lane.http, request_payload(endpoints[0].model, conv, cfg), policy, on_retry,
                                           failover=failover, on_response=lambda: watch.answered(lane))
        finally:
            stats.in_flight -= 1

    def done(conv: Conversation, reply, _lane: Lane) -> None:
        rec = make_record(conv, reply.result, reply.error, reply.attempts, reply.reasoning_tokens)
        writer.write(rec)
        if rec["status"] == "failed" and stats.first_failure is None:
            stats.first_failure = f"prompt {conv.id} at {writer.path.name}:{writer.lines}: {rec['error']}"
        stats.generated += 1
        stats.output_tokens += rec["completion_tokens"]
        stats.by_status[rec["status"]] += 1
        now = time.monotonic()
        window.append((now, stats.output_tokens))
        while len(window) > 2 and now - window[0][0] > 30.0:  # tokens/s over the last ~30 s, like tqdm's rate
            window.popleft()
        (t_old, tok_old) = window[0]
        rate = (stats.output_tokens - tok_old) / (now - t_old) if now > t_old else 0.0
        pbar.update(1)
        down = sum(lane.down_since is not None for lane in lanes)
        pbar.set_postfix_str(f"{rate:,.0f} tok/s, failed {stats.by_status['failed']}"
                             + (f", {down}/{len(lanes)} servers down" if down else ""), refresh=False)

    async def watchdog() -> None:
        """Restart a local server that died (its requests are retrying meanwhile)."""
        while True:
            await asyncio.sleep(2.0)
            if server is not None and server.proc is not None and server.proc.poll() is not None:
                if stats.server_restarts >= server_restarts:
                    raise ServerError(f"local vLLM server exited (code {server.proc.returncode}) and "
                                      f"generate.server_restarts={server_restarts} are used up; see {server.log_path}")
                stats.server_restarts += 1
                tqdm.write(f"generate: local vLLM server exited (code {server.proc.returncode}); restarting "
                           f"({stats.server_restarts}/{server_restarts})", file=sys.stderr)
                restart = asyncio.ensure_future(asyncio.to_thread(server.start))  # same port; raises with the log tail
                try:
                    await asyncio.shield(restart)
                except asyncio.CancelledError:  # the run is stopping: let the start finish so that stop() catches it
                    await asyncio.wait([restart])
                    raise

    async with AsyncExitStack() as clients:
        for lane, e in zip(lanes, endpoints, strict=True):
            lane.http = await clients.enter_async_context(
                http_client(e, lane.share, cfg.request_timeout_s, cfg.connect_timeout_s, asynchronous=True))
        work = asyncio.create_task(dispatch(pending, lanes, send, done, cfg.server_down_wait_s, ServerDown))
        helpers = [asyncio.create_task(watch.run()), *([asyncio.create_task(watchdog())] if server is not None else [])]
        try:
            # the first failure (a dead or hung server, a bug) cancels everything else; finished records stay written
            waiting = {work, *helpers}
            while not work.done():
                finished, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                for t in finished:
                    if t.exception() is not None:
                        raise t.exception()
        finally:
            for t in [work, *helpers]:
                t.cancel()
            await asyncio.gather(work, *helpers, return_exceptions=True)
            pbar.close()
    return time.monotonic() - t0


def request_payload(model: str, conv: Conversation, cfg: GenerateConfig) -> dict[str, Any]:
    seed = None
    if cfg.request_seed:
        seed = int(hashlib.sha256(f"{cfg.seed}:{conv.id}".encode()).hexdigest()[:8], 16) & 0x7FFFFFFF
    payload = chat_payload(model, conv.messages, max_tokens=cfg.max_tokens or 1, temperature=cfg.temperature,
                           top_p=cfg.top_p, seed=seed, chat_template_kwargs=cfg.chat_template_kwargs or None)
    if conv.tools:  # the template renders the schemas (the tokens extraction renders too)
        payload["tools"] = conv.tools
        # "none": the answer comes back as the text the verifier wrote, calls included, which is what the drafter
        # must predict (a tool parser would re-render parsed calls, not necessarily token for token); vLLM renders
        # the schemas all the same. extra_body {"tool_choice": "auto"} asks for parsed calls instead.
        payload["tool_choice"] = "none"
    if cfg.max_tokens is None:
        payload.pop("max_tokens")  # the server's default: the rest of the context
    if cfg.stop_loops:
        payload["repetition_detection"] = repetition_detection()
    payload.update(cfg.extra_body)
    return payload


def _say(line: str) -> None:
    tqdm.write(line, file=sys.stderr)  # above the progress bar, which stays whole


def _one_line(text: str, limit: int = 400) -> str:
    """A server's message on one console line (vLLM's validation errors span several)."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _strip_secrets(url: str) -> str:
    u = httpx.URL(url)
    return str(u.copy_with(username=None, password=None, query=None))


def generate(cfg: GenerateConfig, verifier_cfg: VerifierConfig, out_dir: str | Path, *,
             manifest_params: dict[str, Any] | None = None,
             server_url: str | list[str] | None = None) -> dict[str, Any]:
    """Run the stage into `out_dir`: figures into manifest.json, records into shards. Returns {"figures", "outputs"}.

    `server_url` overrides `verifier.server_url` (tests, benchmarks): one URL or several; with neither, a local vLLM
    server is started.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    prompts = load_prompts(cfg, prompt_fits(cfg, verifier_cfg))  # bad input fails here, before a server is started
    if not prompts.items and not cfg.allow_empty:
        raise DatasetError(f"generate.dataset {cfg.dataset}: no prompt to answer ({prompts.load.records} records, "
                           f"{prompts.skipped_no_user_turn} without a user turn, {prompts.skipped_empty_user_turn} whose "
                           f"last user turn is empty, {prompts.skipped_too_long} too long for generate.max_tokens "
                           f"({cfg.max_tokens}) within verifier.max_model_len ({verifier_cfg.max_model_len}), "
                           f"{prompts.load.bad_records} bad); "
                           "set generate.allow_empty: true if that is intended")
    if prompts.load.bad_records:  # generate.on_bad_record skip: said before any request, counted in the manifest too
        reasons = ", ".join(f"{n} {r}" for r, n in sorted(prompts.load.bad_by_reason.items()))
        print(f"generate: skipped {prompts.load.bad_records} bad record(s) (generate.on_bad_record: skip): {reasons}; "
              f"the first: {_one_line(prompts.load.first_bad)}", file=sys.stderr)
    # The writer locks the folder (a second run on the same folder would duplicate work) and cuts a torn tail.
    with ShardWriter(out_dir, cfg.shard_records, cfg.fsync_interval_s) as writer:
        check_run_key(out_dir, run_key(cfg, verifier_cfg))
        write_json_atomic(out_dir / PROMPT_IDS_FILE, [c.id for c in prompts.items])
        previous = (read_manifest(out_dir) or {}).get("figures", {})
        timer = StageTimer(out_dir, manifest_params or {"generate": cfg.model_dump(mode="json")})
        t_start = time.monotonic()
        done_statuses = set(FINAL_STATUSES) | (set() if cfg.retry_failed else {"failed"})
        latest = latest_records(out_dir)
        pending = to_send(prompts, latest, done_statuses)
        stats = RunStats()
        figures: dict[str, Any] = {"concurrency": cfg.concurrency, "samples_resumed": len(prompts.items) - len(pending),
                                   "torn_bytes_repaired": writer.repaired_bytes, "turns": cfg.turns}
        wall = 0.0
        try:
            if pending:
                with _server(cfg, verifier_cfg, out_dir, server_url, figures) as (endpoints, server):
                    if len({e.model for e in endpoints}) > 1:
                        raise GenerateError("verifier.server_url: the servers serve different models ("
                                            + ", ".join(f"{e.base_url}: {e.model}" for e in endpoints) + ")")
                    figures["server_model"] = endpoints[0].model
                    figures["server_version"] = endpoints[0].info().get("server_version")
                    urls = [_strip_secrets(e.base_url) for e in endpoints]
                    figures["server_url"] = urls[0] if len(urls) == 1 else urls
                    while pending:  # turns "all": one round per turn, each from the previous round's answers
                        try:
                            wall += run_coroutine(_answer_all(pending, endpoints, cfg, writer, stats, server,
                                                              cfg.server_restarts))
                        except ServerUnreachable as e:  # the vLLM layer knows the wait, not the key that set it
                            raise ServerUnreachable(f"{e} [generate.server_down_wait_s]") from None
                        sent = {c.id for c in pending}
                        latest = latest_records(out_dir)
                        pending = [c for c in to_send(prompts, latest, done_statuses) if c.id in sent
                                   and latest[c.id][0].get("status") == "partial"]
        except BaseException as e:
            writer.sync()
            if stats.generated:
                figures.update(_run_figures(stats, wall or time.monotonic() - t_start))
            figures.update(dataset_figures(prompts, latest_records(out_dir)))
            update_manifest(out_dir, status="failed", error=f"{type(e).__name__}: {e}", figures=figures)
            raise
    read_stats = ReadStats()
    latest = latest_records(out_dir, read_stats)
    figures.update(dataset_figures(prompts, latest))
    figures["torn_lines_ignored"] = read_stats.torn_lines  # 0 unless a shard was damaged in the middle
    if read_stats.torn_lines:
        print(f"generate: {read_stats.torn_lines} unreadable line(s) in the shards ({', '.join(read_stats.torn_at)}) "
              "ignored: their prompts count as not answered and are answered again by the next run", file=sys.stderr)
    if stats.generated:
        figures.update(_run_figures(stats, wall))
    else:  # nothing left to do: keep the throughput figures of the run that did the work
        for k in ("wall_s", "samples_per_s", "output_tokens_per_s", "server_model", "server_version"):
            if k in previous:
                figures[k] = previous[k]
        figures.update({"samples_generated": 0, "retries": 0})
    if figures["samples_failed"]:
        figures["first_failure"] = _one_line(stats.first_failure or _first_failure(prompts, latest), 1000)
    shards = [p.name for p in list_shards(out_dir)]
    _print_summary(figures, stats)
    if figures["samples_total"] and figures["samples_failed"] == figures["samples_total"]:
        # nothing to train on: "complete" here would send the next stage on with no data (the server's verdict on
        # every request, e.g. max_tokens over its context, is in the first error)
        error = (f"every prompt failed ({figures['samples_failed']} of {figures['samples_total']}); the first: "
                 f"{figures['first_failure']}")
        update_manifest(out_dir, status="failed", error=f"GenerateError: {error}", figures=figures,
                        outputs={"shards": shards, "key": KEY_FILE})
        raise GenerateError(error)
    timer.finish(figures, {"shards": shards, "key": KEY_FILE})
    return {"figures": figures, "outputs": {"shards": shards}}


def _first_failure(prompts: Prompts, latest: dict[str, tuple[dict[str, Any], str]]) -> str:
    """The first failed prompt's error, in run order (a run that sent nothing: the records of earlier runs)."""
    for c in prompts.items:
        rec, at = latest.get(c.id, ({}, ""))
        if rec.get("status") == "failed":
            return f"prompt {c.id} at {at}: {rec.get('error')}"
    return "none recorded"


def prompt_fits(cfg: GenerateConfig, verifier_cfg: VerifierConfig) -> Callable[[Conversation], bool] | None:
    """Whether a prompt, rendered as the server will render it, leaves room for generate.max_tokens within
    verifier.max_model_len (vLLM refuses such a request: ShareGPT holds many prompts of thousands of tokens). None
    (no check) when the verifier's tokenizer is not on this machine or max_tokens is unset."""
    from eagle3lib.model.verifier import load_tokenizer, resolve_model

    if cfg.max_tokens is None:
        return None
    path = resolve_model(verifier_cfg.model)
    if not Path(path).is_dir():
        return None
    tok = load_tokenizer(path, verifier_cfg.trust_remote_code)
    budget = verifier_cfg.max_model_len - cfg.max_tokens

    def fits(conv: Conversation) -> bool:
        ids = tok.apply_chat_template(conv.messages, tools=conv.tools, add_generation_prompt=True, tokenize=True,
                                      return_dict=True, **(cfg.chat_template_kwargs or {}))["input_ids"]
        return len(ids) <= budget

    return fits


def to_send(prompts: Prompts, latest: dict[str, tuple[dict[str, Any], str]], done_statuses: set[str]) -> list[Conversation]:
    """The prompts to send now: those without a finished record; a conversation regenerated turn by turn continues
    at the turn after its latest answered one (or retries the turn that failed)."""
    out = []
    for c in prompts.items:
        rec = latest[c.id][0] if c.id in latest else None
        if rec is None:
            out.append(c)
        elif rec.get("status") not in done_statuses:
            turn = resume_turn(prompts.originals[c.id], rec) if c.id in prompts.originals else None
            out.append(turn or c)
    return out


@contextmanager
def _server(cfg: GenerateConfig, verifier_cfg: VerifierConfig, out_dir: Path, server_url, figures: dict[str, Any]):
    """(endpoints, the local server this stage started or None): `server_url` / `verifier.server_url` (running
    servers, each checked now: an unreachable one fails before any prompt is sent), the runner's shared server, or a
    local vLLM started for this stage."""
    urls = [server_url] if isinstance(server_url, str) else list(server_url or verifier_cfg.server_urls)
    if urls:
        figures["server_mode"] = "remote"
        yield [verifier_endpoint(verifier_cfg, cfg.connect_timeout_s, base_url=u) for u in urls], None
        return
    from eagle3lib.model.verifier import resolve_model

    with verifier_endpoint_for_stage(verifier_cfg, resolve_model(verifier_cfg.model), out_dir / "vllm.log",
                                     figures) as (endpoint, server):
        yield [endpoint], server


def _run_figures(stats: RunStats, wall: float) -> dict[str, Any]:
    return {
        "samples_generated": stats.generated,  # by this invocation (a resumed run did the rest earlier)
        "wall_s": round(wall, 2),  # this invocation's generation time (server start-up excluded: server_start_s)
        "samples_per_s": round(stats.generated / wall, 3) if wall > 0 else 0.0,
        "output_tokens_per_s": round(stats.output_tokens / wall, 1) if wall > 0 else 0.0,
        "retries": stats.retries,
        "max_in_flight": stats.max_in_flight,
        "server_restarts": stats.server_restarts,
        # per server: URL, share of the concurrency, prompts answered, prompts handed back when it went down
        "servers": [lane.row() for lane in stats.lanes],
        "failovers": sum(lane.handed_back for lane in stats.lanes),  # prompts moved to another server
    }


def _print_summary(f: dict[str, Any], stats: RunStats) -> None:
    print(f"generate: {f['samples_total']} prompts: {f['samples_ok']} ok, {f['samples_truncated']} truncated "
          f"({f['samples_looping']} answers loop to their end"
          + (f", {f['samples_stopped_looping']} ended by the server once they looped"
             if f.get("samples_stopped_looping") else "")
          + f"), {f['samples_empty']} empty, {f['samples_failed']} failed ({f['samples_resumed']} done before this run); "
          f"skipped {f['skipped_no_user_turn']} without a user turn, {f['skipped_empty_user_turn']} whose last user turn "
          f"is empty, {f['skipped_too_long']} too long for verifier.max_model_len, {f['bad_records']} bad records"
          + (f", {f['cut_records']} cut record at the end of the file" if f.get("cut_records") else "")
          + (f"; the first of the {f['samples_failed']} failed: {_one_line(f['first_failure'])}"
             if f["samples_failed"] else ""))
    if stats.generated:
        print(f"generate: this run {stats.generated} samples, {stats.output_tokens:,} output tokens in {f['wall_s']:.1f} s "
              f"= {f['samples_per_s']:.2f} samples/s, {f['output_tokens_per_s']:,.0f} tokens/s at concurrency "
              f"{f['concurrency']} ({stats.retries} retries)")
