"""Recipes trained with several seeds (`recipes.seeds`): which differences between recipes the measurements support.

One training seed ranks recipes by one draw of their initialisation and data order; on the demo's store two seeds of
one recipe can differ by as much as two recipes do. So each recipe is trained once per seed and every drafter is
measured with every prompt alone (vLLM's counters read around it), and then:

- a recipe's tau pools its seeds: per prompt, the seeds' rounds and accepted drafts add up, so the percentile bootstrap
  over prompts (eagle3lib/evaluation/per_prompt.py) resamples prompts with every seed's answer to them;
- its difference to the reference recipe (the first of `recipes.names`) is paired by prompt, the same resampled
  prompts for both, seeds pooled alike;
- a difference is **supported** when that interval excludes 0 and every seed's own difference has the same sign:
  the prompts' noise and the seeds' noise both fail to explain it. Otherwise the two recipes are not told apart here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from eagle3lib.evaluation.per_prompt import difference_interval, pooled, tau_interval

Rows = list[dict[str, Any]]  # per-prompt rows: id, rounds, accepted, accepted_per_pos


def pool_seeds(per_seed: Sequence[Rows]) -> Rows:
    """One row per prompt id: the seeds' rounds, accepted drafts and per-position accepts added (prompts every seed
    measured)."""
    ids = set.intersection(*({r["id"] for r in rows} for rows in per_seed)) if per_seed else set()
    out = []
    for pid in sorted(ids):
        rows = [next(r for r in seed if r["id"] == pid) for seed in per_seed]
        k = max(len(r.get("accepted_per_pos") or []) for r in rows)
        out.append({"id": pid, "rounds": sum(int(r["rounds"]) for r in rows),
                    "accepted": sum(int(r["accepted"]) for r in rows),
                    "accepted_per_pos": [sum((r.get("accepted_per_pos") or [0] * k)[i] for r in rows)
                                         for i in range(k)]})
    return out


def recipe_summary(per_seed: Sequence[Rows]) -> dict[str, Any]:
    """tau and acceptance per position pooled over seeds, tau's interval over prompts, and each seed's own tau."""
    rows = pool_seeds(per_seed)
    total = pooled(rows)
    return {"tau": total["tau"], "accept_rate_pos": total["accept_rate_pos"], "tau_interval": tau_interval(rows),
            "tau_seeds": [pooled(seed)["tau"] for seed in per_seed]}


def versus(per_seed: Sequence[Rows], reference: Sequence[Rows]) -> dict[str, Any]:
    """This recipe's tau minus the reference's: pooled over seeds, its paired interval over prompts, each seed's own
    difference (seed i against the reference's seed i), and whether the difference is supported."""
    a, b = pool_seeds(per_seed), pool_seeds(reference)
    ta, tb = pooled(a)["tau"], pooled(b)["tau"]
    diff = ta - tb if ta is not None and tb is not None else None
    interval = difference_interval(a, b)
    seeds = []
    for x, y in zip(per_seed, reference, strict=True):
        tx, ty = pooled(x)["tau"], pooled(y)["tau"]
        seeds.append(tx - ty if tx is not None and ty is not None else None)
    supported = (interval is not None and (interval[0] > 0 or interval[1] < 0) and None not in seeds
                 and all((s > 0) == (interval[0] > 0) and s != 0 for s in seeds))
    return {"difference": diff, "difference_interval": interval, "difference_seeds": seeds, "supported": supported}


def verdict(name: str, reference: str, cmp: dict[str, Any]) -> str:
    """The comparison in words, for the report."""
    if cmp["difference"] is None:
        return f"{name}: no tau to compare"
    lo, hi = cmp["difference_interval"] or (None, None)
    iv = f" [{lo:+.2f}, {hi:+.2f}]" if lo is not None else ""
    seeds = ", ".join(f"{s:+.2f}" if s is not None else "-" for s in cmp["difference_seeds"])
    word = ("above" if cmp["difference"] > 0 else "below") if cmp["supported"] else "not told apart from"
    return f"{name} {word} {reference}: {cmp['difference']:+.2f}{iv} (per seed {seeds})"


def pool_rows(rows: list[dict[str, Any]], measured: dict[str, list[dict[str, Any]]],
              trained: dict[str, list[dict[str, Any]]], base: dict[str, Any], modes: list[str]) -> dict[str, list[str]]:
    """The recipes table's rows (one per recipe, built from its first seed) made the seeds' figures in place: tau
    pooled with its interval and each seed's, acceptance per position pooled, tokens/s and the validation estimate
    the seeds' mean, greedy identity the worst seed's, and each recipe against the first (`vs_reference_<mode>`).
    `measured` / `trained`: per recipe, one vLLM measurement (every prompt alone) / training per seed. Returns the
    verdicts in words per mode (tau per category stays the first seed's)."""
    reference = rows[0]["recipe"]
    verdicts: dict[str, list[str]] = {m: [] for m in modes}
    for row in rows:
        name, res = row["recipe"], measured[row["recipe"]]
        for m in modes:
            seeds = [r[m]["per_prompt"] for r in res]
            summary = recipe_summary(seeds)
            row[f"tau_vllm_{m}"], row[f"tau_vllm_{m}_interval"] = summary["tau"], summary["tau_interval"]
            row[f"tau_vllm_{m}_seeds"] = summary["tau_seeds"]
            row[f"accept_rate_pos_{m}"] = summary["accept_rate_pos"]
            tps = [r[m]["tokens_per_s"] for r in res if r[m]["tokens_per_s"]]
            row[f"tokens_per_s_{m}"] = sum(tps) / len(tps) if tps else None
            b = base[m]["tokens_per_s"]
            row[f"speedup_{m}"] = row[f"tokens_per_s_{m}"] / b if row[f"tokens_per_s_{m}"] and b else None
            if name != reference:
                cmp = versus(seeds, [r[m]["per_prompt"] for r in measured[reference]])
                row[f"vs_reference_{m}"] = {"reference": reference, **cmp}
                verdicts[m].append(verdict(name, reference, cmp))
        if "greedy" in modes:
            want = base["greedy"]["outputs"]
            row["greedy_identical_frac"] = min(sum(r["greedy"]["outputs"].get(i) == o for i, o in want.items())
                                               / max(len(want), 1) for r in res)
        est = [t["val_tau_est"] for t in trained[name] if t["val_tau_est"] is not None]
        row["val_tau_est"] = sum(est) / len(est) if est else None
        row["val_tau_est_seeds"] = [t["val_tau_est"] for t in trained[name]]
        secs = [t["train_s"] for t in trained[name] if t["train_s"] is not None]
        row["train_s"] = sum(secs) / len(secs) if secs else None
        row["source"] = ", ".join(dict.fromkeys(t["source"] for t in trained[name]))
    return verdicts
