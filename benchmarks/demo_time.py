"""Where the demo's time goes: the per-stage wall times of a run, from its manifests (nothing is timed twice).

    .venv/bin/python benchmarks/demo_time.py runs/demo                  # a finished run
    .venv/bin/python benchmarks/demo_time.py --run runs/demo-timing     # run the demo pipeline into it first

Per stage: the notebook's wall time (kernel start-up and report included), the stage's own wall time, and the parts
its manifest names (server start-up, model load, the work itself); then the total. `make setup` is not part of a run:
time it with `time make setup` on a fresh clone.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

STAGES = ("verifier", "generate", "extract", "train", "evaluate", "data_scaling", "learning_curves", "cost_projection",
          "compare_runs")
PARTS = {  # figures that split a stage's time, when its manifest has them
    "verifier": ("resolve_seconds", "server_start_s"),
    "generate": ("server_start_s", "wall_s"),
    "extract": ("tokenize_s", "setup_s", "wall_s"),
    "train": ("train_s",),
    "evaluate": (),
}


def table(run_dir: Path) -> list[dict]:
    rows = []
    for s in STAGES:
        path = run_dir / s / "manifest.json"
        if not path.exists():
            continue
        m = json.loads(path.read_text())
        f = m.get("figures") or {}
        rows.append({"stage": s, "status": m.get("status"), "notebook_s": m.get("notebook_wall_s"),
                     "stage_s": m.get("wall_s"), "parts": {k: f[k] for k in PARTS.get(s, ()) if f.get(k) is not None},
                     "server_mode": f.get("server_mode")})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", nargs="?", type=Path, default=None)
    ap.add_argument("--run", type=Path, default=None, help="run `python -m eagle3lib run --profile tiny` into this dir")
    a = ap.parse_args()
    run_dir = a.run or a.run_dir
    if run_dir is None:
        ap.error("give a run directory, or --run DIR")
    total_wall = None
    if a.run:
        t0 = time.time()
        subprocess.run([sys.executable, "-m", "eagle3lib", "run", "--profile", "tiny", "--run-dir", str(a.run)],
                       check=True)
        total_wall = time.time() - t0
    rows = table(run_dir)
    if not rows:
        print(f"no stage manifests in {run_dir}", file=sys.stderr)
        return 1
    print(f"{'stage':16} {'status':9} {'notebook':>9} {'stage':>8}  parts")
    for r in rows:
        parts = ", ".join(f"{k} {v:,.0f} s" for k, v in r["parts"].items())
        mode = f" [server {r['server_mode']}]" if r["server_mode"] else ""
        nb, st = r["notebook_s"], r["stage_s"]
        print(f"{r['stage']:16} {r['status']:9} {nb or 0:8.0f}s {st or 0:7.0f}s  {parts}{mode}")
    run = json.loads((run_dir / "run.json").read_text()) if (run_dir / "run.json").exists() else {}
    if run.get("shared_server_start_s"):
        print(f"{'(shared server)':16} {'':9} {run['shared_server_start_s']:8.0f}s  one verifier server for the "
              "verifier report and generate, started by the runner")
    total = sum(r["notebook_s"] or 0 for r in rows) + (run.get("shared_server_start_s") or 0)
    print(f"{'total':16} {'':9} {total:8.0f}s ({total / 60:.1f} min)"
          + (f"; the whole command {total_wall:.0f} s ({total_wall / 60:.1f} min)" if total_wall else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
