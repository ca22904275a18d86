"""eagle3lib against its peer speculators 0.9 (vLLM's own training library) on the same work: one run's extract store
(a real model's regenerated answers), the same training rows and draft vocabulary, the same wall time of training on
the same cores, then vLLM serving each drafter on the same held-out prompts, K = 3, greedy and sampled, every prompt
alone so that tau has an interval over prompts. Two training seeds per library.

    make peer-setup      # .venv-speculators: torch 2.13.0 + speculators 0.9.0 in a virtual environment of its own
    .venv/bin/python benchmarks/experiments/peer_speculators.py --profile params/smollm2.yaml --run-dir runs/smollm2 \\
        [--steps 400] [--seeds 0 1] [--n-prompts 64]          # into RUN_DIR/peer/
    ... --peer-lr 3e-3    # speculators at another peak lr than its default 1e-3 (its own folders and results file)

Protocol, per seed s:
  1. eagle3lib trains as the train stage (the profile's settings, train.seed s, train.max_steps --steps) in
     RUN_DIR/peer/eagle3lib-s{s}/; its training seconds W (manifest train_s) set the budget.
  2. speculators gets the same rows: the samples of that seed's training split first, then its validation samples
     (its --train-data-ratio cuts there), hidden states as its hs_{i}.safetensors files ([T, 4, H]: the three feature
     layers, then the final state before the norm), the same draft vocabulary (our d2t / t2d), feature layers, K,
     row length and thread count; everything else is its own recipe (Muon + AdamW at 1e-3, linear schedule with 1%
     warmup, EAGLE 3.1 norms, the lm_head kept at the verifier's rows). It trains for W seconds; its schedule spans the
     steps W holds at the rate a 60-second calibration run measured (seed 0).
  3. vLLM serves each drafter (one server each, the profile's verifier settings), warm-up, then the evaluate section's
     prompts one at a time, greedy and at evaluate.temperature: tau, acceptance per position, per prompt.
What differs from speculators' standard pipeline: its data preparation runs vLLM on a GPU to render chats and capture
hidden states; here both libraries train on eagle3lib's extract store (HF forward hooks), converted. Both train in one
process of 2 threads (the profile's train.nproc_per_node; speculators' multi-process path needs an accelerator).
Training tokens are the non-padding tokens of the packed rows, per second of training.

Prints, per library: tau greedy / sampled with 95% bootstrap intervals over prompts (both seeds pooled per prompt), per
seed, on answers that do not loop, acceptance per position, training tokens/s; then eagle3lib / speculators ratios of
tau (paired bootstrap over prompts) and of tokens/s. Everything also goes to RUN_DIR/peer/results.json; each phase (training,
serving) is kept and reused when the command is run again.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
PEER_PY = REPO / ".venv-speculators" / "bin" / "python"
PEER_SCRIPT = REPO / "benchmarks" / "experiments" / "peer_speculators_train.py"
CALIBRATION_S = 60.0
BUDGET_TOLERANCE = 0.05  # a speculators run trained within 5% of this comparison's seconds is reused


def say(msg: str) -> None:
    print(f"[peer {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def load_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def peer(args: list[str], log: Path) -> None:
    """Run speculators' side in its own environment; its output goes to `log`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    with open(log, "a") as f:
        code = subprocess.run([str(PEER_PY), str(PEER_SCRIPT), *args], stdout=f, stderr=subprocess.STDOUT, env=env,
                              cwd=str(log.parent)).returncode
    if code != 0:
        tail = log.read_text().splitlines()[-15:]
        raise SystemExit(f"speculators failed (exit {code}); the end of {log}:\n" + "\n".join(tail))


# ------------------------------------------------------------------------------------------------ the same data

def export_states(reader, out: Path) -> None:
    """Every stored sample as speculators' hs file, named by store index (a seed's data folder links to them in its
    own row order)."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for i in range(len(reader)):
        path = out / f"{i}.safetensors"
        if path.exists():
            continue
        s = reader[i]
        states = torch.cat([s.aux_hidden, s.final_hidden.unsqueeze(1)], dim=1).to(torch.bfloat16).contiguous()
        tmp = path.with_suffix(".tmp")
        save_file({"token_ids": s.input_ids.long().contiguous(), "hidden_states": states}, str(tmp))
        os.replace(tmp, path)


def seed_data(reader, split, states: Path, vocab_file: Path, out: Path) -> dict[str, Any]:
    """RUN_DIR/peer/speculators-data-s{s}: the seed's training samples, then its validation samples, as speculators reads them;
    our draft vocabulary as its d2t / t2d files."""
    import numpy as np

    from eagle3lib.model.draft_vocab import DraftVocab

    order = list(split.train) + list(split.val)
    vocab = DraftVocab.load(vocab_file)
    d2t = vocab.d2t.numpy().astype(np.int64)
    if (out / "dataset_info.json").exists() and not np.array_equal(np.load(out / "d2t.npy"), d2t):
        # a folder prepared for another draft vocabulary (draft_vocab_size or the store changed): its d2t would
        # silently train speculators on other rows than ours
        say(f"{out.name}: prepared for another draft vocabulary: prepared again")
        shutil.rmtree(out)
    if not (out / "dataset_info.json").exists():
        (out / "hidden_states").mkdir(parents=True, exist_ok=True)
        rows = []
        for row, i in enumerate(order):
            link = out / "hidden_states" / f"hs_{row}.safetensors"
            if not link.exists():
                link.symlink_to(states / f"{i}.safetensors")
            s = reader[i]
            rows.append(json.dumps({"input_ids": s.input_ids.tolist(), "loss_mask": s.loss_mask.int().tolist()}))
        (out / "rows.jsonl").write_text("\n".join(rows) + "\n")
        np.save(out / "d2t.npy", d2t)
        np.save(out / "t2d.npy", vocab.t2d.numpy().astype(bool))
        peer(["prepare", str(out)], out / "prepare.log")
    return {"train_samples": len(split.train), "samples": len(order),
            "vocab": hashlib.sha256(d2t.tobytes()).hexdigest()[:16]}


# ------------------------------------------------------------------------------------------------ training

def train_ours(ctx, out: Path, seed: int, steps: int | None) -> dict[str, Any]:
    from eagle3lib.training.variants import QUIET, train_variant

    over = {"train.seed": seed, **QUIET, **({"train.max_steps": steps} if steps else {})}
    m, reused = train_variant(ctx, out, over, f"eagle3lib, seed {seed}", echo=say)
    f = m["figures"]
    return {"checkpoint": str(out / "final"), "steps": f["steps"], "train_seconds": f["train_s"],
            "tokens_per_s": f["tokens_per_s"], "val_tau_est": f.get("val_tau_est"), "reused": reused}


def train_peer(ctx, data: Path, out: Path, seed: int, budget_s: float, total_steps: int | None,
               info: dict[str, Any], lr: float | None = None) -> dict[str, Any]:
    import numpy as np

    from eagle3lib.model.verifier import aux_layer_ids, load_config, resolve_model

    if (summary := load_json(out / "summary.json")) is not None:
        kept = summary.get("budget_s", summary["train_seconds"])  # older summaries: it stopped at its budget
        same_vocab = summary.get("vocab") == info["vocab"]
        if same_vocab and abs(kept - budget_s) <= BUDGET_TOLERANCE * budget_s:
            return {**summary, "reused": True}
        why = "another draft vocabulary" if not same_vocab else f"{kept:.0f} s, this comparison needs {budget_s:.0f} s"
        say(f"{out.name}: trained for {why}: trained again")
        shutil.rmtree(out)
    tcfg, vcfg = ctx.profile.section("train"), ctx.verifier
    model_path = resolve_model(vcfg.model)
    layers = int(load_config(model_path).num_hidden_layers)
    n_draft = int(np.load(data / "d2t.npy").shape[0])
    flags = ["--verifier-name-or-path", model_path, "--data-path", str(data), "--save-path", str(out),
             "--log-dir", str(out / "logs"), "--target-layer-ids", *map(str, aux_layer_ids(vcfg.aux_layer_ids, layers)),
             "--draft-vocab-size", str(n_draft), "--d2t-path", str(data / "d2t.npy"), "--t2d-path", str(data / "t2d.npy"),
             "--total-seq-len", str(tcfg.packed_row_tokens), "--ttt-steps", str(tcfg.ttt_steps),
             "--train-data-ratio", f"{info['train_samples'] / info['samples']:.6f}", "--seed", str(seed),
             "--epochs", "1000", "--mask-token-id", "0", "--loss-implementation", "eager", "--draft-attn-impl", "sdpa",
             "--num-workers", "0", "--on-missing", "raise"]
    if total_steps:
        flags += ["--max-steps", str(total_steps), "--scheduler-total-steps", str(total_steps)]
    if lr is not None:
        flags += ["--lr", repr(lr)]  # Muon's lr follows it (its --muon-lr defaults to --lr)
    out.mkdir(parents=True, exist_ok=True)
    peer(["train", "--time-budget", f"{budget_s:.1f}", "--threads", str(os.cpu_count() or 2), "--", *flags],
         out / "train.log")
    summary = {**json.loads((out / "summary.json").read_text()), "budget_s": round(budget_s, 1), "vocab": info["vocab"]}
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return {**summary, "reused": False}


# ------------------------------------------------------------------------------------------------ serving

def serve(ctx, ckpt: str, prompts, out: Path, key: dict[str, Any]) -> dict[str, Any]:
    """Greedy and sampled passes of one drafter, every prompt alone; kept in `out` keyed by what it depends on."""
    from eagle3lib.evaluation.phases import load_phase, save_phase
    from eagle3lib.model.verifier import resolve_model
    from eagle3lib.vllm.measure import run_pass, warmup
    from eagle3lib.vllm.serving import served

    if (cached := load_phase(out.parent, out.name, key)) is not None:
        return cached
    # a train context (the peer's folder): the evaluate section read as the benchmark's own setting
    cfg, vcfg = ctx.profile.unscoped.section("evaluate"), ctx.verifier
    k = key["ttt_steps"]
    res: dict[str, Any] = {}
    with served(vcfg, resolve_model(vcfg.model), out.parent / f"{out.name}.log", ckpt, k,
                server_args=cfg.server_args) as ep:
        for mode, t in (("greedy", 0.0), ("sampled", cfg.temperature)):
            warmup(ep, prompts, cfg.warmup_requests, min(16, cfg.max_tokens), t, cfg.request_timeout_s)
            res[mode] = run_pass(ep, prompts, temperature=t, max_tokens=cfg.max_tokens, concurrency=1,
                                 request_timeout_s=cfg.request_timeout_s, connect_timeout_s=cfg.connect_timeout_s,
                                 counters=True, label=f"{out.name} {mode}", per_prompt=True)
    save_phase(out.parent, out.name, key, res)
    return res


# ------------------------------------------------------------------------------------------------ summary

def summarize(served: dict[str, dict[int, dict[str, Any]]], trained: dict[str, dict[int, dict[str, Any]]],
              stop_ids: list[int]) -> dict[str, Any]:
    from eagle3lib.data.loops import loops
    from eagle3lib.evaluation.per_prompt import pooled, ratio_interval, tau_interval

    def rows_of(lib: str, mode: str) -> list[dict[str, Any]]:
        """Per prompt, the seeds' counters summed: one row per prompt for the bootstrap."""
        by_id: dict[str, dict[str, Any]] = {}
        for res in served[lib].values():
            for pid, r in res[mode]["per_prompt"].items():
                row = by_id.setdefault(pid, {"id": pid, "rounds": 0, "accepted": 0, "accepted_per_pos": None})
                row["rounds"] += r["rounds"]
                row["accepted"] += r["accepted"]
                pos = r.get("accepted_per_pos") or []
                row["accepted_per_pos"] = [a + b for a, b in zip(row["accepted_per_pos"] or [0] * len(pos), pos,
                                                                 strict=True)]
        return list(by_id.values())

    def looping_ids(lib: str, mode: str) -> set[str]:
        return {pid for res in served[lib].values() for pid, ids in res[mode]["outputs"].items()
                if ids and loops(ids, stop_ids)}

    out: dict[str, Any] = {"libraries": {}, "ratios": {}}
    for lib in served:
        entry: dict[str, Any] = {}
        for mode in ("greedy", "sampled"):
            rows = rows_of(lib, mode)
            loop = looping_ids(lib, mode)
            rest = [r for r in rows if r["id"] not in loop]
            entry[mode] = {**pooled(rows), "interval": tau_interval(rows),
                           "per_seed": {s: res[mode]["tau"] for s, res in served[lib].items()},
                           "looping_share": len(loop & {r["id"] for r in rows}) / len(rows),
                           "tau_not_looping": pooled(rest)["tau"], "interval_not_looping": tau_interval(rest)}
        runs = trained[lib].values()
        entry["training"] = {"tokens_per_s": sum(r["tokens_per_s"] for r in runs) / len(runs),
                             "per_seed": {s: {k: r.get(k) for k in ("steps", "train_seconds", "tokens_per_s")}
                                          for s, r in trained[lib].items()}}
        out["libraries"][lib] = entry
    a, b = "eagle3lib", "speculators"
    if a in served and b in served:
        for mode in ("greedy", "sampled"):
            ra, rb = rows_of(a, mode), rows_of(b, mode)
            out["ratios"][f"tau_{mode}"] = {"ratio": pooled(ra)["tau"] / pooled(rb)["tau"],
                                            "interval": ratio_interval(ra, rb)}
        out["ratios"]["training_tokens_per_s"] = (out["libraries"][a]["training"]["tokens_per_s"]
                                                  / out["libraries"][b]["training"]["tokens_per_s"])
        outs = [res["greedy"]["outputs"] for lib in (a, b) for res in served[lib].values()]
        ids = set.intersection(*(set(o) for o in outs))
        out["greedy_outputs_identical_frac"] = sum(all(o[i] == outs[0][i] for o in outs) for i in ids) / len(ids)
    return out


def print_table(s: dict[str, Any]) -> None:
    def tau(e: dict[str, Any]) -> str:
        lo, hi = e["interval"] or (float("nan"), float("nan"))
        return f"{e['tau']:.3f} [{lo:.3f}, {hi:.3f}]"

    print(f"\n{'library':12} {'tau greedy [95%]':>22} {'tau sampled [95%]':>22} {'not looping (greedy)':>21} "
          f"{'accept 1/2/3 (greedy)':>22} {'train tok/s':>12}")
    for lib, e in s["libraries"].items():
        acc = " / ".join(f"{x:.2f}" for x in e["greedy"]["accept_rate_pos"])
        print(f"{lib:12} {tau(e['greedy']):>22} {tau(e['sampled']):>22} {e['greedy']['tau_not_looping']:>21.3f} "
              f"{acc:>22} {e['training']['tokens_per_s']:>12.0f}")
        seeds = ", ".join(f"seed {k}: {v:.3f}" for k, v in e["greedy"]["per_seed"].items())
        print(f"{'':12} greedy per seed: {seeds}; looping answers {e['greedy']['looping_share']:.0%}")
    for name, r in s["ratios"].items():
        if isinstance(r, dict):
            lo, hi = r["interval"] or (float("nan"), float("nan"))
            print(f"eagle3lib / speculators {name}: {r['ratio']:.3f}x [{lo:.3f}, {hi:.3f}]")
        else:
            print(f"eagle3lib / speculators {name}: {r:.2f}x")
    if "greedy_outputs_identical_frac" in s:
        n = sum(len(v) for v in s["protocol"]["trained"].values())
        print(f"greedy outputs identical across the {n} drafters: {s['greedy_outputs_identical_frac']:.0%} of prompts")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default="params/smollm2.yaml")
    ap.add_argument("--run-dir", required=True, help="a run whose extract stage is complete")
    ap.add_argument("--steps", type=int, default=None, help="eagle3lib's optimizer steps (default: the profile's)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--n-prompts", type=int, default=None, help="held-out prompts (default: evaluate.n_prompts)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="profile overrides (train.* changes eagle3lib's recipe only)")
    ap.add_argument("--tag", default="", help="name eagle3lib's folders and the results file with this (another recipe "
                    "beside the profile's own)")
    ap.add_argument("--peer-lr", type=float, default=None, help="speculators' peak lr (default: its own, 1e-3); "
                    "its folders and the results file are named by it")
    a = ap.parse_args()
    if not PEER_PY.exists():
        raise SystemExit(f"{PEER_PY} is missing: run `make peer-setup` first")

    from eagle3lib.config.profile import parse_set
    from eagle3lib.config.stages import open_stage
    from eagle3lib.data.hidden_store import HiddenStateReader
    from eagle3lib.data.packing import split_samples
    from eagle3lib.evaluation.inputs import select_prompts
    from eagle3lib.evaluation.phases import fingerprint
    from eagle3lib.model.verifier import eos_ids, load_tokenizer, resolve_model

    over = parse_set(a.set)
    tag = f"-{a.tag}" if a.tag else ""
    ptag = f"-lr{a.peer_lr:g}" if a.peer_lr is not None else ""
    if a.n_prompts:
        over["evaluate.n_prompts"] = a.n_prompts
    out = open_stage("train", a.profile, a.run_dir, over, say=lambda _m: None).run_dir / "peer"
    out.mkdir(parents=True, exist_ok=True)
    # peer/ as the stage's folder: train_variant keeps every variant inside it (never the run's train/)
    ctx = open_stage("train", a.profile, out.parent, over, say=lambda _m: None, out_dir=out)
    tcfg, ecfg, vcfg = ctx.profile.section("train"), ctx.profile.unscoped.section("evaluate"), ctx.verifier
    model_path = resolve_model(vcfg.model)
    reader = HiddenStateReader(ctx.stage_dir("extract"))
    say(f"{len(reader)} samples in {ctx.stage_dir('extract')}; writing speculators' hidden-state files")
    export_states(reader, out / "speculators-states")
    tok = load_tokenizer(model_path)
    prompts, _, _ = select_prompts(ecfg, tok, vcfg.max_model_len, tcfg.ttt_steps)
    stop_ids = eos_ids(tok, model_path)
    trained: dict[str, dict[int, dict[str, Any]]] = {"eagle3lib": {}, "speculators": {}}
    served: dict[str, dict[int, dict[str, Any]]] = {"eagle3lib": {}, "speculators": {}}
    rate = None  # speculators' steps per second (the calibration run)
    for seed in a.seeds:
        ours = train_ours(ctx, out / f"eagle3lib{tag}-s{seed}", seed, a.steps)
        trained["eagle3lib"][seed] = ours
        say(f"eagle3lib seed {seed}: {ours['steps']} steps in {ours['train_seconds']:.0f} s, "
            f"{ours['tokens_per_s']:.0f} tokens/s")
        n_all = len(reader) if tcfg.max_samples is None else min(len(reader), tcfg.max_samples)
        split = split_samples(n_all, tcfg.val_fraction, tcfg.val_max_samples, seed, reader.ids[:n_all])
        data = out / f"speculators-data-s{seed}"
        info = seed_data(reader, split, out / "speculators-states", out / f"eagle3lib{tag}-s{seed}" /
                         "draft_vocab.safetensors", data)
        if rate is None:
            cal = out / "speculators-calibration"
            if (c := load_json(cal / "summary.json")) is None:
                say(f"speculators: {CALIBRATION_S:.0f} s calibration run (its steps per second)")
            c = train_peer(ctx, data, cal, seed, CALIBRATION_S, None, info)
            rate = c["steps"] / c["train_seconds"]
        total = max(1, int(rate * ours["train_seconds"]))
        say(f"speculators seed {seed}: {ours['train_seconds']:.0f} s, schedule over {total} steps "
            f"({rate:.2f} steps/s in calibration)")
        theirs = train_peer(ctx, data, out / f"speculators{ptag}-s{seed}", seed, ours["train_seconds"], total, info,
                            a.peer_lr)
        trained["speculators"][seed] = theirs
        say(f"speculators seed {seed}: {theirs['steps']} steps in {theirs['train_seconds']:.0f} s, "
            f"{theirs['tokens_per_s']:.0f} tokens/s")
    for seed in a.seeds:  # serving after all training: no server runs while a library trains
        for lib, ckpt in (("eagle3lib", trained["eagle3lib"][seed]["checkpoint"]),
                          ("speculators", trained["speculators"][seed]["checkpoint"])):
            key = {"ckpt": fingerprint(Path(ckpt)), "prompts": [[p.id, p.token_ids] for p in prompts], "ttt_steps": tcfg.ttt_steps,
                   "max_tokens": ecfg.max_tokens, "temperature": ecfg.temperature, "verifier": vcfg.model}
            say(f"vLLM serving {lib} seed {seed}: {len(prompts)} prompts, greedy and sampled")
            name = f"served-{lib}{tag if lib == 'eagle3lib' else ptag}-s{seed}"
            served[lib][seed] = serve(ctx, ckpt, prompts, out / name, key)
    s = summarize(served, trained, stop_ids)
    s["protocol"] = {"profile": a.profile, "overrides": a.set, "tag": a.tag, "peer_lr": a.peer_lr, "run_dir": str(Path(a.run_dir)), "seeds": a.seeds, "prompts": len(prompts),
                     "max_tokens": ecfg.max_tokens, "temperature": ecfg.temperature, "ttt_steps": tcfg.ttt_steps,
                     "trained": trained}
    (out / f"results{tag}{ptag}.json").write_text(json.dumps(s, indent=1) + "\n")
    print_table(s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
