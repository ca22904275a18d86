"""The extract stage: verifier hidden states for drafter training, into a sharded store (eagle3lib.data.hidden_store).

Input: the generate stage's responses (`source: generate`, status "ok" only) or, prefill-only, a conversation dataset.
Each conversation is rendered with the verifier's chat template (loss mask on the assistant tokens, eagle3lib.data.chat_tokens),
then one of two backends computes, per token, the hidden states entering the 3 EAGLE-3 feature layers and the final
hidden state before the verifier's last norm:
  hf    transformers with forward hooks on just those layers (CPU or GPU, device_map for multi-GPU verifiers)
  vllm  vLLM's extract_hidden_states method with eagle3lib's KV connector (tensor parallel verifiers)
Both give the same tensors within dtype tolerance (tests/test_extract_backends.py).

Before starting it prints the disk estimate (tokens x bytes per token) and refuses if the output disk lacks room.
Re-running resumes after the last complete shard: samples already stored are not extracted again.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from eagle3lib.core.manifest import StageTimer, read_manifest
from eagle3lib.data.chat_tokens import ChatTokenizer, Tokenized, TokenizeStats
from eagle3lib.data.datasets import Conversation, DatasetError, load_conversations
from eagle3lib.data.hidden_store import (
    HiddenSample,
    HiddenStateWriter,
    bytes_per_token,
)
from eagle3lib.data.records import ReadStats, iter_generated
from eagle3lib.model.verifier import describe_model, load_tokenizer, resolve_model, verifier_facts

GIB = 1024**3


class ExtractError(ValueError):
    """Bad input for the extract stage: the message names what is wrong."""


class InsufficientDiskError(ExtractError):
    pass


def _say(msg: str) -> None:
    print(f"[extract] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------------- input


def load_source(source: str, gen_dir: Path | None, max_samples: int | None = None,
                on_bad_record: str = "error", read: ReadStats | None = None) -> tuple[list[Conversation], str]:
    """(conversations, description of where they came from). `read` counts unreadable lines of generate shards."""
    if source == "generate":
        if gen_dir is None or not gen_dir.is_dir() or not any(gen_dir.glob("shard-*.jsonl")):
            raise ExtractError(f"extract.source=generate: no generate output in {gen_dir} (run the generate stage first, "
                               "or set extract.source to a dataset for prefill-only extraction)")
        convs = list(iter_generated(gen_dir, statuses=("ok",), stats=read))
        desc = f"generate stage ({gen_dir})"
        if max_samples is not None:
            convs = convs[:max_samples]
    else:
        try:
            convs = load_conversations(source, on_bad_record=on_bad_record, max_samples=max_samples)
        except DatasetError as e:
            raise ExtractError(f"extract.source: {e}") from None
        desc = source
    if not convs:
        raise ExtractError(f"extract.source: no conversations in {desc}" + (" with status ok" if source == "generate" else ""))
    return convs, desc


# ------------------------------------------------------------------------------------------------------------ disk


def check_disk(out_dir: Path, tokens: int, bpt: int, margin_gib: float) -> dict[str, Any]:
    """Print the estimate and raise InsufficientDiskError if the output disk lacks room."""
    need = int(tokens * bpt * 1.002) + 64 * 1024  # headers and index
    free = shutil.disk_usage(out_dir).free
    _say(f"disk estimate: {tokens:,} tokens x {bpt:,} B/token = {need / GIB:,.3f} GiB; free on {out_dir}: {free / GIB:,.1f} GiB")
    if free < need + margin_gib * GIB:
        raise InsufficientDiskError(
            f"not enough disk for the hidden states: need {need / GIB:,.2f} GiB (+{margin_gib} GiB margin, "
            f"extract.disk_margin_gib) for {tokens:,} tokens at {bpt:,} B/token, but {out_dir} has {free / GIB:,.2f} GiB free. "
            "Free space, point the run directory at a bigger disk, use extract.dtype=float8_e4m3fn (half the bytes), "
            "or lower extract.max_samples / max_sample_tokens")
    return {"estimated_bytes": need, "disk_free_bytes": free}


# ------------------------------------------------------------------------------------------------------------ main


def _verifier_facts(model_path: str, vcfg: Any) -> dict[str, Any]:
    try:
        return verifier_facts(model_path, vcfg.trust_remote_code, vcfg.aux_layer_ids)
    except ValueError as e:
        raise ExtractError(str(e)) from None


def extract(cfg: Any, vcfg: Any, out_dir: str | Path, gen_dir: str | Path | None = None,
                     manifest_params: dict[str, Any] | None = None, hf_model: Any = None,
                     extractor: Any = None, hidden_states: str = "offline") -> dict[str, Any]:
    """The stage without a StageContext: read `cfg.source`, write the store and manifest.json into `out_dir`.

    `hidden_states` is train.hidden_states: "offline" stores the states; "online" and "hybrid" store the tokens only
    (the trainer computes the states, eagle3lib/training/states.py): no backend runs here.

    Returns {"figures", "outputs", "out_dir"}. `hf_model` reuses an already loaded HF model; `extractor` an already
    started backend (an object with `.extract(samples)`, e.g. a VLLMExtractor shared by tests and benchmarks).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    timer = StageTimer(out_dir, manifest_params or {"extract": cfg.model_dump(mode="json")})
    model_path = resolve_model(vcfg.model)
    facts = _verifier_facts(model_path, vcfg)
    L, H, aux = facts["num_layers"], facts["hidden_size"], facts["aux_layer_ids"]
    try:
        tokenizer = load_tokenizer(model_path, vcfg.trust_remote_code)
    except ValueError as e:
        raise ExtractError(str(e)) from None

    # --- tokenize everything first: the disk estimate needs the token count
    t0 = time.time()
    read = ReadStats()
    convs, desc = load_source(cfg.source, Path(gen_dir) if gen_dir else None, cfg.max_samples, cfg.on_bad_record, read)
    if read.torn_lines:
        _say(f"{read.torn_lines} unreadable line(s) in the generate shards skipped ({', '.join(read.torn_at)}): a torn "
             "write; running the generate stage again answers those prompts again")
    chat = ChatTokenizer(tokenizer, cfg.max_sample_tokens, cfg.too_long, cfg.chat_template_kwargs, cfg.end_of_turn or None,
                         cfg.mask_method)
    tstats = TokenizeStats()
    samples: list[Tokenized] = list(chat(convs, tstats, cfg.on_bad_record))
    tokenize_s = time.time() - t0
    for msg in tstats.errors:
        _say(f"skipped: {msg}")
    if not samples:
        raise ExtractError(f"no sample of {desc} is usable: {tstats.conversations} conversations, "
                           f"{tstats.skipped_no_assistant} without assistant tokens, {tstats.dropped_too_long} too long, "
                           f"{tstats.bad_samples} failed to tokenize")
    too_big = [s.id for s in samples if int(s.input_ids.max()) >= facts["vocab_size"]]
    if too_big:
        raise ExtractError(f"samples {too_big[:5]} have token ids >= the verifier's vocab_size {facts['vocab_size']}: "
                           "the tokenizer does not belong to this verifier")

    meta = {"verifier": vcfg.model, "verifier_path": model_path, "num_layers": L, "hidden_size": H,
            "vocab_size": facts["vocab_size"], "aux_layer_ids": aux, "final_layer": "output of decoder layer L-1, before the final norm",
            "max_sample_tokens": cfg.max_sample_tokens}
    store_dtype = cfg.dtype if hidden_states == "offline" else "none"
    meta["hidden_states"] = hidden_states
    writer = HiddenStateWriter(out_dir, meta, samples_per_shard=cfg.samples_per_shard, dtype=store_dtype,
                               max_shard_bytes=cfg.max_shard_bytes)
    if writer.damaged:
        _say(f"{len(writer.damaged)} damaged shard(s) set aside as shards/.damaged-*: {', '.join(writer.damaged)}; "
             "their samples are extracted again")
    todo = [s for s in samples if s.id not in writer.done_ids]
    resumed = len(samples) - len(todo)
    todo_tokens = sum(len(s) for s in todo)
    bpt = bytes_per_token(H, store_dtype, len(aux))
    _say(f"{len(samples):,} samples ({tstats.tokens:,} tokens, {tstats.loss_tokens:,} loss tokens) from {desc}; "
         f"{resumed:,} already stored, {len(todo):,} to " + (
             f"extract ({todo_tokens:,} tokens) with backend {cfg.backend}" if store_dtype != "none" else
             f"store as tokens only (train.hidden_states={hidden_states}: the trainer computes the states)"))
    disk = check_disk(out_dir, todo_tokens, bpt, cfg.disk_margin_gib)

    figures_run: dict[str, Any] = {}
    t_run = time.time()
    if todo and store_dtype == "none":
        for s in todo:
            writer.add(HiddenSample(s.id, torch.from_numpy(s.input_ids.astype("int64")), torch.from_numpy(s.loss_mask),
                                    None, None))
    elif todo:
        try:
            figures_run = _extract(cfg, vcfg, model_path, facts, out_dir, todo, todo_tokens, writer, hf_model, extractor)
        except BaseException:  # interrupted or failed: keep the samples already extracted (the re-run resumes after them)
            try:
                writer.flush()
            except Exception:
                pass
            raise
    writer.close()
    wall = time.time() - t_run
    loop_s = figures_run.pop("loop_s", wall)

    tot = writer.totals()
    this_tokens = writer.written_tokens
    figures = {
        "verifier": describe_model(vcfg.model),
        "aux_layer_ids": aux,
        "num_layers": L,
        "hidden_size": H,
        "vocab_size": facts["vocab_size"],
        "dtype": store_dtype,
        "hidden_states": hidden_states,  # offline: stored here; online/hybrid: computed by the trainer
        "offline_bytes": tot["tokens"] * bytes_per_token(H, cfg.dtype, len(aux)),  # what storing them would take
        "samples": tot["samples"],
        "tokens": tot["tokens"],
        "loss_tokens": tot["loss_tokens"],
        "bytes": tot["bytes"],
        "bytes_per_token": round(tot["bytes"] / max(1, tot["tokens"]), 1),
        "wall_s": round(wall, 2),  # this run's extraction, setup (model load / server start) included
        "samples_per_s": round(writer.written_samples / loop_s, 3) if loop_s > 0 else 0.0,  # steady state: setup excluded
        "tokens_per_s": round(this_tokens / loop_s, 1) if loop_s > 0 else 0.0,
        "backend": cfg.backend,
        "skipped_no_assistant": tstats.skipped_no_assistant,
        "truncated": tstats.truncated,
        "dropped_too_long": tstats.dropped_too_long,
        "shards": tot["shards"],
        # extras
        "input_conversations": tstats.conversations,
        "bad_samples": tstats.bad_samples,
        "duplicate_ids": tstats.duplicate_ids,
        "samples_this_run": writer.written_samples,
        "tokens_this_run": this_tokens,
        "resumed_samples": resumed,
        "generate_lines_unreadable": read.torn_lines,  # torn generate records skipped (named on the console)
        "damaged_shards_redone": len(writer.damaged),  # shards set aside on resume, their samples extracted again
        "max_sample_tokens": cfg.max_sample_tokens,
        "tokenize_s": round(tokenize_s, 2),
        "setup_s": round(wall - loop_s, 2),
        "num_gpus": num_gpus(cfg, vcfg),
        "estimated_bytes": disk["estimated_bytes"],
        **figures_run,
    }
    if writer.written_samples == 0:  # nothing left to do: keep the throughput the previous run measured
        prev = (read_manifest(out_dir) or {}).get("figures") or {}
        for k in ("samples_per_s", "tokens_per_s", "wall_s", "setup_s"):
            if prev.get(k):
                figures[k] = prev[k]
    outputs = {"store": ".", "store_meta": "store.json", "index": "index.jsonl", "shards": "shards/"}
    timer.finish(figures, outputs)
    _say(f"done: {figures['samples']:,} samples, {figures['tokens']:,} tokens, {figures['bytes'] / GIB:,.3f} GiB in "
         f"{figures['shards']} shards; this run {this_tokens:,} tokens at {figures['tokens_per_s']:,} tokens/s")
    return {"figures": figures, "outputs": outputs, "out_dir": out_dir}


def check_final_state(backend: Any, samples: list[Tokenized], model_path: str, vcfg: Any, name: str,
                      store_dtype: str = "bfloat16") -> dict[str, Any]:
    """eagle3lib/model/final_check.py `check_backend`, as an ExtractError (nothing is stored when it fails)."""
    from eagle3lib.model.final_check import FinalStateMismatch, check_backend, check_line

    try:
        figures = check_backend(backend, samples, model_path, vcfg.trust_remote_code, name, store_dtype)
    except FinalStateMismatch as e:
        raise ExtractError(str(e)) from None
    _say(check_line(figures))
    return figures


def _extract(cfg, vcfg, model_path, facts, out_dir, todo, todo_tokens, writer, hf_model, extractor) -> dict[str, Any]:
    from eagle3lib.core.progress import progress_bar

    aux = facts["aux_layer_ids"]
    bar = progress_bar(total=todo_tokens, unit="tok", unit_scale=True, desc="extract", mininterval=3.0, disable=not cfg.progress,
               file=sys.stderr)
    extra: dict[str, Any] = {}
    old_threads = torch.get_num_threads()

    def checked(backend, name: str):
        if cfg.final_state_check and hasattr(backend, "reference"):
            result = check_final_state(backend, todo[: cfg.final_state_check], model_path, vcfg, name, cfg.dtype)
            extra.update({f"final_state_{k}": v for k, v in result.items()})
        return backend.extract(todo)

    def consume(results) -> None:
        t0 = time.time()
        n = 0
        for s, a, f in results:
            writer.add(HiddenSample(s.id, torch.from_numpy(s.input_ids.astype("int64")), torch.from_numpy(s.loss_mask),
                                    a, f))
            n += 1
            bar.update(len(s))
            if n % 16 == 0:
                bar.set_postfix(samples=n, shards=len(writer.entries), refresh=False)
        writer.flush()
        extra["loop_s"] = time.time() - t0

    try:
        if extractor is not None:
            consume(checked(extractor, cfg.backend))
        elif cfg.backend == "hf":
            from eagle3lib.model.hf_extract import HFExtractor, hf_compute_dtype

            if cfg.cpu_threads:
                torch.set_num_threads(cfg.cpu_threads)
            t0 = time.time()
            dtype = hf_compute_dtype(cfg, vcfg)
            extra["hf_dtype"] = dtype
            ex = HFExtractor(model_path, aux, dtype=dtype, device=cfg.device, device_map=cfg.device_map,
                             trust_remote_code=vcfg.trust_remote_code, batch_tokens=cfg.batch_tokens, model=hf_model)
            extra["model_load_s"] = round(time.time() - t0, 2)
            extra["device"] = str(ex.input_device)
            try:
                consume(checked(ex, "hf"))
            finally:
                ex.close()
        else:
            from eagle3lib.vllm.hidden_states import VLLMExtractor

            ex = VLLMExtractor(model_path, vcfg, aux, facts["num_layers"], out_dir, cfg.max_sample_tokens,
                               concurrency=cfg.concurrency, request_timeout_s=cfg.request_timeout_s,
                               extra_args=cfg.vllm_args, max_position_embeddings=facts["max_position_embeddings"])
            with ex:
                extra["server_start_s"] = round(ex.start_s, 1)
                consume(checked(ex, "vllm"))
    finally:
        bar.close()
        torch.set_num_threads(old_threads)
    return extra


def num_gpus(cfg: Any, vcfg: Any) -> int:
    """GPUs the extraction used (the cost projection scales by it); a CPU run counts as one device."""
    if cfg.backend == "vllm":
        return int(vcfg.tensor_parallel_size)
    if cfg.device_map is not None and torch.cuda.is_available():
        return torch.cuda.device_count()
    return 1


def run(ctx) -> dict[str, Any]:
    """Notebook / runner entry point: RUN_DIR/extract/ from the profile's `extract` and `verifier` sections (and
    train.hidden_states: whether the states are stored here or computed by the trainer)."""
    return extract(ctx.cfg, ctx.verifier, ctx.dir, ctx.stage_dir("generate"), ctx.manifest_params(),
                   hidden_states=ctx.profile.section("train").hidden_states)
