#!/usr/bin/env bash
# Run: bash benchmarks/gpu_kernels.sh   (on a CUDA machine; about 3-5 minutes)
# The GPU-side checks of kernels/: numerics natively on CUDA (no interpreter) including full-size shapes, the selector
# tests, then the benchmark table. The shared-memory AOT test needs no GPU and runs in CI (tests/test_kernels_smem.py).
# PYTHON may point at any interpreter with a CUDA build of torch and triton (default: .venv/bin/python, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
export TRITON_CACHE_DIR="${TRITON_CACHE_DIR:-$PWD/.cache/triton}"
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$PWD/.cache/inductor}"
unset TRITON_INTERPRET

"$PYTHON" - <<'PY'
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f"gpu_kernels.sh: no CUDA device visible to torch {torch.__version__}; run it on a GPU machine.")
p = torch.cuda.get_device_properties(0)
print(f"{p.name} sm_{p.major}{p.minor}, {p.total_memory / 2**30:.0f} GiB, "
      f"shared memory per block (opt-in) {getattr(p, 'shared_memory_per_block_optin', '?')} B")
PY

echo "== numerics on CUDA"
EAGLE3_KERNEL_DEVICE=cuda timeout 150 "$PYTHON" -m pytest tests/test_kernels_numerics.py tests/test_kernels_launch.py -q -p no:cacheprovider
echo "== benchmark"
timeout 200 "$PYTHON" benchmarks/kernel_speed.py --iters 10
