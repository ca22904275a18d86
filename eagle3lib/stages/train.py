"""The train stage: the EAGLE-3 drafter trained on the extract stage's hidden states, one process or many (torchrun).

Entry points
  train(ctx)          run training in this process: alone, or as one rank when started by torchrun (WORLD_SIZE set)
  launch(ctx)         what the notebook calls: `python -m eagle3lib.stages.train` in a subprocess, under torchrun when
                      train.nproc_per_node * nnodes > 1; streams its console lines and returns the manifest
  python -m eagle3lib.stages.train --profile P --run-dir R [--set train.key=value ...]     (torchrun runs this)

Outputs in RUN_DIR/train/: metrics.jsonl, draft_vocab.safetensors, checkpoints/step_NNNNNNNN/ (with resume state),
final/ (the vLLM-loadable checkpoint), manifest.json. Rank 0 writes everything; metrics are reduced across ranks.

Distributed: DDP (gradients averaged; the loss is scaled by the world size and normalised by the counted positions of
the whole global batch, so 1 and N processes take the same step), or FSDP2 `fully_shard` per decoder layer + root.
Resume restores weights, optimizer, schedule, data position (the plan is deterministic) and RNG; SIGTERM saves a
checkpoint at the next step boundary and exits cleanly; a non-finite loss stops before the optimizer step and keeps
the last good checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from eagle3lib.core.guard import popen_guarded
from eagle3lib.core.manifest import StageTimer, now_iso, read_manifest, update_manifest
from eagle3lib.core.paths import REPO_ROOT
from eagle3lib.data.packing import Plan, collate, deal, make_plan, row_tokens, split_samples, val_rows
from eagle3lib.model.checkpoint import (
    CheckpointError,
    check_compatible,
    checkpoint_dir,
    list_checkpoints,
    load_state,
    load_training_state,
    prune_checkpoints,
    save_drafter,
)
from eagle3lib.model.draft_vocab import DraftVocab, build_draft_vocab, count_loss_tokens
from eagle3lib.model.drafter import (
    Eagle3Drafter,
    count_parameters,
    drafter_config_from,
    init_from_verifier,
    load_verifier_head,
)
from eagle3lib.model.ttt import STAT_KEYS, TTTModel, counted_per_step, summarize
from eagle3lib.training.metrics import MetricsWriter, all_reduce_, console_line, peak_mem_mb, read_metrics


class TrainingError(RuntimeError):
    """Bad input or a failed run; the message says what and where."""


class TrainingDiverged(TrainingError):
    pass


class TrainingInterrupted(RuntimeError):
    """SIGTERM: a checkpoint was saved; running the stage again resumes from it."""


# ------------------------------------------------------------------------------------------------------- utilities


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def _rank() -> int:
    d = _dist()
    return d.get_rank() if d else 0


def _world() -> int:
    d = _dist()
    return d.get_world_size() if d else 1


def _barrier() -> None:
    d = _dist()
    if d:
        d.barrier()


def _log(msg: str) -> None:
    if _rank() == 0:
        try:
            print(f"[train {time.strftime('%H:%M:%S')}] {msg}", flush=True)
        except OSError:  # whoever read our console is gone (a killed notebook kernel): the run and its files go on
            sys.stdout = open(os.devnull, "w")


def lr_at(step: int, cfg, total_steps: int) -> float:
    """Linear warmup over warmup_steps, then cosine decay to lr * min_lr_ratio at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    p = (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(p, 1.0))))


def select_kernels(choice: str, device: torch.device) -> str:
    """"auto" -> triton on CUDA, torch elsewhere (kernels.select_backend decides and logs); explicit choices are checked."""
    from eagle3lib import kernels
    try:
        return kernels.select_backend(device, choice)
    except RuntimeError as e:
        raise TrainingError(f"train.kernels={choice}: {e}") from None


def _device(cfg) -> torch.device:
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise TrainingError("train.device=cuda but CUDA is not available")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def check_store(meta: dict[str, Any], store_dir: Path, verifier_cfg, aux_ids: list[int]) -> None:
    """Hidden states must come from the configured verifier: same hidden size, vocabulary and feature layers."""
    where = store_dir / "store.json"
    problems = []
    if int(meta.get("hidden_size", -1)) != int(verifier_cfg.hidden_size):
        problems.append(f"hidden_size {meta.get('hidden_size')} != the verifier's {verifier_cfg.hidden_size}")
    if "vocab_size" in meta and int(meta["vocab_size"]) != int(verifier_cfg.vocab_size):
        problems.append(f"vocab_size {meta['vocab_size']} != the verifier's {verifier_cfg.vocab_size}")
    if "num_layers" in meta and int(meta["num_layers"]) != int(verifier_cfg.num_hidden_layers):
        problems.append(f"num_layers {meta['num_layers']} != the verifier's {verifier_cfg.num_hidden_layers}")
    if list(meta.get("aux_layer_ids", [])) != list(aux_ids):
        problems.append(f"aux_layer_ids {meta.get('aux_layer_ids')} != the profile's {aux_ids}")
    if problems:
        raise TrainingError(f"{where}: hidden states from a different verifier or layers ({'; '.join(problems)})")


# ------------------------------------------------------------------------------------------------------ the loop


def train(ctx, *, on_record=None) -> dict[str, Any]:
    """Train in this process (alone, or as one torchrun rank). Returns the manifest (rank 0) or {} (other ranks)."""
    cfg, vcfg = ctx.cfg, ctx.verifier
    started_dist = False
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and _dist() is None:
        import torch.distributed as dist

        backend = "nccl" if _device(cfg).type == "cuda" else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(_device(cfg))
        dist.init_process_group(backend=backend)
        started_dist = True
    try:
        return _train(ctx, cfg, vcfg, on_record)
    finally:
        if started_dist:
            import torch.distributed as dist

            dist.destroy_process_group()


def _train(ctx, cfg, vcfg, on_record) -> dict[str, Any]:
    from eagle3lib.data.hidden_store import HiddenStateReader, StoreError
    from eagle3lib.model.verifier import aux_layer_ids, load_config, resolve_model

    rank, world = _rank(), _world()
    out_dir: Path = ctx.dir
    ckpt_root = out_dir / "checkpoints"
    device = _device(cfg)
    t_start = time.time()
    timer = StageTimer(out_dir, ctx.manifest_params()) if rank == 0 else None
    try:
        if device.type == "cpu":
            local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // local))
        torch.manual_seed(cfg.seed)
        backend = select_kernels(cfg.kernels, device)
        Eagle3Drafter.set_kernels(backend)
        attention = "doc" if cfg.attention == "auto" else cfg.attention

        # --- inputs
        model_path = resolve_model(vcfg.model)
        vconf = load_config(model_path, vcfg.trust_remote_code)
        aux_ids = aux_layer_ids(vcfg.aux_layer_ids, vconf.num_hidden_layers)
        store_dir = ctx.stage_dir("extract")
        try:
            reader = HiddenStateReader(store_dir)
        except StoreError as e:
            raise TrainingError(str(e)) from None
        check_store(reader.meta, store_dir, vconf, aux_ids)
        n_all = len(reader) if cfg.max_samples is None else min(len(reader), cfg.max_samples)
        if n_all == 0:
            raise TrainingError(f"{store_dir}: the hidden-state store holds no samples (did the extract stage run?)")
        lengths = reader.lengths
        split = split_samples(n_all, cfg.val_fraction, cfg.val_max_samples, cfg.seed, reader.ids[:n_all])
        if not split.train:
            raise TrainingError(f"{store_dir}: no training samples left after the validation split ({n_all} samples)")
        truncated = sum(1 for i in split.train if lengths[i] > cfg.max_seq_len)

        # --- draft vocabulary: counted once, saved, reused on resume
        vocab_path = out_dir / "draft_vocab.safetensors"
        resumable = cfg.resume and list_checkpoints(ckpt_root)
        if rank == 0 and not (resumable and vocab_path.exists()):
            counts = count_loss_tokens(reader, split.train, int(vconf.vocab_size))
            if int(counts.sum()) == 0:
                raise TrainingError(f"{store_dir}: no loss-masked (assistant) tokens in the training split")
            build_draft_vocab(counts, cfg.draft_vocab_size).save(vocab_path)
        _barrier()
        vocab = DraftVocab.load(vocab_path)
        if vocab.vocab_size != int(vconf.vocab_size):
            raise TrainingError(f"{vocab_path}: built for vocab {vocab.vocab_size}, verifier has {vconf.vocab_size}")
        _log(f"draft vocabulary: {vocab.size} of {vocab.vocab_size} tokens, coverage {vocab.coverage:.4f} of "
             f"loss-masked training tokens; kernels={backend}; attention={attention}; device={device}; "
             f"processes={world}")

        # --- model
        dcfg = drafter_config_from(cfg, vconf, aux_ids, vocab.size, model_path)
        drafter = Eagle3Drafter(dcfg)
        drafter.set_vocab(vocab.draft_ids)
        head = load_verifier_head(model_path, vcfg.trust_remote_code)
        init_from_verifier(drafter, head)
        start_step, resume_state, resumed_from = 0, None, None
        ckpts = list_checkpoints(ckpt_root) if cfg.resume else []
        if not ckpts and rank == 0:  # starting over: checkpoints of an earlier run must not be resumed later
            shutil.rmtree(ckpt_root, ignore_errors=True)
            shutil.rmtree(out_dir / "final", ignore_errors=True)
        if ckpts:
            resumed_from = ckpts[-1][1]
            resume_state = load_training_state(resumed_from)
            check_compatible(resumed_from, dcfg, vocab.draft_ids, resume_state)
            missing, unexpected = drafter.load_state_dict(load_state(resumed_from), strict=False)
            if unexpected or [m for m in missing if m not in ("d2t", "t2d")]:  # set from the draft vocab above
                raise CheckpointError(f"{resumed_from}: weights do not match the drafter ({missing}, {unexpected})")
            start_step = int(resume_state["step"])
            _log(f"resuming from {resumed_from} (step {start_step})")
        n_params = count_parameters(drafter)  # the embedding is a buffer (frozen, not saved)
        ttt = TTTModel(drafter, head.norm_weight, head.lm_head, head.rms_norm_eps, cfg.ttt_steps, cfg.decay,
                       cfg.out_of_vocab, attention, backend).to(device)
        del head
        if cfg.precision == "bfloat16" or (cfg.precision == "auto" and device.type == "cuda"):
            amp = torch.autocast(device_type=device.type, dtype=torch.bfloat16)
        else:
            amp = None
        module = _wrap(ttt, cfg, device, world)
        params = [p for p in module.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay,
                                foreach=device.type == "cuda")
        if resume_state is not None:
            _load_optimizer(module, opt, resume_state["optimizer"])
            torch.set_rng_state(resume_state["rng_cpu"])
            if device.type == "cuda" and resume_state.get("rng_cuda") is not None:
                torch.cuda.set_rng_state(resume_state["rng_cuda"], device)

        # --- plan
        if cfg.batch_rows % (world * cfg.micro_batch_rows):
            raise TrainingError(f"train.batch_rows ({cfg.batch_rows}) must be a multiple of processes x micro_batch_rows "
                                f"({world} x {cfg.micro_batch_rows})")
        plan = make_plan(split.train, lengths, cfg, cfg.max_steps)
        if plan.total_steps == 0:
            raise TrainingError(f"{store_dir}: {len(split.train)} training samples are fewer rows than one step "
                                f"(train.batch_rows={cfg.batch_rows}); lower batch_rows or extract more samples")
        if start_step > plan.total_steps:
            raise CheckpointError(f"{resumed_from}: checkpoint step {start_step} is past this run's {plan.total_steps} steps")
        vrows = val_rows(split.val, lengths, cfg.max_seq_len, cfg.packing)
        _log(f"{len(split.train)} train / {len(split.val)} val samples ({truncated} truncated to {cfg.max_seq_len}); "
             f"{plan.total_steps} steps; drafter {n_params / 1e6:.2f}M parameters")

        metrics = MetricsWriter(out_dir / "metrics.jsonl", enabled=rank == 0)
        metrics.truncate_after(start_step if start_step else -1)  # records of steps <= the checkpoint stay
        return _loop(ctx, cfg, dcfg, module, ttt, opt, plan, vrows, reader, lengths, device, amp, metrics, timer,
                     start_step, resume_state, resumed_from, vocab, backend, attention, split, truncated, t_start,
                     on_record, n_params)
    except BaseException as e:
        if rank == 0 and not isinstance(e, TrainingInterrupted):
            update_manifest(out_dir, status="failed", error=f"{type(e).__name__}: {e}", finished_at=now_iso())
        raise


def _wrap(ttt: TTTModel, cfg, device: torch.device, world: int):
    if world == 1:
        return ttt
    if cfg.distributed == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(ttt, device_ids=[device.index] if device.type == "cuda" else None, broadcast_buffers=False)
    from torch.distributed.fsdp import fully_shard

    for layer in ttt.drafter.layers:
        fully_shard(layer)
    fully_shard(ttt)
    return ttt


def _state_options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True, **kw)


def _model_state(module) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(module, options=_state_options())


def _optim_state(module, opt) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(module, opt, options=_state_options())


def _load_optimizer(module, opt, state) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(module, opt, state, options=StateDictOptions(full_state_dict=True))


class _Window:
    """Sums over a logging window (local to this process until reduced)."""

    def __init__(self, K: int, device):
        self.stats = torch.zeros(len(STAT_KEYS), K, dtype=torch.float64, device=device)
        self.seconds = 0.0  # training time (data wait included, validation and checkpoints excluded)
        self.tokens = 0
        self.samples = 0
        self.steps = 0


def _loop(ctx, cfg, dcfg, module, ttt, opt, plan: Plan, vrows, reader, lengths, device, amp, metrics, timer,
          start_step, resume_state, resumed_from, vocab, backend, attention, split, truncated, t_start, on_record,
          n_params) -> dict[str, Any]:
    rank, world = _rank(), _world()
    K = cfg.ttt_steps
    out_dir: Path = ctx.dir
    ckpt_root = out_dir / "checkpoints"
    rs = resume_state or {}
    tokens_seen, samples_seen = int(rs.get("tokens_seen", 0)), int(rs.get("samples_seen", 0))
    elapsed_before = float(rs.get("elapsed_s", 0.0))
    oov_total, counted0_total = int(rs.get("oov_step0", 0)), int(rs.get("counted_step0", 0))
    last_ckpt = resumed_from
    stop = {"flag": False}
    old_handler = None
    try:
        old_handler = signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("flag", True))
    except ValueError:  # not the main thread (e.g. some notebook runners): no SIGTERM checkpoint
        old_handler = None

    def step_rows(step: int) -> list[list[list[int]]]:
        e, s = plan.locate(step)
        return deal(plan.steps[e][s], lengths, cfg.max_seq_len, world, cfg.micro_batch_rows)[rank]

    def load_step(step: int):
        return [collate(reader, mb, cfg.max_seq_len) for mb in step_rows(step)]

    def save(step: int, final: bool = False) -> Path:
        """Step checkpoint with the resume state (all ranks take part in gathering; rank 0 writes)."""
        state = _model_state(module)
        optim = _optim_state(module, opt)
        path = checkpoint_dir(ckpt_root, step)
        if rank == 0:
            training_state = {
                "step": step, "optimizer": optim, "scheduler": {"step": step, "total_steps": plan.total_steps},
                "rng_cpu": torch.get_rng_state(),
                "rng_cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
                "tokens_seen": tokens_seen, "samples_seen": samples_seen,
                "elapsed_s": elapsed_before + (time.time() - t_run0),
                "oov_step0": oov_total, "counted_step0": counted0_total,
                "drafter_config": dcfg.to_dict(), "draft_ids": vocab.draft_ids,
                "data": {"epoch": plan.locate(step - 1)[0] if step else 0, "seed": cfg.seed},
                # the open logging window: a run resumed mid-window writes the same record as an uninterrupted one
                "window": {"stats": window.stats.cpu(), "tokens": window.tokens, "samples": window.samples,
                           "seconds": window.seconds, "steps": window.steps},
            }
            save_drafter(state, dcfg, path, training_state)
            prune_checkpoints(ckpt_root, cfg.keep_checkpoints)
        _barrier()
        return path

    t_run0 = time.time()
    run_tokens = 0
    run_samples = 0
    train_time = 0.0
    window = _Window(K, device)
    if "window" in rs:
        w = rs["window"]
        window.stats += w["stats"].to(device)
        window.tokens, window.samples, window.seconds, window.steps = w["tokens"], w["samples"], w["seconds"], w["steps"]
    last_train: dict[str, Any] = {}
    last_val: dict[str, Any] = {}
    grad_norm = float("nan")
    pool = ThreadPoolExecutor(1)
    next_batches = pool.submit(load_step, start_step) if start_step < plan.total_steps else None
    step = start_step
    try:
        while step < plan.total_steps:
            t_step = time.time()
            mbs = next_batches.result()
            next_batches = pool.submit(load_step, step + 1) if step + 1 < plan.total_steps else None
            e, s_in_epoch = plan.locate(step)
            global_rows = plan.steps[e][s_in_epoch]
            step_tokens = sum(row_tokens(r, lengths, cfg.max_seq_len) for r in global_rows)
            step_samples = sum(len(r) for r in global_rows)
            # counted positions per TTT step over the whole global batch: the loss denominators
            den = torch.tensor([counted_per_step(mb.loss_mask, mb.doc, K) for mb in mbs], dtype=torch.float64)
            den = all_reduce_(den.sum(0).to(device))
            lr = lr_at(step, cfg, plan.total_steps)
            for g in opt.param_groups:
                g["lr"] = lr
            module.train()
            stats = torch.zeros(len(STAT_KEYS), K, dtype=torch.float64, device=device)
            for i, mb in enumerate(mbs):
                last = i == len(mbs) - 1
                with _sync_ctx(module, cfg, world, last):
                    with amp if amp is not None else _null():
                        loss, st = module(mb.to(device), den.float(), float(world))
                    loss.backward()
                stats += st
            all_reduce_(stats)
            if not math.isfinite(float(stats[1].sum())):
                raise TrainingDiverged(
                    f"non-finite loss in step {step + 1} (hidden states with NaN/inf, or a learning rate too high?); the "
                    f"optimizer step was not taken. Last good checkpoint: {last_ckpt or 'none (no checkpoint yet)'}")
            gn = torch.nn.utils.clip_grad_norm_(ttt.parameters() if world == 1 else module.parameters(), cfg.grad_clip)
            gn = gn.full_tensor() if hasattr(gn, "full_tensor") else gn
            grad_norm = float(gn)
            if not math.isfinite(grad_norm):
                raise TrainingDiverged(f"non-finite gradient norm in step {step + 1}; the optimizer step was not taken. "
                                       f"Last good checkpoint: {last_ckpt or 'none (no checkpoint yet)'}")
            opt.step()
            opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            train_time += time.time() - t_step
            window.seconds += time.time() - t_step
            step += 1
            tokens_seen += step_tokens
            samples_seen += step_samples
            run_tokens += step_tokens
            run_samples += step_samples
            oov_total += int(stats[4, 0])
            counted0_total += int(stats[0, 0])
            window.stats += stats
            window.tokens += step_tokens
            window.samples += step_samples
            window.steps += 1

            if step % cfg.log_every == 0 or step == plan.total_steps:
                dt = max(window.seconds, 1e-9)
                mem = all_reduce_(torch.tensor([peak_mem_mb(device)], dtype=torch.float64, device=device), "max")
                rec = {"kind": "train", "step": step, "total_steps": plan.total_steps,
                       "epoch": round(plan.epoch_float(step - 1), 4), "tokens_seen": tokens_seen,
                       "samples_seen": samples_seen, "lr": lr, **summarize(window.stats.cpu(), cfg.decay),
                       "tokens_per_s": window.tokens / dt, "samples_per_s": window.samples / dt,
                       "grad_norm": grad_norm, "peak_mem_mb": float(mem[0]), "time": time.time(),
                       "elapsed_s": elapsed_before + time.time() - t_run0}
                rec = _ordered(rec, K)
                metrics.write(rec)
                last_train = rec
                _log(console_line(rec, K))
                if on_record and rank == 0:
                    on_record(rec)
                window = _Window(K, device)

            end_of_epoch = step == plan.total_steps or plan.locate(step)[0] != e
            if end_of_epoch and vrows:
                if next_batches is not None:
                    next_batches.result()  # the reader is not shared between threads: let the prefetch finish first
                last_val = _validate(module, cfg, vrows, reader, device, amp, step, plan.epoch_float(step - 1),
                                     elapsed_before + time.time() - t_run0, K)
                metrics.write(last_val)
                _log(console_line(last_val, K))
                if on_record and rank == 0:
                    on_record(last_val)

            stop_now = all_reduce_(torch.tensor([1.0 if stop["flag"] else 0.0], device=device), "max")
            if float(stop_now[0]) > 0 and step < plan.total_steps:
                last_ckpt = save(step)
                _log(f"SIGTERM: saved {last_ckpt} at step {step}; run the stage again to resume")
                if rank == 0:
                    update_manifest(out_dir, status="interrupted", resume_from=str(last_ckpt), finished_at=now_iso(),
                                    error=f"interrupted by SIGTERM at step {step}; checkpoint {last_ckpt}")
                raise TrainingInterrupted(f"interrupted at step {step}; checkpoint saved to {last_ckpt}")
            if step % cfg.ckpt_every == 0 and step < plan.total_steps:
                last_ckpt = save(step)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        if old_handler is not None:
            signal.signal(signal.SIGTERM, old_handler)

    # --- final checkpoint (with resume state, so a longer rerun continues) and the vLLM-loadable export
    last_ckpt = save(plan.total_steps)
    state = _model_state(module)
    if rank != 0:
        return {}
    final_dir = save_drafter(state, dcfg, out_dir / "final")
    if not last_train or not last_val:  # resumed at the very end: the records are in the file
        recs = read_metrics(out_dir / "metrics.jsonl")
        last_train = last_train or next((r for r in reversed(recs) if r.get("kind") == "train"), {})
        last_val = last_val or next((r for r in reversed(recs) if r.get("kind") == "val"), {})
    figures: dict[str, Any] = {
        "steps": plan.total_steps,
        "epochs": plan.epoch_float(plan.total_steps - 1),
        "tokens_seen": tokens_seen,
        "samples_seen": samples_seen,
        "tokens_per_s": run_tokens / train_time if train_time else None,
        "samples_per_s": run_samples / train_time if train_time else None,
        "num_processes": world,
        "final_loss": last_train.get("loss"),
        "tau_est": last_train.get("tau_est"),
        "val_tau_est": last_val.get("tau_est"),
        "val_loss": last_val.get("loss"),
    }
    for k in range(cfg.ttt_steps):
        figures[f"full_acc_{k}"] = last_train.get(f"full_acc_{k}")
        figures[f"cond_acc_{k}"] = last_train.get(f"cond_acc_{k}")
    for k in range(cfg.ttt_steps):
        figures[f"val_full_acc_{k}"] = last_val.get(f"full_acc_{k}")
        figures[f"val_cond_acc_{k}"] = last_val.get(f"cond_acc_{k}")
    figures.update({
        "draft_vocab_size": vocab.size,
        "draft_vocab_coverage": vocab.coverage,
        "argmax_outside_draft_vocab": oov_total,
        "argmax_outside_draft_vocab_frac": oov_total / counted0_total if counted0_total else 0.0,
        "peak_mem_mb": last_train.get("peak_mem_mb"),
        "wall_s": round(time.time() - t_start, 2),
        "train_s": round(train_time, 2),
        "kernels": backend,
        "attention": attention,
        "distributed": cfg.distributed if world > 1 else "none",
        "device": str(device.type),
        "train_samples": len(split.train),
        "val_samples": len(split.val),
        "truncated_samples": truncated,
        "drafter_parameters": n_params,
        "ttt_steps": cfg.ttt_steps,
        "resumed_from_step": int(rs.get("step", 0)) if rs else None,
    })
    outputs = {"checkpoint": str(final_dir.relative_to(out_dir)), "metrics": "metrics.jsonl",
               "draft_vocab": "draft_vocab.safetensors", "last_step_checkpoint": str(last_ckpt.relative_to(out_dir))}
    m = timer.finish(figures, outputs) if timer else update_manifest(out_dir, status="complete", figures=figures,
                                                                       outputs=outputs, finished_at=now_iso())
    update_manifest(out_dir, resume_from=None, error=None)
    _log(f"done: {plan.total_steps} steps, tau_est {figures['tau_est']}, val_tau_est {figures['val_tau_est']}; "
         f"checkpoint {final_dir}")
    return m


def _ordered(rec: dict[str, Any], K: int) -> dict[str, Any]:
    keys = ["kind", "step", "total_steps", "epoch", "tokens_seen", "samples_seen", "lr", "loss"]
    keys += [f"loss_{k}" for k in range(K)] + [f"full_acc_{k}" for k in range(K)] + [f"cond_acc_{k}" for k in range(K)]
    keys += ["tau_est", "tokens_per_s", "samples_per_s", "grad_norm", "peak_mem_mb", "time", "elapsed_s"]
    return {k: rec[k] for k in keys}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def _sync_ctx(module, cfg, world: int, last: bool):
    """Skip the gradient all-reduce on all but the last micro-batch of a step."""
    if world == 1 or last:
        return _null()
    if cfg.distributed == "ddp":
        return module.no_sync()

    class _fsdp_nosync:
        def __enter__(self):
            module.set_requires_gradient_sync(False)

        def __exit__(self, *a):
            module.set_requires_gradient_sync(True)
            return False

    return _fsdp_nosync()


@torch.no_grad()
def _validate(module, cfg, vrows, reader, device, amp, step, epoch, elapsed, K) -> dict[str, Any]:
    rank, world = _rank(), _world()
    module.eval()
    stats = torch.zeros(len(STAT_KEYS), K, dtype=torch.float64, device=device)
    mine = vrows[rank::world]
    # every process runs the same number of forwards (FSDP all-gathers are collective); extra ones count nothing
    n_mb = math.ceil(math.ceil(len(vrows) / world) / cfg.micro_batch_rows)
    tokens = samples = 0
    ones = torch.ones(K, device=device)
    for i in range(n_mb):
        rows = mine[i * cfg.micro_batch_rows : (i + 1) * cfg.micro_batch_rows]
        mb = collate(reader, rows or vrows[:1], cfg.max_seq_len)
        with amp if amp is not None else _null():
            _, st = module(mb.to(device), ones)
        if rows:
            stats += st
            tokens += mb.n_tokens
            samples += mb.n_samples
    all_reduce_(stats)
    counts = all_reduce_(torch.tensor([tokens, samples], dtype=torch.float64, device=device))
    rec = {"kind": "val", "step": step, "epoch": round(epoch, 4), "time": time.time(), "elapsed_s": elapsed,
           "tokens": int(counts[0]), "samples": int(counts[1]), **summarize(stats.cpu(), cfg.decay)}
    module.train()
    return rec


# ------------------------------------------------------------------------------------------------- launching


def launch_command(ctx, overrides: dict[str, Any] | None = None) -> list[str]:
    """The command that trains this stage: torchrun when the profile asks for several processes."""
    cfg = ctx.cfg
    args = ["-m", "eagle3lib.stages.train", "--profile", str(ctx.profile.path), "--run-dir", str(ctx.run_dir),
            "--overrides-json", json.dumps(overrides if overrides is not None else ctx.profile.overrides)]
    if cfg.nproc_per_node * cfg.nnodes > 1:
        tr = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={cfg.nproc_per_node}"]
        if cfg.nnodes > 1:
            tr += [f"--nnodes={cfg.nnodes}", "--rdzv-backend=c10d",
                   f"--rdzv-endpoint={os.environ.get('EAGLE3_RDZV_ENDPOINT', 'localhost:29400')}"]
        else:
            tr += ["--standalone"]
        return tr + ["--module", *args[1:]]
    return [sys.executable, *args]


def launch_env(ctx) -> dict[str, str]:
    """The environment of the training processes: the repo on the path (so `kernels` and `eagle3lib` import from the
    checkout whatever the caller's folder), one OpenMP pool per process sized to share the cores."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), *([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])])
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // max(1, ctx.cfg.nproc_per_node))))
    return env


def launch(ctx, *, echo=print) -> dict[str, Any]:
    """Run training in a subprocess (torchrun for several processes), streaming its console lines.

    A subprocess even for one process: the notebook kernel stays small and responsive, a crash (out of memory) does
    not take the kernel with it, and one and many processes run exactly the same code. Interrupting the notebook sends
    SIGTERM, so the run saves a checkpoint and the next launch resumes.
    """
    cmd = launch_command(ctx)
    echo("$ " + " ".join(cmd))
    proc = popen_guarded(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                         env=launch_env(ctx), cwd=str(REPO_ROOT))
    tail: list[str] = []
    try:
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail = (tail + [line])[-60:]
            if line.startswith("[train") or "Error" in line or "error" in line:
                echo(line)
        proc.wait()
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait()
        raise
    m = read_manifest(ctx.dir) or {}
    if proc.returncode != 0 or m.get("status") != "complete":
        msg = m.get("error") or f"exit code {proc.returncode}"
        raise TrainingError(f"training failed: {msg}\n--- last output lines ---\n" + "\n".join(tail[-30:]))
    return m


def main(argv: list[str] | None = None) -> int:
    from eagle3lib.config.stages import open_stage

    ap = argparse.ArgumentParser(prog="python -m eagle3lib.stages.train", description="Train the EAGLE-3 drafter (one rank).")
    ap.add_argument("--profile", default="tiny")
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--set", action="append", dest="sets", default=[], metavar="SECTION.KEY=VALUE")
    ap.add_argument("--overrides-json", default="{}")
    a = ap.parse_args(argv)
    from eagle3lib.config.profile import parse_set

    overrides = {**json.loads(a.overrides_json), **parse_set(a.sets)}
    ctx = open_stage("train", a.profile, a.run_dir, overrides)
    try:
        train(ctx)
    except TrainingInterrupted as e:
        print(f"[train] {e}", flush=True)
        return 0
    except TrainingError as e:
        print(f"[train] error: {e}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
