"""The extract stage's engine (its entry: eagle3lib/stages/extract.py): verifier hidden states for drafter training,
into a sharded store (eagle3lib.data.hidden_store).

Input: the generate stage's responses (`source: generate`: those that ended, and by default those cut at
generate.max_tokens, as generated; the log, report and manifest count what is kept and dropped by reason) or,
prefill-only, a conversation dataset.
Each conversation is rendered with the verifier's chat template (loss mask on the assistant tokens, eagle3lib.data.chat_tokens),
then one of two backends computes, per token, the hidden states entering the 3 EAGLE-3 feature layers and the final
hidden state before the verifier's last norm:
  hf    transformers with forward hooks on just those layers (CPU or GPU, device_map for multi-GPU verifiers)
  vllm  vLLM's extract_hidden_states method with eagle3lib's KV connector (tensor parallel verifiers)
Both give the same tensors within dtype tolerance (tests/test_extract_backends.py).

Before starting it prints the disk estimate (tokens x bytes per token) and refuses if the output disk lacks room.
Re-running resumes after the last complete shard: samples already stored are not extracted again.

Several processes (extract.nproc_per_node x nnodes > 1; or `python -m torch.distributed.run ... -m
eagle3lib.stages.extract --profile P --run-dir R`): every rank tokenizes the same samples, takes the ones whose id
hashes to it (`eagle3lib.core.ranks.owner`: no overlap, none left out, at any world size) among those not yet stored,
and writes its own shards and index into the one store (eagle3lib/data/store_index.py). Rank 0 repairs the store
before the others start and merges the indexes when all are done; the manifest is rank 0's, its figures summed over
the ranks, with a row per rank. A killed rank's complete shards stay: the next run, at any world size, skips them.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch

from eagle3lib.config.extract import ExtractConfig
from eagle3lib.config.verifier import VerifierConfig
from eagle3lib.core import ranks
from eagle3lib.core.manifest import StageTimer, read_manifest
from eagle3lib.data.chat_tokens import ChatTokenizer, Tokenized, TokenizeStats
from eagle3lib.data.extract_source import SourceError, counts_line, load_source
from eagle3lib.data.hidden_store import (
    HiddenSample,
    HiddenStateWriter,
    bytes_per_token,
)
from eagle3lib.data.records import ReadStats
from eagle3lib.data.store_index import read_index, repair_store, store_totals
from eagle3lib.model.verifier import describe_model, load_tokenizer, resolve_model, verifier_facts, weights_fingerprint

GIB = 1024**3


class ExtractError(ValueError):
    """Bad input for the extract stage: the message names what is wrong."""


class InsufficientDiskError(ExtractError):
    pass


def say(msg: str) -> None:
    tag = f"[extract r{ranks.rank()}]" if ranks.world() > 1 else "[extract]"
    print(f"{tag} {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------------------ disk


def check_disk(out_dir: Path, tokens: int, bpt: int, margin_gib: float) -> dict[str, Any]:
    """Print the estimate and raise InsufficientDiskError if the output disk lacks room."""
    need = int(tokens * bpt * 1.002) + 64 * 1024  # headers and index
    free = shutil.disk_usage(out_dir).free
    say(f"disk estimate: {tokens:,} tokens x {bpt:,} B/token = {need / GIB:,.3f} GiB; free on {out_dir}: {free / GIB:,.1f} GiB")
    if free < need + margin_gib * GIB:
        raise InsufficientDiskError(
            f"not enough disk for the hidden states: need {need / GIB:,.2f} GiB (+{margin_gib} GiB margin, "
            f"extract.disk_margin_gib) for {tokens:,} tokens at {bpt:,} B/token, but {out_dir} has {free / GIB:,.2f} GiB free. "
            "Free space, point the run directory at a bigger disk, use extract.dtype=float8_e4m3fn (half the bytes), "
            "or lower extract.max_samples / max_sample_tokens")
    return {"estimated_bytes": need, "disk_free_bytes": free}


# ------------------------------------------------------------------------------------------------------------ main


def _verifier_facts(model_path: str, vcfg: VerifierConfig) -> dict[str, Any]:
    try:
        return verifier_facts(model_path, vcfg.trust_remote_code, vcfg.aux_layer_ids)
    except ValueError as e:
        raise ExtractError(str(e)) from None


def extract(cfg: ExtractConfig, vcfg: VerifierConfig, out_dir: str | Path, gen_dir: str | Path | None = None,
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
    rank, world = ranks.rank(), ranks.world()
    timer = StageTimer(out_dir, manifest_params or {"extract": cfg.model_dump(mode="json")},
                       input_dir=Path(gen_dir) if gen_dir is not None else None) if rank == 0 else None
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
    try:
        convs, desc, source_counts = load_source(cfg.source, Path(gen_dir) if gen_dir else None, cfg.max_samples,
                                                 cfg.on_bad_record, read, cfg.truncated_answers, cfg.answer_tokens)
    except SourceError as e:
        raise ExtractError(str(e)) from None
    if cfg.source == "generate":
        say(f"generate records kept: {counts_line(source_counts['kept'])}; dropped: "
             f"{counts_line(source_counts['dropped'])}")
    if read.torn_lines:
        say(f"{read.torn_lines} unreadable line(s) in the generate shards skipped ({', '.join(read.torn_at)}): a torn "
             "write; running the generate stage again answers those prompts again")
    chat = ChatTokenizer(tokenizer, cfg.max_sample_tokens, cfg.too_long, cfg.chat_template_kwargs, cfg.end_of_turn or None,
                         cfg.mask_method, cfg.answer_tokens, cfg.looping_answers)
    tstats = TokenizeStats()
    samples: list[Tokenized] = list(chat(convs, tstats, cfg.on_bad_record))
    tokenize_s = time.time() - t0
    for msg in tstats.errors:
        say(f"skipped: {msg}")
    if tstats.looping_answers:
        say(f"{tstats.looping_answers} of {tstats.answers_as_generated} answers loop (the same n-gram repeated to the "
             "end)" + (f"; {tstats.loop_tokens_trimmed:,} of their repeated tokens trimmed (extract.looping_answers)"
                       if tstats.loop_tokens_trimmed else ""))
    if tstats.rerendered_differently:
        say(f"{tstats.rerendered_differently} of {tstats.answers_ended} answers that ended (e.g. "
             f"{', '.join(tstats.rerendered_examples)}) render through the chat template into other tokens than the "
             "verifier generated; trained on as generated (extract.answer_tokens)")
    if tstats.prompts_rendered_differently:
        say(f"{tstats.prompts_rendered_differently} of {tstats.prompts_as_served + tstats.prompts_rendered_differently} "
            f"prompts (e.g. {', '.join(tstats.prompt_examples)}) render here into other tokens than the server sent the "
            "verifier (chat_template_kwargs of generate and extract, tool definitions, server template flags): built on "
            "the server's, only their last answer in the loss")
    if not samples:
        raise ExtractError(f"no sample of {desc} is usable: {tstats.conversations} conversations, "
                           f"{tstats.skipped_no_assistant} without assistant tokens, {tstats.dropped_too_long} too long, "
                           f"{tstats.bad_samples} failed to tokenize")
    too_big = [s.id for s in samples if int(s.input_ids.max()) >= facts["vocab_size"]]
    if too_big:
        raise ExtractError(f"samples {too_big[:5]} have token ids >= the verifier's vocab_size {facts['vocab_size']}: "
                           "the tokenizer does not belong to this verifier")

    meta = {"verifier": vcfg.model, "verifier_path": model_path, "verifier_weights": weights_fingerprint(model_path),
            "num_layers": L, "hidden_size": H,
            "vocab_size": facts["vocab_size"], "aux_layer_ids": aux, "final_layer": "output of decoder layer L-1, before the final norm",
            "max_sample_tokens": cfg.max_sample_tokens}
    store_dtype = cfg.dtype if hidden_states == "offline" else "none"
    meta["hidden_states"] = hidden_states
    def open_writer(rank_of_writer: int | None) -> HiddenStateWriter:
        return HiddenStateWriter(out_dir, meta, samples_per_shard=cfg.samples_per_shard, dtype=store_dtype,
                                 max_shard_bytes=cfg.max_shard_bytes, rank=rank_of_writer)

    bpt = bytes_per_token(H, store_dtype, len(aux))
    damaged: list[str] = []
    disk: dict[str, Any] = {}
    lone: HiddenStateWriter | None = None
    if rank == 0:  # the lone writer creates or repairs the store (and checks the disk for all) before any rank writes
        lone = open_writer(None)
        damaged = lone.damaged
        if damaged:
            say(f"{len(damaged)} damaged shard(s) set aside as shards/.damaged-*: {', '.join(damaged)}; "
                 "their samples are extracted again")
        disk = check_disk(out_dir, sum(len(s) for s in samples if s.id not in lone.done_ids), bpt, cfg.disk_margin_gib)
    ranks.barrier()
    writer = lone if world == 1 else open_writer(rank)  # one process: the lone writer writes too
    missing = [s for s in samples if s.id not in writer.done_ids]
    resumed = len(samples) - len(missing)
    todo = [s for s in missing if ranks.owner(s.id, world) == rank] if world > 1 else missing
    todo_tokens = sum(len(s) for s in todo)
    say(f"{len(samples):,} samples ({tstats.tokens:,} tokens, {tstats.loss_tokens:,} loss tokens) from {desc}; "
         f"{resumed:,} already stored, {len(todo):,} to " + (
             f"extract ({todo_tokens:,} tokens) with backend {cfg.backend}" if store_dtype != "none" else
             f"store as tokens only (train.hidden_states={hidden_states}: the trainer computes the states)")
         + (f" by this rank of {world}" if world > 1 else ""))

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
    mine = {"rank": rank, "host": socket.gethostname(), "samples_this_run": writer.written_samples,
            "tokens_this_run": writer.written_tokens, "wall_s": round(wall, 2), "loop_s": round(loop_s, 2),
            "tokens_per_s": round(writer.written_tokens / loop_s, 1) if loop_s > 0 else 0.0, **figures_run}
    per_rank = ranks.gather_objects(mine)  # also the barrier: every rank's shards are complete after it
    if rank != 0:
        return {"figures": mine, "outputs": {}, "out_dir": out_dir}
    if world > 1:
        repair_store(out_dir)  # merge the rank indexes into index.jsonl, atomically
        say("merged the index: " + "; ".join(f"rank {f['rank']} ({f['host']}) {f['samples_this_run']} samples, "
                                             f"{f['tokens_per_s']:,} tokens/s" for f in per_rank))
    tot = store_totals(read_index(out_dir))
    this_samples = sum(f["samples_this_run"] for f in per_rank)
    this_tokens = sum(f["tokens_this_run"] for f in per_rank)
    loop_s = max(f["loop_s"] for f in per_rank)  # the ranks run side by side: the slowest one sets the pace
    wall = max(f["wall_s"] for f in per_rank)
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
        "longest_sample_tokens": tot["longest_sample_tokens"],  # what a training row must hold (train.packed_row_tokens)
        "loss_tokens": tot["loss_tokens"],
        "bytes": tot["bytes"],
        "bytes_per_token": round(tot["bytes"] / max(1, tot["tokens"]), 1),
        "wall_s": round(wall, 2),  # this run's extraction, setup (model load / server start) included
        "samples_per_s": round(this_samples / loop_s, 3) if loop_s > 0 else 0.0,  # steady state: setup excluded
        "tokens_per_s": round(this_tokens / loop_s, 1) if loop_s > 0 else 0.0,
        "backend": cfg.backend,
        "skipped_no_assistant": tstats.skipped_no_assistant,
        "truncated": tstats.truncated,  # samples cut to max_sample_tokens
        "dropped_too_long": tstats.dropped_too_long,
        # the generate records: kept by status (truncated = answers cut at generate.max_tokens, kept as generated),
        # dropped by reason
        "records_kept": source_counts["kept"],
        "records_dropped": source_counts["dropped"],
        "shards": tot["shards"],
        # extras
        "input_conversations": tstats.conversations,
        "bad_samples": tstats.bad_samples,
        "duplicate_ids": tstats.duplicate_ids,
        "answers_as_generated": tstats.answers_as_generated,  # extract.answer_tokens: generated
        "answers_ended": tstats.answers_ended,  # ... not cut at max_tokens: compared with the template's rendering
        "answers_rerendered_differently": tstats.rerendered_differently,  # ... of those, rendered into other tokens
        "prompts_as_served": tstats.prompts_as_served,  # built on the server's prompt ids, rendered alike here
        "prompts_rendered_differently": tstats.prompts_rendered_differently,  # ... rendered otherwise here
        "looping_answers": tstats.looping_answers,  # answers that repeat one n-gram to their end (data/loops.py)
        "loop_tokens_trimmed": tstats.loop_tokens_trimmed,  # extract.looping_answers: trim
        "samples_this_run": this_samples,
        "tokens_this_run": this_tokens,
        "resumed_samples": resumed,
        "generate_lines_unreadable": read.torn_lines,  # torn generate records skipped (named on the console)
        "damaged_shards_redone": len(damaged),  # shards set aside on resume, their samples extracted again
        "max_sample_tokens": cfg.max_sample_tokens,
        "tokenize_s": round(tokenize_s, 2),
        "setup_s": round(wall - loop_s, 2),
        "num_gpus": num_gpus(cfg, vcfg) * world,
        "estimated_bytes": disk["estimated_bytes"],
        "world_size": world,  # extraction processes (torchrun ranks); 1 = this process alone
        **figures_run,
    }
    if world > 1:
        figures["ranks"] = per_rank  # per rank: host, samples and tokens this run, tokens/s (the totals above sum them)
    if this_samples == 0:  # nothing left to do: keep the throughput the previous run measured
        prev = (read_manifest(out_dir) or {}).get("figures") or {}
        for k in ("samples_per_s", "tokens_per_s", "wall_s", "setup_s"):
            if prev.get(k):
                figures[k] = prev[k]
    outputs = {"store": ".", "store_meta": "store.json", "index": "index.jsonl", "shards": "shards/"}
    timer.finish(figures, outputs)
    say(f"done: {figures['samples']:,} samples, {figures['tokens']:,} tokens, {figures['bytes'] / GIB:,.3f} GiB in "
         f"{figures['shards']} shards; this run {this_tokens:,} tokens at {figures['tokens_per_s']:,} tokens/s")
    return {"figures": figures, "outputs": outputs, "out_dir": out_dir}


def check_final_state(backend: Any, samples: list[Tokenized], model_path: str, vcfg: VerifierConfig, name: str,
                      store_dtype: str = "bfloat16") -> dict[str, Any]:
    """eagle3lib/model/final_check.py `check_backend`, as an ExtractError (nothing is stored when it fails)."""
    from eagle3lib.model.final_check import FinalStateMismatch, check_backend, check_line

    try:
        figures = check_backend(backend, samples, model_path, vcfg.trust_remote_code, name, store_dtype)
    except FinalStateMismatch as e:
        raise ExtractError(str(e)) from None
    say(check_line(figures))
    return figures


def _extract(cfg: ExtractConfig, vcfg: VerifierConfig, model_path, facts, out_dir, todo, todo_tokens, writer, hf_model,
             extractor) -> dict[str, Any]:
    from eagle3lib.core.progress import progress_bar

    aux = facts["aux_layer_ids"]
    bar = progress_bar(total=todo_tokens, unit="tok", unit_scale=True, desc="extract", mininterval=3.0,
                       disable=not cfg.progress or ranks.rank() != 0,
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
            device = cfg.device
            if ranks.world() > 1 and device == "auto" and torch.cuda.is_available():
                device = f"cuda:{ranks.local_rank() % torch.cuda.device_count()}"  # a GPU per rank
            ex = HFExtractor(model_path, aux, dtype=dtype, device=device, device_map=cfg.device_map,
                             trust_remote_code=vcfg.trust_remote_code, batch_tokens=cfg.batch_tokens, model=hf_model)
            extra["model_load_s"] = round(time.time() - t0, 2)
            extra["device"] = str(ex.input_device)
            try:
                consume(checked(ex, "hf"))
            finally:
                ex.close()
        else:
            from eagle3lib.vllm.hidden_states import VLLMExtractor

            work_dir = out_dir
            if ranks.world() > 1:  # a server per rank: its own log and staging folder, its own slice of the node's GPUs
                work_dir = out_dir / "ranks" / f"rank-{ranks.rank():05d}"
                if torch.cuda.is_available():
                    tp = int(vcfg.tensor_parallel_size)
                    first = ranks.local_rank() * tp
                    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(first + i) for i in range(tp))
            ex = VLLMExtractor(model_path, vcfg, aux, facts["num_layers"], work_dir, cfg.max_sample_tokens,
                               concurrency=cfg.concurrency, request_timeout_s=cfg.request_timeout_s,
                               extra_args=cfg.vllm_args, max_position_embeddings=facts["max_position_embeddings"])
            with ex:
                extra["server_start_s"] = round(ex.start_s, 1)
                consume(checked(ex, "vllm"))
    finally:
        bar.close()
        torch.set_num_threads(old_threads)
    return extra


def num_gpus(cfg: ExtractConfig, vcfg: VerifierConfig) -> int:
    """GPUs the extraction used (the cost projection scales by it); a CPU run counts as one device."""
    if cfg.backend == "vllm":
        return int(vcfg.tensor_parallel_size)
    if cfg.device_map is not None and torch.cuda.is_available():
        return torch.cuda.device_count()
    return 1
