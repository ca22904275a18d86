"""The training loop: the EAGLE-3 drafter on the extract stage's hidden states, in one process or as one torchrun rank.

    train(ctx)   builds a `Trainer` (inputs checked, draft vocabulary, drafter, optimizer, data plan) and runs it.

Outputs in RUN_DIR/train/: metrics.jsonl, draft_vocab.safetensors, checkpoints/step_NNNNNNNN/ (with resume state),
final/ (the vLLM-loadable checkpoint), manifest.json. Rank 0 writes everything; metrics are reduced across ranks.
Beside this file: inputs.py (store, split, draft vocabulary), checkpoints.py (the CheckpointStore: step checkpoints,
resume, best/), progress.py (LoopState: what a checkpoint saves to resume the loop), validate.py (every epoch's held-out
pass), figures.py (the manifest's figures), served_probe.py (acceptance as served, during training).

Distributed (eagle3lib/training/distributed.py): DDP, gradients averaged; the loss is scaled by the world size and
normalised by the counted positions of the whole global batch, so 1 and N processes take the same step. Or FSDP2.
Resume restores weights, optimizer, schedule, data position (the plan is deterministic), RNG and the open logging
window; SIGTERM saves a checkpoint at the next step boundary and exits cleanly; a non-finite loss stops before the
optimizer step and keeps the last good checkpoint.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from eagle3lib.config.stages import StageContext
from eagle3lib.config.train import TrainConfig
from eagle3lib.config.verifier import VerifierConfig
from eagle3lib.core.manifest import StageTimer, completion, now_iso, update_manifest
from eagle3lib.data.packing import collate, deal, make_plan, row_tokens, val_rows
from eagle3lib.model.checkpoint import CheckpointError, save_drafter
from eagle3lib.model.drafter import Eagle3Drafter, count_parameters, init_from_verifier
from eagle3lib.model.drafter_shape import drafter_config_from
from eagle3lib.model.interop import apply_init_source
from eagle3lib.model.ttt import STAT_KEYS, TTTModel, counted_per_step, summarize
from eagle3lib.model.verifier import load_verifier_head
from eagle3lib.trackers.run import Trackers
from eagle3lib.training import distributed as dist
from eagle3lib.training.best import SELECTION
from eagle3lib.training.checkpoints import CheckpointStore, check_compatible
from eagle3lib.training.figures import run_figures
from eagle3lib.training.inputs import load_inputs
from eagle3lib.training.memory_model import check_train_memory
from eagle3lib.training.metrics import MetricsWriter, console_line, ordered_record, peak_mem_mb, read_metrics
from eagle3lib.training.optimizer import make_optimizer
from eagle3lib.training.progress import LoopState, Window
from eagle3lib.training.schedule import lr_at
from eagle3lib.training.served_probe import ProbeSettings, ServedProbe, probe_prompts
from eagle3lib.training.setup import (
    TrainingDiverged,
    TrainingError,
    TrainingInterrupted,
    select_kernels,
    training_device,
)
from eagle3lib.training.states import open_states, states_figures
from eagle3lib.training.validate import validate

OnRecord = Callable[[dict[str, Any]], None]  # called on rank 0 with every metrics record (the notebook's live plot)


def log(msg: str) -> None:
    if dist.rank() == 0:
        try:
            print(f"[train {time.strftime('%H:%M:%S')}] {msg}", flush=True)
        except OSError:  # whoever read our console is gone (a killed notebook kernel): the run and its files go on
            sys.stdout = open(os.devnull, "w")


class Trainer:
    """Everything one training run holds: built from the stage context, then `run()`."""

    def __init__(self, ctx: StageContext, on_record: OnRecord | None = None, timer: StageTimer | None = None,
                 t_start: float | None = None):
        cfg: TrainConfig = ctx.cfg
        vcfg: VerifierConfig = ctx.verifier
        self.cfg, self.on_record, self.timer, self.verifier_cfg = cfg, on_record, timer, vcfg
        self.t_start = time.time() if t_start is None else t_start
        self.run_params = {"profile": ctx.profile.name, **ctx.profile.as_dict()}  # the trackers' run config
        self.trackers = Trackers()
        self.rank, self.world = dist.rank(), dist.world()
        self.out_dir: Path = ctx.dir
        self.store = CheckpointStore(self.out_dir, cfg.keep_checkpoints, self.rank)
        self.device = training_device(cfg)
        self.K = cfg.ttt_steps
        if self.device.type == "cpu":
            local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            torch.set_num_threads(cfg.threads or max(1, (os.cpu_count() or 1) // local))
        torch.manual_seed(cfg.seed)
        self.backend = select_kernels(cfg.kernels, self.device)
        Eagle3Drafter.set_kernels(self.backend)
        self.attention = cfg.attention  # "auto" is decided per micro-batch (ttt_attention.make_attention)
        self._inputs(ctx, vcfg)
        self._model(vcfg)
        self._plan()

    # ------------------------------------------------------------------------------------------------------ setup
    def _inputs(self, ctx: StageContext, vcfg: VerifierConfig) -> None:
        inp = load_inputs(self.cfg, vcfg, ctx.stage_dir("extract"), self.out_dir)
        self.model_path, self.vconf, self.aux_ids, self.drafter_layer = inp.model_path, inp.vconf, inp.aux_ids, \
            inp.drafter_layer
        self.reader, self.store_dir, self.lengths, self.split = inp.reader, inp.store_dir, inp.lengths, inp.split
        self.truncated, self.init, self.vocab = inp.truncated, inp.init, inp.vocab
        self.ecfg = ctx.profile.section("extract")  # online: extract.backend computes the states
        self.states = None
        log(f"draft vocabulary: {self.vocab.size} of {self.vocab.vocab_size} tokens, coverage {self.vocab.coverage:.4f} "
            f"of loss-masked training tokens; kernels={self.backend}; attention={self.attention}; device={self.device}; "
            f"processes={self.world}")

    def _model(self, vcfg: VerifierConfig) -> None:
        cfg, device = self.cfg, self.device
        self.dcfg = drafter_config_from(cfg, self.vconf, self.aux_ids, self.vocab.size, self.model_path, self.drafter_layer)
        longest = min(max((self.lengths[i] for i in self.split.train), default=1), cfg.packed_row_tokens)
        self.memory_model_gb = check_train_memory(cfg, self.dcfg, longest, self.device, str(self.ecfg.dtype), self.world)
        drafter = Eagle3Drafter(self.dcfg)
        drafter.set_vocab(self.vocab.draft_ids)
        head = load_verifier_head(self.model_path, vcfg.trust_remote_code)
        init_from_verifier(drafter, head)
        drafter.lm_head.weight.requires_grad_(not cfg.freeze_lm_head)
        if self.init is not None:
            n = apply_init_source(drafter, self.init, self.vocab.draft_ids)
            log(f"starting from {self.init.path} ({self.init.layout} layout; {n} of {self.vocab.size} lm_head rows)")
        self.loop, self.resume_state, self.resumed_from = LoopState.start(self.K, device), None, None
        self.best_val, self.stopped_early = None, False
        found = self.store.open(cfg.resume)
        if found is not None:
            self.resumed_from, rs, weights, damaged = found
            for d in damaged:
                log(f"skipped a damaged checkpoint: {d}")
            self.resume_state = rs
            check_compatible(self.resumed_from, self.dcfg, self.vocab.draft_ids, rs, cfg.freeze_lm_head, cfg.optimizer)
            missing, unexpected = drafter.load_state_dict(weights, strict=False)
            if unexpected or [m for m in missing if m not in ("d2t", "t2d")]:  # set from the draft vocab above
                raise CheckpointError(f"{self.resumed_from}: weights do not match the drafter ({missing}, {unexpected})")
            self.loop = LoopState.from_state(rs, self.K, device)
            # stopped by train.patience: stays stopped unless this run is more patient (then it trains on)
            self.stopped_early = bool(cfg.patience and self.loop.best.since_best >= cfg.patience)
            log(f"resuming from {self.resumed_from} (step {self.loop.progress.step})")
        self.n_params = count_parameters(drafter)  # the embedding is a buffer (frozen, not saved)
        self.ttt = TTTModel(drafter, head.norm_weight, head.lm_head, head.rms_norm_eps, cfg.ttt_steps, cfg.decay,
                            cfg.out_of_vocab, self.attention, self.backend, cfg.loss, cfg.hidden_state_loss_weight,
                            cfg.target_logits)
        self.ttt, head = self.ttt.to(device), None  # the head's copy lives in the module now
        bf16 = cfg.precision == "bfloat16" or (cfg.precision == "auto" and device.type == "cuda")
        self.amp = (lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16)) if bf16 else nullcontext
        self.module = dist.wrap(self.ttt, self.ttt.drafter.layers, cfg.distributed, device)
        self.opt = make_optimizer(self.module, cfg.optimizer, cfg.lr, tuple(cfg.betas), cfg.weight_decay,
                                  foreach=device.type == "cuda")
        if self.resume_state is not None:
            dist.load_optimizer_state(self.module, self.opt, self.resume_state["optimizer"])
            torch.set_rng_state(self.resume_state["rng_cpu"])
            if device.type == "cuda" and self.resume_state.get("rng_cuda") is not None:
                torch.cuda.set_rng_state(self.resume_state["rng_cuda"], device)

    def _plan(self) -> None:
        cfg = self.cfg
        if cfg.batch_rows % (self.world * cfg.micro_batch_rows):
            raise TrainingError(f"train.batch_rows ({cfg.batch_rows}) must be a multiple of processes x micro_batch_rows "
                                f"({self.world} x {cfg.micro_batch_rows})")
        self.plan = make_plan(self.split.train, self.lengths, cfg, cfg.max_steps)
        if self.plan.total_steps == 0:
            raise TrainingError(f"{self.store_dir}: {len(self.split.train)} training samples are fewer rows than one "
                                f"step (train.batch_rows={cfg.batch_rows}); lower batch_rows or extract more samples")
        if self.loop.progress.step > self.plan.total_steps:
            raise CheckpointError(f"{self.resumed_from}: checkpoint step {self.loop.progress.step} is past this run's "
                                  f"{self.plan.total_steps} steps")
        self.vrows = val_rows(self.split.val, self.lengths, cfg.packed_row_tokens, cfg.packing)
        log(f"{len(self.split.train)} train / {len(self.split.val)} val samples ({self.truncated} truncated to "
            f"{cfg.packed_row_tokens}); {self.plan.total_steps} steps; drafter {self.n_params / 1e6:.2f}M parameters")
        if cfg.hidden_states != "offline":
            self.states = open_states(self, self.ecfg, self.verifier_cfg, log)
        self.metrics = MetricsWriter(self.out_dir / "metrics.jsonl", enabled=self.rank == 0)
        self.metrics.truncate_after(self.loop.progress.step if self.loop.progress.step else -1)  # records <= the checkpoint stay
        if self.rank == 0:  # after the truncation: each tracker is caught up from what the file holds now
            self.trackers = Trackers.open(cfg, self.out_dir, self.run_params, self.loop.progress.step,
                                          read_metrics(self.metrics.path), warn=log)

    # ---------------------------------------------------------------------------------------------------- the loop
    def load_step(self, step: int):
        """The micro-batches of this process for global step `step` (online: their states computed here)."""
        e, s = self.plan.locate(step)
        mine = deal(self.plan.steps[e][s], self.lengths, self.cfg.packed_row_tokens, self.world,
                    self.cfg.micro_batch_rows)[self.rank]
        return [self.collate_rows(mb, e) for mb in mine]

    def collate_rows(self, rows: list[list[int]], epoch: int, offer: bool = True):
        got = self.states.fetch([i for r in rows for i in r], epoch, offer) if self.states else None
        return collate(self.reader, rows, self.cfg.packed_row_tokens, got)

    def run(self) -> dict[str, Any]:
        cfg, device, plan, pr = self.cfg, self.device, self.plan, self.loop.progress
        self.stop_requested = False
        try:
            old_handler = signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stop_requested", True))
        except ValueError:  # not the main thread (e.g. some notebook runners): no SIGTERM checkpoint
            old_handler = None
        self.t_run0 = time.time()
        self.run_tokens = self.run_samples = 0
        self.train_time = 0.0
        self.last_train: dict[str, Any] = {}
        self.last_val: dict[str, Any] = {}
        self.probe = ServedProbe(ProbeSettings.of(cfg, self.verifier_cfg, self.model_path, self.out_dir), device,
                                 self.rank, lambda n: probe_prompts(self.reader, self.split.val, n)) \
            if cfg.served_eval_every else None
        self.served_records: list[dict[str, Any]] = []
        self.loop.best.by = cfg.best_by
        if self.resumed_from is not None:
            self.loop.best = self.store.restore_best(self.module, self.dcfg, self.loop.best, pr.step, log)
        pool = ThreadPoolExecutor(1)
        next_batches = pool.submit(self.load_step, pr.step) if pr.step < plan.total_steps else None
        try:
            while pr.step < plan.total_steps and not self.stopped_early:
                t_step = time.time()
                mbs = next_batches.result()
                e, s_in_epoch = plan.locate(pr.step)
                # hybrid: the first epoch's cache is sealed on every rank before the next epoch's states are fetched
                seal = self._cache_open() and e == 0 and pr.step + 1 < plan.total_steps and plan.locate(pr.step + 1)[0]
                next_batches = pool.submit(self.load_step, pr.step + 1) if pr.step + 1 < plan.total_steps and \
                    not seal else None
                global_rows = plan.steps[e][s_in_epoch]
                step_tokens = sum(row_tokens(r, self.lengths, cfg.packed_row_tokens) for r in global_rows)
                step_samples = sum(len(r) for r in global_rows)
                stats, grad_norm, lr = self._step(mbs)
                self.train_time += time.time() - t_step
                self.loop.window.seconds += time.time() - t_step
                pr.step += 1
                pr.tokens_seen += step_tokens
                pr.samples_seen += step_samples
                self.run_tokens += step_tokens
                self.run_samples += step_samples
                pr.oov_step0 += int(stats[4, 0])
                pr.counted_step0 += int(stats[0, 0])
                self.loop.window.stats += stats
                self.loop.window.tokens += step_tokens
                self.loop.window.samples += step_samples
                self.loop.window.steps += 1
                if pr.step % cfg.log_every == 0 or pr.step == plan.total_steps:
                    self._log_train(lr, grad_norm)
                end_of_epoch = pr.step == plan.total_steps or plan.locate(pr.step)[0] != e
                probe_now = self.probe is not None and self.probe.due(pr.step, plan.total_steps)
                if (end_of_epoch and self.vrows or probe_now) and next_batches is not None:
                    next_batches.result()  # the reader is not shared between threads: let the prefetch finish
                chosen = None  # the record train/best/ is chosen by at this step (train.best_by)
                if end_of_epoch and self.vrows:
                    self.last_val = validate(self)
                    self._emit(self.last_val)
                    chosen = self.last_val if cfg.best_by == "estimate" else None
                if probe_now:
                    chosen = self._served_probe() or chosen
                if chosen is not None:
                    self._score(chosen)
                    if cfg.patience and self.loop.best.since_best >= cfg.patience:
                        if self.loop.window.steps:  # the open logging window is written before the run ends
                            self._log_train(lr, grad_norm)
                        self.stopped_early = True
                        log(f"no better {self.loop.best.score_name} in {cfg.patience} (train.patience): stopping at step "
                            f"{pr.step} of {plan.total_steps}; best step {self.loop.best.step}")
                        break
                if seal:
                    self.states.cache.seal()
                    dist.barrier()
                    self.states.cache.refresh()
                    next_batches = pool.submit(self.load_step, pr.step)
                self._maybe_stop_or_save()
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
            if self.states is not None:
                self.states.close()
            if old_handler is not None:
                signal.signal(signal.SIGTERM, old_handler)
        return self.finish()

    def _served_probe(self) -> dict[str, Any] | None:
        """One served-acceptance probe (eagle3lib/training/served_probe.py): its record on rank 0's metrics, and the
        record the checkpoint choice reads (train.best_by served_*: the probe's tau in the place of the estimate), alike
        on every rank (rank 0 measured; the others are told)."""
        step = self.loop.progress.step
        rec = self.probe.measure(self.module, self.dcfg, step, round(self.plan.epoch_float(step - 1), 4), self.elapsed)
        if rec is not None:
            self.served_records.append(rec)
            self._emit(rec)
        if self.cfg.best_by == "estimate":  # measured and recorded; the checkpoint choice reads the validation
            return None
        tau = rec.get(f"tau_{self.cfg.best_by.removeprefix('served_')}") if rec else None
        got = dist.all_reduce_(torch.tensor([tau if tau is not None else 0.0, 1.0 if tau is not None else 0.0],
                                            dtype=torch.float64, device=self.device))
        if not got[1]:
            return None
        return {"step": self.loop.progress.step, "epoch": round(self.plan.epoch_float(self.loop.progress.step - 1), 4),
                "tau_est": float(got[0])}

    def _cache_open(self) -> bool:
        return self.states is not None and self.states.cache is not None

    def _step(self, mbs) -> tuple[torch.Tensor, float, float]:
        """One optimizer step over this process's micro-batches: (reduced stats [5, K], grad norm, lr)."""
        cfg, K, device, pr = self.cfg, self.K, self.device, self.loop.progress
        # counted positions per TTT step over the whole global batch: the loss denominators
        den = torch.tensor([counted_per_step(mb.loss_mask, mb.doc, K) for mb in mbs], dtype=torch.float64)
        den = dist.all_reduce_(den.sum(0).to(device))
        lr = lr_at(pr.step, cfg, self.plan.total_steps)
        for g in self.opt.param_groups:
            g["lr"] = lr
        self.module.train()
        stats = torch.zeros(len(STAT_KEYS), K, dtype=torch.float64, device=device)
        for i, mb in enumerate(mbs):
            with dist.no_sync(self.module, cfg.distributed, last=i == len(mbs) - 1):
                with self.amp():
                    loss, st = self.module(mb.to(device), den.float(), float(self.world))
                loss.backward()
            stats += st
        dist.all_reduce_(stats)
        where = f"Last good checkpoint: {self.store.last or 'none (no checkpoint yet)'}"
        if not math.isfinite(float(stats[1].sum())):
            raise TrainingDiverged(f"non-finite loss in step {pr.step + 1} (hidden states with NaN/inf, or a learning "
                                   f"rate too high?); the optimizer step was not taken. {where}")
        params = self.ttt.parameters() if self.world == 1 else self.module.parameters()
        gn = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        grad_norm = float(gn.full_tensor() if hasattr(gn, "full_tensor") else gn)
        if not math.isfinite(grad_norm):
            raise TrainingDiverged(f"non-finite gradient norm in step {pr.step + 1}; the optimizer step was not taken. "
                                   f"{where}")
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return stats, grad_norm, lr

    def elapsed(self) -> float:
        return self.loop.progress.elapsed_s + time.time() - self.t_run0

    def _emit(self, rec: dict[str, Any]) -> None:
        self.metrics.write(rec)
        self.trackers.log(rec)
        log(console_line(rec, self.K))
        if self.on_record and self.rank == 0:
            self.on_record(rec)

    def _log_train(self, lr: float, grad_norm: float) -> None:
        w, pr, device = self.loop.window, self.loop.progress, self.device
        dt = max(w.seconds, 1e-9)
        mem = dist.all_reduce_(torch.tensor([peak_mem_mb(device)], dtype=torch.float64, device=device), "max")
        rec = {"kind": "train", "step": pr.step, "total_steps": self.plan.total_steps,
               "epoch": round(self.plan.epoch_float(pr.step - 1), 4), "tokens_seen": pr.tokens_seen,
               "samples_seen": pr.samples_seen, "lr": lr, **summarize(w.stats.cpu(), self.cfg.decay),
               "tokens_per_s": w.tokens / dt, "samples_per_s": w.samples / dt, "grad_norm": grad_norm,
               "peak_mem_mb": float(mem[0]), "time": time.time(), "elapsed_s": self.elapsed()}
        self.last_train = ordered_record(rec, self.K)
        self._emit(self.last_train)
        self.loop.window = Window(self.K, device)

    def _maybe_stop_or_save(self) -> None:
        pr = self.loop.progress
        stop_now = dist.all_reduce_(torch.tensor([1.0 if self.stop_requested else 0.0], device=self.device), "max")
        if float(stop_now[0]) > 0 and pr.step < self.plan.total_steps:
            ckpt = self.save()
            log(f"SIGTERM: saved {ckpt} at step {pr.step}; run the stage again to resume")
            if self.rank == 0:
                update_manifest(self.out_dir, status="interrupted", resume_from=str(ckpt), finished_at=now_iso(),
                                error=f"interrupted by SIGTERM at step {pr.step}; checkpoint {ckpt}")
            raise TrainingInterrupted(f"interrupted at step {pr.step}; checkpoint saved to {ckpt}")
        if pr.step % self.cfg.ckpt_every == 0 and pr.step < self.plan.total_steps and self.store.saved_step != pr.step:
            self.save()

    # -------------------------------------------------------------------------------------------- saves and choice
    def save(self) -> Path:
        """A step checkpoint of the run as it is now: weights, optimizer and the training state to resume from."""
        t, cfg, step = self, self.cfg, self.loop.progress.step
        training_state = {
            **t.loop.state(t.elapsed()), "scheduler": {"step": step, "total_steps": t.plan.total_steps},
            "rng_cpu": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state(t.device) if t.device.type == "cuda" else None,
            "drafter_config": t.dcfg.to_dict(), "draft_ids": t.vocab.draft_ids,
            "freeze_lm_head": cfg.freeze_lm_head, "optimizer_name": cfg.optimizer,
            "data": {"epoch": t.plan.locate(step - 1)[0] if step else 0, "seed": cfg.seed}}
        return self.store.save(step, self.module, self.opt, self.dcfg, training_state)

    def finish(self) -> dict[str, Any]:
        """The end of the run: the last step checkpoint (with resume state, so a longer rerun continues), final/ (the
        vLLM-loadable drafter) and the layouts train.export_layouts asks for, the figures and the manifest."""
        cfg, best, step = self.cfg, self.loop.best, self.loop.progress.step
        if self.store.saved_step != step:
            self.save()  # the last step (or where train.patience stopped)
        state = dist.model_state(self.module)
        online = states_figures(self.states, lambda x: dist.all_reduce_(x.to(self.device)).cpu()) if self.states else {}
        if self.rank != 0:
            return {}
        final_dir = save_drafter(state, self.dcfg, self.out_dir / "final")
        exports = {f"checkpoint_{lay}": save_drafter(state, self.dcfg, self.out_dir / f"final-{lay}", layout=lay).name
                   for lay in cfg.export_layouts}
        last_train, last_val, best_val = self.last_train, self.last_val, self.best_val
        if not last_train or not last_val or (best.step and best_val is None):  # resumed: the records are in the file
            recs = read_metrics(self.out_dir / "metrics.jsonl")
            last_train = last_train or next((r for r in reversed(recs) if r.get("kind") == "train"), {})
            last_val = last_val or next((r for r in reversed(recs) if r.get("kind") == "val"), {})
            best_val = best_val or next((r for r in recs if r.get("kind") == "val" and r["step"] == best.step), {})
        figures = {**run_figures(self, last_train, last_val, best_val), "hidden_states": cfg.hidden_states, **online,
                   "memory_model_gb": self.memory_model_gb}
        outputs = {"checkpoint": str(final_dir.relative_to(self.out_dir)), "metrics": "metrics.jsonl",
                   "draft_vocab": "draft_vocab.safetensors",
                   "last_step_checkpoint": str(self.store.last.relative_to(self.out_dir))}
        if best.step and (self.out_dir / "best" / SELECTION).exists():
            outputs["best"] = "best"
        outputs.update({**exports, **self.trackers.outputs()})
        self.trackers.summary(figures, step)
        if self.trackers.errors:
            figures["tracker_errors"] = len(self.trackers.errors)
        m = (self.timer.finish(figures, outputs) if self.timer else
             update_manifest(self.out_dir, **completion(figures=figures, outputs=outputs)))
        update_manifest(self.out_dir, resume_from=None, error=None, tracker_errors=self.trackers.errors or None)
        log(f"done: {step} steps, tau_est {figures['tau_est']}, val_tau_est {figures['val_tau_est']}; "
            f"checkpoint {final_dir.name}/")
        if best.step:
            what = "validation" if best.by == "estimate" else "served probe"
            more = ("; still improving at the last validation: more epochs or more data may raise it further"
                    if best.still_improving else "")
            log(f"best {what}: step {best.step} (epoch {best.epoch:.2f}), {best.score_name.removeprefix('best_')} "
                f"{best.val_tau_est:.3f}: train/best/{more}")
        return m

    def _score(self, val_rec: dict[str, Any]) -> None:
        """Checkpoint choice by acceptance (eagle3lib/training/best.py): a new best is saved as a step checkpoint (its
        training state names it) and then as best/. Every rank decides alike: the validation stats are reduced."""
        best = self.loop.best
        best.scored(val_rec)
        if not best.is_better(val_rec):
            return
        best.take(val_rec, self.last_train, self.cfg.ttt_steps)
        self.best_val = val_rec
        if self.loop.progress.step < self.plan.total_steps:  # the last step's checkpoint is the finish's
            self.save()
        self.store.write_best(self.module, self.dcfg, best)


def train(ctx: StageContext, *, on_record: OnRecord | None = None) -> dict[str, Any]:
    """Train in this process (alone, or as one torchrun rank). Returns the manifest (rank 0) or {} (other ranks)."""
    with dist.process_group(training_device(ctx.cfg)):
        rank = dist.rank()
        t_start = time.time()
        timer = ctx.timer() if rank == 0 else None
        trainer = None
        try:
            trainer = Trainer(ctx, on_record, timer, t_start)
            m = trainer.run()
            trainer.trackers.close("FINISHED")
            return m
        except BaseException as e:
            if trainer is not None:
                trainer.trackers.close("KILLED" if isinstance(e, TrainingInterrupted | KeyboardInterrupt) else "FAILED")
            if rank == 0 and not isinstance(e, TrainingInterrupted):
                update_manifest(ctx.dir, status="failed", error=f"{type(e).__name__}: {e}", finished_at=now_iso())
            raise
