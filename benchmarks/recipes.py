"""Drafting recipes side by side on one finished run: the drafter trained again with each recipe on the same store,
then all measured through vLLM on the same held-out prompts and K (`evaluate.drafters`).

  .venv/bin/python benchmarks/recipes.py --run-dir runs/demo                       # the losses of train.loss
  .venv/bin/python benchmarks/recipes.py --run-dir runs/demo --recipes jsd tv      # a subset

Each recipe trains in RUN/recipes/<name>/ (its own run directory whose generate/ and extract/ link to RUN's, so the
data is the same and nothing is extracted twice; resumable, skipped when done), with the train stage's settings plus
the recipe's `--set`s. The measurement is one evaluate run in RUN/recipes/compare/ over RUN's own drafter with the
recipes' drafters beside it (P-EAGLE's checkpoint served with `parallel_drafting: true`, the others as chains).
Printed and written to RUN/recipes/compare/recipes.json: per recipe, the best validation's estimate, vLLM's greedy tau
and the training time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

RECIPES = {  # name -> train overrides (the train stage's own run is "kl", the default loss)
    "reverse_kl": ["train.loss=reverse_kl"],
    "jsd": ["train.loss=jsd"],
    "tv": ["train.loss=tv"],
    "ce_argmax": ["train.loss=ce_argmax"],
    "eagle3.1": ["train.fc_norm=true", "train.norm_output=true"],
    # P-EAGLE: all K drafts from one forward; served with parallel_drafting: true (eagle3lib/vllm/speculative_config.py)
    "peagle": ["train.parallel_drafting=true"],
}


def run(args: list[str]) -> None:
    cmd = [sys.executable, "-m", "eagle3lib", "run", *args]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", required=True, help="a finished run (generate, extract, train, evaluate)")
    ap.add_argument("--profile", default="tiny")
    ap.add_argument("--recipes", nargs="*", default=list(RECIPES), choices=list(RECIPES))
    ap.add_argument("--set", action="append", default=[], dest="sets", help="extra overrides for every run")
    a = ap.parse_args()
    base = Path(a.run_dir).resolve()
    sets = [x for s in a.sets for x in ("--set", s)]
    drafters = {}
    for name in a.recipes:
        rdir = base / "recipes" / name
        rdir.mkdir(parents=True, exist_ok=True)
        for stage in ("generate", "extract"):
            if not (rdir / stage).exists():
                (rdir / stage).symlink_to(base / stage, target_is_directory=True)
        run(["--profile", a.profile, "--run-dir", str(rdir), "--stages", "train", *sets,
             *[x for s in RECIPES[name] for x in ("--set", s)]])
        drafters[name] = rdir / "train" / "best"
    cdir = base / "recipes" / "compare"
    cdir.mkdir(parents=True, exist_ok=True)
    for stage in ("generate", "extract", "train"):
        if not (cdir / stage).exists():
            (cdir / stage).symlink_to(base / stage, target_is_directory=True)
    listed = json.dumps([str(p) for p in drafters.values()])
    run(["--profile", a.profile, "--run-dir", str(cdir), "--stages", "evaluate", "--force",  # greedy unless --set
         "--set", f"evaluate.drafters={listed}", "--set", "evaluate.modes=[greedy]", *sets])
    rows = [{"recipe": "kl (the run's own)", "train_dir": str(base / "train")}]
    rows += [{"recipe": n, "train_dir": str(p.parent)} for n, p in drafters.items()]
    results = json.loads((cdir / "evaluate" / "results.json").read_text())
    side = results.get("drafters") or []
    for i, row in enumerate(rows):
        tm = json.loads((Path(row["train_dir"]) / "manifest.json").read_text())["figures"]
        row.update(val_tau_est=tm.get("best_val_tau_est"), train_s=tm.get("train_s"), steps=tm.get("steps"))
        got = side[i] if i < len(side) else {}  # row 0: the run's own drafter, from the main measurement
        row.update({k: v for k, v in got.items() if k.startswith("tau_ctx_")})  # per context bucket, when configured
        row["served_as"] = got.get("served_as", "chain")
        row.update(tau_vllm_greedy=got.get("tau"), tokens_per_s=got.get("tokens_per_s"),
                   accept_rates=[got.get(f"accept_rate_pos_{j}") for j in range(1, 6) if got.get(f"accept_rate_pos_{j}")])
    (cdir / "recipes.json").write_text(json.dumps(rows, indent=2))
    ctx = [k for k in rows[0] if k.startswith("tau_ctx_")]
    print(f"{'recipe':20} {'served as':>9} {'val est':>8} {'vLLM tau':>9} {'tok/s':>7} {'train s':>8}  acceptance per position"
          + "".join(f"  {k.removeprefix('tau_'):>12}" for k in ctx))
    for r in rows:
        rates = " ".join(f"{x:.2f}" for x in r["accept_rates"])
        print(f"{r['recipe']:20} {r['served_as']:>9} {r['val_tau_est'] or 0:8.3f} {r['tau_vllm_greedy'] or 0:9.3f} "
              f"{r['tokens_per_s'] or 0:7.0f} {r['train_s'] or 0:8.0f}  {rates}"
              + "".join(f"  {r.get(k) or 0:12.3f}" for k in ctx))


if __name__ == "__main__":
    main()
