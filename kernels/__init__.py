"""Triton kernels for drafter training, with torch fallbacks. API (details in kernels/README.md, code in api.py):

    select_backend(device, prefer="auto") -> "triton" | "torch"
    rms_norm(x, weight, eps=1e-6, *, backend=None) -> Tensor
    draft_kl_loss(h, weight, target, mask=None, *, kind="kl", reduction="sum", backend=None)
        -> DraftLossOutput(loss, argmax)      (torch backend: the reference with a hand-written backward)

Every tile is chosen by kernels.launch from model dimensions and the GPU's shared-memory budget, never from the
sequence length. This folder installs as `eagle3lib.kernels` (pyproject.toml maps it there).
"""

if __name__ == "kernels":
    # Imported under the top-level name `kernels`: the repository root is on sys.path (a command started from it), so
    # this folder shadows Hugging Face's `kernels` package, which transformers imports when it is installed. Hand the
    # name over to that package, or fail as if this folder were not there.
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if os.path.abspath(p or os.curdir) != _root])
    if _spec is None:
        del sys.modules["kernels"]
        raise ModuleNotFoundError("No module named 'kernels' (this repository's kernels are eagle3lib.kernels)",
                                  name="kernels")
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _module  # what the `import kernels` statement returns
    _spec.loader.exec_module(_module)
else:
    from .api import (
        DraftLossConfig,
        DraftLossOutput,
        RMSNormConfig,
        draft_kl_loss,
        draft_loss_config,
        rms_norm,
        rmsnorm_config,
        select_backend,
        smem_budget,
    )

    __all__ = ["DraftLossConfig", "DraftLossOutput", "RMSNormConfig", "draft_kl_loss", "draft_loss_config", "rms_norm",
               "rmsnorm_config", "select_backend", "smem_budget"]
