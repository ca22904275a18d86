"""Published drafters: convert between the speculators and EAGLE layouts, and start training from one.

    python -m eagle3lib export CKPT --layout eagle --out DIR        (either layout in, either layout out)
    train.init_from: PATH                                            (continue a drafter instead of starting from zero)

Continuing a drafter is checked before any compute: everything that shapes its weights must match what this run would
build for its verifier (each mismatch names both values and the setting to change). The draft vocabulary is the
source's (`train.init_draft_vocab: keep`), or this run's own, with the lm_head rows of tokens both vocabularies hold
carried over (`remap`; the other rows start from the verifier's lm_head as in a fresh run).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from eagle3lib.model.checkpoint import CheckpointError, load_state, read_config, read_layout, save_drafter
from eagle3lib.model.drafter import DrafterConfig
from eagle3lib.model.layouts import LAYOUTS

# DrafterConfig field -> the setting that decides it in this run
SHAPING = {
    "hidden_size": "the verifier's hidden_size",
    "vocab_size": "the verifier's vocab_size",
    "aux_layer_ids": "verifier.aux_layer_ids",
    "num_layers": "train.num_layers",
    "intermediate_size": "train.intermediate_size",
    "num_attention_heads": "train.num_attention_heads",
    "num_key_value_heads": "train.num_key_value_heads",
    "head_dim": "train.head_dim",
    "hidden_act": "the verifier's hidden_act",
    "norm_before_residual": "train.norm_before_residual",
    "norm_output": "train.norm_output",
    "norm_before_fc": "train.norm_before_fc",
    "fc_norm": "train.fc_norm",
    "drafter_layer": "train.drafter_layer",
    "q_lora_rank": "train.q_lora_rank",
    "kv_lora_rank": "train.kv_lora_rank",
    "qk_nope_head_dim": "train.qk_nope_head_dim",
    "qk_rope_head_dim": "train.qk_rope_head_dim",
    "v_head_dim": "train.v_head_dim",
}


def convert_drafter(src: str | Path, layout: str, out: str | Path) -> Path:
    """Write the drafter in `src` (either layout) to `out` in `layout`; the weights are copied bit for bit."""
    if layout not in LAYOUTS:
        raise CheckpointError(f"--layout {layout!r}: expected one of {', '.join(LAYOUTS)}")
    src, out = Path(src), Path(out)
    if out.resolve() == src.resolve() or out.resolve() in src.resolve().parents:
        raise CheckpointError(f"{out}: the output folder holds the input ({src}); choose another --out")
    cfg = read_config(src)
    return save_drafter(load_state(src), cfg, out, layout=layout)


@dataclass
class InitSource:
    """A drafter a run starts from: where, its layout and config, its weights (speculators names)."""

    path: Path
    layout: str
    cfg: DrafterConfig
    state: dict[str, torch.Tensor]

    @property
    def draft_ids(self) -> torch.Tensor:
        n = self.cfg.draft_vocab_size
        d2t = self.state.get("d2t")
        return torch.arange(n, dtype=torch.int64) + (d2t.long() if d2t is not None else 0)


def read_init_source(path: str | Path) -> InitSource:
    p = Path(path).expanduser()
    if not p.is_dir():
        raise CheckpointError(f"train.init_from {str(path)!r}: no such folder")
    try:
        return InitSource(p, read_layout(p), read_config(p), load_state(p))
    except CheckpointError as e:
        raise CheckpointError(f"train.init_from: {e}") from None


def check_init_source(src: InitSource, run: DrafterConfig, draft_vocab_mode: str) -> None:
    """Everything that shapes the weights must match this run; raises naming each mismatch and its setting."""
    bad = [f"{k} is {getattr(src.cfg, k)!r} there but {getattr(run, k)!r} here ({where})"
           for k, where in SHAPING.items() if getattr(src.cfg, k) != getattr(run, k)]
    if draft_vocab_mode == "keep" and src.cfg.draft_vocab_size != run.draft_vocab_size:
        bad.append(f"draft_vocab_size is {src.cfg.draft_vocab_size} there but {run.draft_vocab_size} here "
                   "(train.draft_vocab_size; or train.init_draft_vocab: remap to use this run's vocabulary)")
    if "lm_head.weight" not in src.state or "fc.weight" not in src.state:
        bad.append("no lm_head.weight / fc.weight in its weights")
    if bad:
        raise CheckpointError(f"train.init_from {src.path}: this drafter does not fit this run: " + "; ".join(bad))


def apply_init_source(drafter: torch.nn.Module, src: InitSource, draft_ids: torch.Tensor) -> int:
    """Load the source's weights into a drafter built (and verifier-initialised) for this run, whose draft vocabulary
    is `draft_ids`. Returns how many lm_head rows came from the source."""
    own = drafter.state_dict()
    skip = {"d2t", "t2d", "lm_head.weight", "embed_tokens", "embed_tokens.weight"}
    weights = {k: v for k, v in src.state.items() if k not in skip}
    unexpected = sorted(set(weights) - set(own))
    missing = sorted(k for k in own if k not in weights and k not in skip)
    if unexpected or missing:
        raise CheckpointError(f"train.init_from {src.path}: weights do not match the drafter (missing {missing}, "
                              f"unexpected {unexpected})")
    lm = own["lm_head.weight"].clone()
    pos = {int(t): i for i, t in enumerate(src.draft_ids.tolist())}
    rows = [(j, pos[int(t)]) for j, t in enumerate(draft_ids.tolist()) if int(t) in pos]
    if rows:
        dst, srci = zip(*rows, strict=True)
        lm[list(dst)] = src.state["lm_head.weight"][list(srci)].to(lm.dtype)
    with torch.no_grad():
        drafter.load_state_dict({**weights, "lm_head.weight": lm}, strict=False)
    return len(rows)
