"""Time and peak memory of the Triton kernels against torch eager and torch.compile (forward + backward), one CUDA GPU.

    python benchmarks/kernel_speed.py                 # hidden 4096/7168 x sequence 8192/16384, draft vocab 32000, bf16
    python benchmarks/kernel_speed.py --no-compile    # skip the torch.compile baseline (compiling takes a minute or two)

Peak memory is the allocator's peak during one forward + backward, above what the inputs already hold. A variant that
fails (out of memory, or a compiled kernel over the shared-memory limit) prints its error in the table instead of a
number.

Named kernel_speed.py, not kernels.py: a script in benchmarks/ puts this folder first on sys.path, and transformers
takes a module named `kernels` there for the hub-kernels package and then fails to load any model.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from eagle3lib.kernels.draft_loss import draft_kl_loss, draft_kl_loss_reference  # noqa: E402
from eagle3lib.kernels.launch import draft_loss_config, rmsnorm_config, smem_budget  # noqa: E402
from eagle3lib.kernels.rmsnorm import rms_norm, rms_norm_reference  # noqa: E402


def measure(step: Callable[[], None], iters: int) -> tuple[float, float]:
    """(median ms, peak MiB above the starting allocation) of step(), after two warm-up calls (compiles, autotune)."""
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), (torch.cuda.max_memory_allocated() - base) / 2**20


def rmsnorm_steps(n: int, hidden: int, use_compile: bool) -> dict[str, Callable[[], None]]:
    x = torch.randn(n, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)

    def run(fn):
        def step():
            x.grad = w.grad = None
            fn(x, w, 1e-6).backward(dy)
        return step

    steps = {"triton": run(rms_norm), "eager": run(rms_norm_reference)}
    if use_compile:
        steps["torch.compile"] = run(torch.compile(rms_norm_reference, dynamic=True))
    return steps


def loss_steps(n: int, hidden: int, vocab: int, use_compile: bool) -> dict[str, Callable[[], None]]:
    h = torch.randn(n, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) / hidden**0.5).requires_grad_()
    target = torch.randn(n, vocab, device="cuda", dtype=torch.bfloat16)
    mask = (torch.rand(n, device="cuda") > 0.3).float()

    def run(fn):
        def step():
            h.grad = w.grad = None
            fn(h, w, target, mask).loss.backward()
        return step

    steps = {"triton": run(draft_kl_loss), "eager": run(draft_kl_loss_reference)}
    if use_compile:
        steps["torch.compile"] = run(torch.compile(draft_kl_loss_reference, dynamic=True))
    return steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, nargs="+", default=[4096, 7168])
    parser.add_argument("--seq", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile baseline")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("benchmarks/kernel_speed.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing to measure here.",
              file=sys.stderr)
        return 2

    props = torch.cuda.get_device_properties(0)
    budget = smem_budget(torch.device("cuda", 0))
    print(f"# {props.name} sm_{props.major}{props.minor}, shared memory/block {budget} B, torch {torch.__version__}")
    print(f"{'kernel':<11} {'hidden':>6} {'seq':>6} {'variant':<14} {'fwd+bwd ms':>10} {'peak MiB':>9}  config")
    for hidden in args.hidden:
        for n in args.seq:
            cases = (
                ("rmsnorm", partial(rmsnorm_steps, n, hidden, not args.no_compile),
                 rmsnorm_config(hidden, torch.bfloat16, budget)),
                ("draft_loss", partial(loss_steps, n, hidden, args.vocab, not args.no_compile),
                 draft_loss_config(hidden, args.vocab, torch.bfloat16, budget)),
            )
            for name, make_steps, cfg in cases:
                steps = make_steps()  # inputs for one case at a time, so peaks are not inflated by the other's
                for variant, step in steps.items():
                    try:
                        ms, mib = measure(step, args.iters)
                        cells = f"{ms:>10.3f} {mib:>9.0f}"
                    except Exception as exc:  # report and keep going: the table is the product
                        cells = f"error: {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:80]}"
                    note = cfg if variant == "triton" else ""
                    print(f"{name:<11} {hidden:>6} {n:>6} {variant:<14} {cells}  {note}", flush=True)
                del steps
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
