# Run: .venv/bin/python -m pytest tests/test_kernels_smem.py -q
"""Ahead-of-time compile every kernel configuration the selectors can choose, for sm_120, sm_90 and sm_100, and check
the shared memory the compiler reports against each GPU's limit. No GPU needed: the triton wheel carries the CUDA
toolchain.

The grid: hidden 1..16384, draft vocab 1..64000, bf16/fp16/fp32, and the budgets of the three architectures. Sequence
length up to 32768 is covered by construction: the selectors do not take it (tests/test_kernels_launch.py checks that),
and the row count only reaches a kernel as a runtime integer; the JIT specialises it at most as "divisible by 16" or
"== 1", which only simplify masks. Each distinct config is compiled as bf16 with 16-byte-aligned pointers and sizes (the
usual case: vectorised loads, and the larger shared-memory figures) for sm_120 and sm_90 (sm_100 has sm_90's budget,
so the same configs, and these kernels' shared memory measured the same on all three), and as fp32 unaligned (odd
sizes) for sm_120.

The compiles run in a child process without TRITON_INTERPRET: the interpreter, once on, patches triton for the whole
process. The script also runs on its own: `.venv/bin/python tests/test_kernels_smem.py` prints the table as JSON.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ARCHS = {120: "sm_120", 90: "sm_90", 100: "sm_100"}
MAX_HIDDEN, MAX_VOCAB, MAX_SEQ = 16384, 64000, 32768
# Specialisations per config: (activation dtype, weight/target dtype, aligned) -> architectures compiled for. These
# kernels have no tl.dot, and their shared memory measured identical on all three architectures, so each compile beyond
# one per budget only costs CI time: the second variant runs on sm_120 only (the tight budget), and sm_100 (the same
# budget as sm_90, hence the same selected configs: checked below) is compiled for in the first variant alone.
VARIANTS = {("bf16", "bf16", True): (120, 90), ("fp32", "fp32", False): (120,)}
SAME_BUDGET = {100: 90}  # an architecture whose configs and shared memory another's compile stands for


def selector_choices() -> tuple[set, set]:
    """Every RMSNorm and draft-loss kernel config the selectors return over the grid (kernel-relevant fields only)."""
    from eagle3lib.kernels.launch import SMEM_LIMITS, draft_loss_config, rmsnorm_config

    budgets = {SMEM_LIMITS[(cap // 10, cap % 10)] for cap in ARCHS}
    rms, loss = set(), set()
    for budget in budgets:
        for dtype in ("bfloat16", "float16", "float32"):
            rms.update(rmsnorm_config(h, dtype, budget) for h in range(1, MAX_HIDDEN + 1))
            for v in range(1, MAX_VOCAB + 1):
                c = draft_loss_config(4096, v, dtype, budget)
                loss.add((c.block_vocab, c.num_warps, c.num_stages))
    return rms, loss


def _signature(fn, act: str, other: str) -> dict[str, str]:
    types = {"x_ptr": act, "y_ptr": act, "dy_ptr": act, "dx_ptr": act, "z_ptr": act, "w_ptr": other, "t_ptr": other,
             "argmax_ptr": "i64"}
    sig = {}
    for name in fn.arg_names:
        if name.isupper():
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = "*" + types.get(name, "fp32")
        else:
            sig[name] = "fp32" if name == "eps" else "i32"
    return sig


def _compile(fn, constexprs: dict, act: str, other: str, aligned: bool, cap: int, warps: int, stages: int) -> int:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = _signature(fn, act, other)
    # What the JIT infers for a 16-byte-aligned tensor and sizes/strides divisible by 16.
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if aligned and sig[name] != "constexpr" and (name.endswith("_ptr") or sig[name] == "i32")}
    src = ASTSource(fn, sig, constexprs, attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", cap, 32), options={"num_warps": warps, "num_stages": stages})
    return int(kernel.metadata.shared)


def compile_all() -> list[dict]:
    from eagle3lib.kernels import draft_loss, rmsnorm
    from eagle3lib.kernels.launch import smem_estimate

    rms_cfgs, loss_cfgs = selector_choices()
    jobs = []  # (kernel name, fn, constexprs, warps, stages, estimate)
    for c in sorted(rms_cfgs, key=lambda c: c.block_hidden):
        const = {"BLOCK_R": c.block_rows, "BLOCK_H": c.block_hidden}
        est = smem_estimate(c.block_rows * c.block_hidden, 4, 2, c.num_stages)
        for fn in (rmsnorm._rmsnorm_fwd_kernel, rmsnorm._rmsnorm_bwd_dx_kernel, rmsnorm._rmsnorm_bwd_dw_kernel):
            jobs.append((fn, const, c.num_warps, c.num_stages, est))
    for block, warps, stages in sorted(loss_cfgs):
        est = smem_estimate(block, 4, 2, stages)
        jobs.append((draft_loss._loss_stats_kernel, {"BLOCK_V": block, "KL": True}, warps, stages, est))
        jobs.append((draft_loss._loss_stats_kernel, {"BLOCK_V": block, "KL": False}, warps, stages, est))
        jobs.append((draft_loss._loss_grad_kernel, {"BLOCK_V": block}, warps, stages, est))
    tasks = [(fn.__name__, const, warps, stages, est, variant, cap)
             for fn, const, warps, stages, est in jobs for variant, caps in VARIANTS.items() for cap in caps]
    # Compiling is single-threaded and CPU-bound; two worker processes halve the wall time on a 2-core CI runner.
    workers = max(1, min(2, os.cpu_count() or 1))
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        return list(pool.map(_compile_task, tasks, chunksize=8))


def _compile_task(task) -> dict:
    from eagle3lib.kernels import draft_loss, rmsnorm

    name, const, warps, stages, est, (act, other, aligned), cap = task
    fn = getattr(rmsnorm, name, None) or getattr(draft_loss, name)
    shared = _compile(fn, const, act, other, aligned, cap, warps, stages)
    return {"kernel": name, "arch": ARCHS[cap], "cap": cap, "constexprs": const, "num_warps": warps,
            "num_stages": stages, "dtype": act, "aligned": aligned, "shared": shared, "estimate": est}


@pytest.mark.slow
def test_every_selectable_config_fits_shared_memory(tmp_path) -> None:
    from eagle3lib.kernels.launch import SMEM_LIMITS

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path / "triton-cache"), TRITON_DEFAULT_FP_FUSION="1",
               PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve())], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, f"AOT compile failed:\n{proc.stderr[-6000:]}"
    rows = json.loads(proc.stdout)
    for cap, twin in SAME_BUDGET.items():  # sm_100's row is sm_90's compile, valid while their budgets are equal
        assert SMEM_LIMITS[(cap // 10, cap % 10)] == SMEM_LIMITS[(twin // 10, twin % 10)]
        rows += [{**r, "arch": ARCHS[cap], "cap": cap} for r in rows if r["cap"] == twin]
    assert {r["arch"] for r in rows} == set(ARCHS.values())
    too_big = [r for r in rows if r["shared"] > SMEM_LIMITS[(r["cap"] // 10, r["cap"] % 10)]]
    assert not too_big, f"configs over the shared-memory limit: {too_big}"
    # The documented estimate must stay an upper bound, or the selector's budget check means nothing.
    under = [r for r in rows if r["shared"] > r["estimate"]]
    assert not under, f"shared memory above the selector's estimate: {under}"
    for arch in ARCHS.values():
        worst = max((r for r in rows if r["arch"] == arch), key=lambda r: r["shared"])
        print(f"{arch}: {len([r for r in rows if r['arch'] == arch])} kernels, max shared {worst['shared']} B "
              f"({worst['kernel']} {worst['constexprs']} {worst['dtype']})")


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    print(json.dumps(compile_all()))
