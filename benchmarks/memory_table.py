# Run: .venv/bin/python benchmarks/memory_table.py kimi-k2.5 --memory-gb 96 141
"""The memory model's terms for a profile's drafter, GiB per process, as docs/howto/long-traces.md shows them: one
sample filling each packed row, in the flash and doc attention layouts, and the longest row that fits each memory.
Planning without the verifier's files: the drafter is built for the profile's deployment.verifier_shape."""

from __future__ import annotations

from eagle3lib.config.train import TrainConfig
from eagle3lib.training.memory_model import GIB, HEADROOM, DrafterShape, longest_that_fits, plan_of, run_bytes


def profile_plan(profile: str) -> tuple[TrainConfig, DrafterShape, dict]:
    """A profile's train section, its drafter (built for deployment.verifier_shape) and check_fits' keywords on a CUDA
    host (bf16 under precision auto), for planning without the verifier's files."""
    from eagle3lib.config.profile import load_profile
    from eagle3lib.model.drafter_shape import choose_drafter_layer, drafter_config_from

    prof = load_profile(profile, sections=["train", "extract", "deployment"])
    cfg, vshape = prof.section("train"), prof.section("deployment").verifier_shape
    if vshape is None:
        raise ValueError(f"{prof.path}: no deployment.verifier_shape to build the drafter from")
    layer = choose_drafter_layer(cfg.drafter_layer, vshape, cuda=True)
    s = DrafterShape.of(drafter_config_from(cfg, vshape, [0], cfg.draft_vocab_size, "verifier", layer))
    return cfg, s, plan_of(cfg, True, str(prof.section("extract").dtype), cfg.nproc_per_node)


def profile_report(profile: str, memory_gb: list[float], row_tokens: list[int]) -> list[str]:
    """The table docs/howto/long-traces.md shows: GiB per process for one sample filling each row, then the longest
    row that fits each memory (GiB, as train.memory_gb)."""
    cfg, s, plan = profile_plan(profile)
    terms = ["step", "parameters", "verifier_head", "target_logits", "inputs"]
    out = [f"{profile}: packed_row_tokens {cfg.packed_row_tokens}, {s.parameters() / 1e9:.2f}B parameters, "
           f"K {cfg.ttt_steps}, {'bf16' if plan['dtype_bytes'] == 2 else 'fp32'}, target_logits {cfg.target_logits}",
           "| row tokens | layout | " + " | ".join(terms) + " | total | " + " | ".join(f"fits {m:g} GiB" for m in memory_gb)
           + " |"]
    for n in row_tokens:
        for layout in ("flash", "doc"):
            t = run_bytes(s, cfg.ttt_steps, n, n, **{**plan, "layout": layout})
            fits = ["yes" if t["total"] <= m * GIB * HEADROOM else "no" for m in memory_gb]
            out.append(f"| {n:,} | {layout} | " + " | ".join(f"{t[k] / GIB:.1f}" for k in [*terms, "total"])
                       + " | " + " | ".join(fits) + " |")
    for m in memory_gb:
        best = longest_that_fits(s, cfg.ttt_steps, m * GIB, **plan)
        out.append(f"{m:g} GiB (budget {HEADROOM:.0%}: {m * HEADROOM:.1f} GiB): the longest row that fits is {best:,}")
    return out




if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="The memory model's terms for a profile's drafter (GiB per process).")
    ap.add_argument("profile", help="a profile name or YAML file with deployment.verifier_shape (e.g. kimi-k2.5)")
    ap.add_argument("--memory-gb", type=float, nargs="+", default=[96.0, 141.0], help="device memory, GiB")
    ap.add_argument("--rows", type=int, nargs="+", default=[8192, 16384, 32768], help="row lengths to tabulate")
    a = ap.parse_args()
    print("\n".join(profile_report(a.profile, a.memory_gb, a.rows)))
