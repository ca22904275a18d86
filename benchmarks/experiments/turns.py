"""`generate.turns: last` vs `all` on the same multi-turn prompts: two drafters of the tiny verifier, each trained on
its own data, measured side by side through vLLM on the same held-out first and second turns.

  .venv/bin/python benchmarks/experiments/turns.py                      # into runs/turns/ (~25 min on 2 cores; resumable)

Data: two-turn conversations of the tiny corpus as chat logs have them (the earlier answer's content only, no
reasoning): `last` answers the second question after that logged answer, `all` answers both questions, the second
after the verifier's own first answer. Held out: other two-turn conversations; their first turns, and their second
turns after the verifier's own first answers (what a served conversation looks like), made by `generate.turns: all`
on the held-out set. Each drafter trains the same number of steps. Writes runs/turns/turns.json and prints the table.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from eagle3lib.data.records import iter_generated
from eagle3lib.tiny import corpus

SETS = ["generate.max_tokens=256", "generate.progress=false", "extract.progress=false", "train.max_steps=300",
        "train.epochs=30", "train.nproc_per_node=2", "evaluate.modes=[greedy]", "evaluate.library=false",
        "evaluate.max_tokens=64", "evaluate.n_prompts=null"]


def run(run_dir: Path, stages: str, sets: list[str], force: bool = False) -> None:
    cmd = [sys.executable, "-m", "eagle3lib", "run", "--profile", "tiny", "--run-dir", str(run_dir), "--stages", stages,
           *(["--force"] if force else [])]
    for s in [*SETS, *sets]:
        cmd += ["--set", s]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def two_turns(path: Path, seed: int, n: int) -> Path:
    """n two-turn conversations, the assistant turns as chat logs keep them (content, no reasoning)."""
    rows = []
    for i in range(n):
        s = corpus.sample(seed, i, p_two_turns=1.0)
        rows.append({"id": f"t{seed}-{i}", "category": s["category"],
                     "messages": [{"role": m["role"], "content": m["content"]} for m in s["messages"]]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/turns", type=Path)
    ap.add_argument("--conversations", type=int, default=400)
    ap.add_argument("--heldout", type=int, default=24)
    a = ap.parse_args()
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    train = two_turns(out / "train.jsonl", 41, a.conversations)
    held = two_turns(out / "heldout.jsonl", 42, a.heldout)
    for mode in ("last", "all"):
        run(out / mode, "generate,extract,train", [f"generate.dataset={train}", f"generate.turns={mode}"])
    # the held-out second turns after the verifier's own first answers
    run(out / "heldout", "generate", [f"generate.dataset={held}", "generate.turns=all", "generate.temperature=0"])
    first, second = out / "first-turns.jsonl", out / "second-turns.jsonl"
    convs = list(iter_generated(out / "heldout" / "generate"))
    first.write_text("".join(json.dumps({"id": c.id, "category": "turn-1", "messages": c.messages[:1]}) + "\n"
                             for c in convs))
    second.write_text("".join(json.dumps({"id": c.id, "category": "turn-2", "messages": c.messages[:3]}) + "\n"
                              for c in convs))
    rows = {"last": {}, "all": {}}
    for name, prompts in (("first", first), ("second", second)):
        cdir = out / f"compare-{name}"
        cdir.mkdir(exist_ok=True)
        for stage in ("generate", "extract", "train"):
            if not (cdir / stage).exists():
                (cdir / stage).symlink_to(out / "all" / stage, target_is_directory=True)
        run(cdir, "evaluate", [f"evaluate.prompts={prompts}", f"evaluate.drafters={json.dumps([str(out / 'last' / 'train' / 'best')])}"])
        side = json.loads((cdir / "evaluate" / "results.json").read_text())["drafters"]
        rows["all"][f"tau_{name}_turn"], rows["last"][f"tau_{name}_turn"] = side[0]["tau"], side[1]["tau"]
    for mode in ("last", "all"):
        g = json.loads((out / mode / "generate" / "manifest.json").read_text())["figures"]
        t = json.loads((out / mode / "train" / "manifest.json").read_text())["figures"]
        e = json.loads((out / mode / "extract" / "manifest.json").read_text())["figures"]
        rows[mode].update(samples_ok=g["samples_ok"], output_tokens=g["output_tokens"], loss_tokens=e["loss_tokens"],
                          val_tau_est=t.get("best_val_tau_est") or t.get("val_tau_est"), steps=t["steps"])
    (out / "turns.json").write_text(json.dumps(rows, indent=2))
    print(f"{'generate.turns':15} {'samples':>8} {'gen tokens':>11} {'loss tokens':>12} {'val est':>8} "
          f"{'tau turn 1':>11} {'tau turn 2':>11}")
    for mode, r in rows.items():
        print(f"{mode:15} {r['samples_ok']:8d} {r['output_tokens']:11,d} {r['loss_tokens']:12,d} {r['val_tau_est']:8.3f} "
              f"{r['tau_first_turn']:11.3f} {r['tau_second_turn']:11.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
