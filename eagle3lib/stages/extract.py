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
    dequantize_fp8,
    quantize_fp8,
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
                     extractor: Any = None) -> dict[str, Any]:
    """The stage without a StageContext: read `cfg.source`, write the store and manifest.json into `out_dir`.

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
    writer = HiddenStateWriter(out_dir, meta, samples_per_shard=cfg.samples_per_shard, dtype=cfg.dtype,
                               max_shard_bytes=cfg.max_shard_bytes)
    if writer.damaged:
        _say(f"{len(writer.damaged)} damaged shard(s) set aside as shards/.damaged-*: {', '.join(writer.damaged)}; "
             "their samples are extracted again")
    todo = [s for s in samples if s.id not in writer.done_ids]
    resumed = len(samples) - len(todo)
    todo_tokens = sum(len(s) for s in todo)
    bpt = bytes_per_token(H, cfg.dtype, len(aux))
    _say(f"{len(samples):,} samples ({tstats.tokens:,} tokens, {tstats.loss_tokens:,} loss tokens) from {desc}; "
         f"{resumed:,} already stored, {len(todo):,} to extract ({todo_tokens:,} tokens) with backend {cfg.backend}")
    disk = check_disk(out_dir, todo_tokens, bpt, cfg.disk_margin_gib)

    figures_run: dict[str, Any] = {}
    t_run = time.time()
    if todo:
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
        "dtype": cfg.dtype,
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


CHECK_TOKENS = 512  # per checked sample: the reference logits are [tokens, vocab] fp32 (163,840 wide for Kimi)


def as_stored(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """x as the store gives it back: rounded to bf16, or fp8 with per-token scales."""
    if dtype == "float8_e4m3fn":
        return dequantize_fp8(*quantize_fp8(x), dtype=torch.float32)
    return x.to(torch.bfloat16).float()


def check_final_state(backend: Any, samples: list[Tokenized], model_path: str, vcfg: Any, name: str,
                      store_dtype: str = "bfloat16") -> dict[str, Any]:
    """The first samples' final states, as the store keeps them, against the verifier's own logits
    (eagle3lib/model/final_check.py); raises ExtractError before anything else is extracted when they disagree."""
    from dataclasses import replace

    from eagle3lib.model.final_check import compare, failure_message
    from eagle3lib.model.verifier import load_verifier_head

    t0 = time.time()
    cut = [replace(s, input_ids=s.input_ids[:CHECK_TOKENS], loss_mask=s.loss_mask[:CHECK_TOKENS]) for s in samples]
    head = load_verifier_head(model_path, vcfg.trust_remote_code)
    finals = [as_stored(f, store_dtype) for _, _, f in backend.extract(cut)]
    refs = [backend.reference(s) for s in cut]
    ids = [torch.from_numpy(s.input_ids.astype("int64")) for s in cut]
    result = compare(head, finals, ids, refs)
    if not result.ok:
        raise ExtractError(failure_message(result, name))
    _say(f"final-state check: the stored final states reproduce the verifier's logits ({result.positions} positions of "
         f"{result.samples} samples: top-1 agrees on {result.top1_agreement:.1%}, mean |log-prob difference| "
         f"{result.mean_abs_logprob_diff:.4f})")
    return {**result.figures(), "seconds": round(time.time() - t0, 2)}


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
            from eagle3lib.model.hf_extract import HFExtractor

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


def hf_compute_dtype(cfg: Any, vcfg: Any) -> str:
    """The HF backend's compute precision: explicit, or verifier.dtype on GPUs and float32 on CPU."""
    if cfg.hf_dtype != "auto":
        return cfg.hf_dtype
    from eagle3lib.model.hf_extract import pick_device

    on_gpu = cfg.device_map is not None or pick_device(cfg.device).startswith("cuda")
    return vcfg.dtype if on_gpu else "float32"


def run(ctx) -> dict[str, Any]:
    """Notebook / runner entry point: RUN_DIR/extract/ from the profile's `extract` and `verifier` sections."""
    return extract(ctx.cfg, ctx.verifier, ctx.dir, ctx.stage_dir("generate"), ctx.manifest_params())
