"""The train manifest's figures: what one finished run measured, from its last training and validation records."""

from __future__ import annotations

import time
from typing import Any


def run_figures(t, last_train: dict[str, Any], last_val: dict[str, Any], best_val: dict[str, Any] | None) -> dict[str, Any]:
    """`t` is the finished Trainer (eagle3lib/training/loop.py); every value is a plain number, string or None."""
    figures: dict[str, Any] = {
        "steps": t.loop.progress.step,
        "planned_steps": t.plan.total_steps,
        "stopped_early": t.stopped_early,  # train.patience ended the run before planned_steps
        "epochs": t.plan.epoch_float(t.loop.progress.step - 1),
        "tokens_seen": t.loop.progress.tokens_seen,
        "samples_seen": t.loop.progress.samples_seen,
        "tokens_per_s": t.run_tokens / t.train_time if t.train_time else None,
        "samples_per_s": t.run_samples / t.train_time if t.train_time else None,
        "num_processes": t.world,
        "final_loss": last_train.get("loss"),
        "tau_est": last_train.get("tau_est"),
        "val_tau_est": last_val.get("tau_est"),
        "val_loss": last_val.get("loss"),
    }
    for k in range(t.cfg.ttt_steps):
        figures[f"full_acc_{k}"] = last_train.get(f"full_acc_{k}")
        figures[f"cond_acc_{k}"] = last_train.get(f"cond_acc_{k}")
    for k in range(t.cfg.ttt_steps):
        figures[f"val_full_acc_{k}"] = last_val.get(f"full_acc_{k}")
        figures[f"val_cond_acc_{k}"] = last_val.get(f"cond_acc_{k}")
    figures.update({
        "draft_vocab_size": t.vocab.size,
        "draft_vocab_coverage": t.vocab.coverage,
        **outside_draft_vocab(t, last_val),
        "peak_mem_mb": last_train.get("peak_mem_mb"),
        "wall_s": round(time.time() - t.t_start, 2),
        "train_s": round(t.train_time, 2),
        "kernels": t.backend,
        "attention": t.attention,
        "distributed": t.cfg.distributed if t.world > 1 else "none",
        "device": str(t.device.type),
        "train_samples": len(t.split.train),
        "train_tokens": sum(min(t.lengths[i], t.cfg.packed_row_tokens) for i in t.split.train),  # one epoch's data
        "val_samples": len(t.split.val),
        "truncated_samples": t.truncated,
        "drafter_parameters": t.n_params,
        "drafter_layer": t.dcfg.drafter_layer,  # llama or mla (train.drafter_layer resolved)
        "checkpoint_layout": "eagle" if t.dcfg.drafter_layer == "mla" else "speculators",  # of final/ and best/
        "ttt_steps": t.cfg.ttt_steps,
        "resumed_from_step": int(t.resume_state.get("step", 0)) if t.resume_state else None,
        "init_from": t.cfg.init_from,
        "train_fraction": t.cfg.train_fraction,
        **t.loop.best.figures(best_val, t.cfg.ttt_steps),
        **served_figures(t),
    })
    return figures


def served_figures(t) -> dict[str, Any]:
    """The served-acceptance probes of this run (train.served_eval_every): the last one's taus and what they cost."""
    if not t.cfg.served_eval_every:
        return {}
    recs = t.served_records
    last = recs[-1] if recs else {}
    cost = sum(r["probe_s"] + r["load_s"] for r in recs)
    return {"served_probes": len(recs), "served_probe_s": round(cost, 2),
            "served_probe_share": round(cost / (time.time() - t.t_start), 4) if recs else None,
            "served_prompts": last.get("prompts"), "served_tau_greedy": last.get("tau_greedy"),
            "served_tau_sampled": last.get("tau_sampled"),
            **{f"served_accept_rate_pos_greedy_{k}": v for k, v in enumerate(last.get("accept_rate_pos_greedy") or [])}}


def outside_draft_vocab(t, last_val: dict[str, Any]) -> dict[str, Any]:
    """Counted positions whose verifier argmax lies outside the draft vocabulary: from the training steps, or from the
    last validation when train.target_logits=draft (the steps then never look outside)."""
    if t.cfg.target_logits == "draft":
        n, pos = last_val.get("positions_outside_draft_vocab"), last_val.get("positions")
        return {"argmax_outside_draft_vocab": n, "argmax_outside_draft_vocab_frac": n / pos if n is not None and pos
                else None, "argmax_outside_draft_vocab_from": "validation"}
    pr = t.loop.progress
    return {"argmax_outside_draft_vocab": pr.oov_step0, "argmax_outside_draft_vocab_frac":
            pr.oov_step0 / pr.counted_step0 if pr.counted_step0 else 0.0, "argmax_outside_draft_vocab_from": "training"}
