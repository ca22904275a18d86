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
    # name over to that package, or, when it is not installed, look like a stray folder to transformers.
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if os.path.abspath(p or os.curdir) != _root])
    if _spec is None:
        # Hugging Face's package is not installed, but importlib.util.find_spec("kernels") finds this folder, and
        # transformers (is_kernels_available) then imports it: raising here broke `from transformers import
        # PreTrainedModel`. Look like what transformers takes for a stray folder instead (no __file__, no __version__:
        # "a namespace package shadowing on sys.path, not a real install"), so it goes on without kernels.
        __file__ = None  # noqa: A001
        __all__: list[str] = []
    else:
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
