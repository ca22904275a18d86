"""The draft vocabulary: the `draft_vocab_size` most frequent target tokens over the loss-masked training tokens.

Mappings (the speculators/vLLM convention):
  draft_ids  int64 [Vd]  target id of each draft id, ascending
  d2t        int64 [Vd]  offsets, d2t[i] = draft_ids[i] - i  (vLLM: target = arange(Vd) + d2t)
  t2d        bool  [V]   True where a target id is in the draft vocabulary (vLLM never reads it; SGLang/EAGLE do)
Saved as RUN_DIR/train/draft_vocab.safetensors so a resumed run uses the same vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class DraftVocab:
    draft_ids: torch.Tensor  # int64 [Vd], ascending target ids
    vocab_size: int  # the verifier's (target) vocabulary size
    counts: torch.Tensor  # int64 [V] loss-masked token counts over the training split

    @property
    def size(self) -> int:
        return int(self.draft_ids.numel())

    @property
    def d2t(self) -> torch.Tensor:
        return self.draft_ids - torch.arange(self.size, dtype=torch.int64)

    @property
    def t2d(self) -> torch.Tensor:
        m = torch.zeros(self.vocab_size, dtype=torch.bool)
        m[self.draft_ids] = True
        return m

    def target_to_draft(self) -> torch.Tensor:
        """int64 [V]: draft id of each target id, -1 outside the draft vocabulary."""
        out = torch.full((self.vocab_size,), -1, dtype=torch.int64)
        out[self.draft_ids] = torch.arange(self.size, dtype=torch.int64)
        return out

    @property
    def coverage(self) -> float:
        """Fraction of loss-masked training tokens whose target id is inside the draft vocabulary."""
        total = int(self.counts.sum())
        return float(self.counts[self.draft_ids].sum()) / total if total else 0.0

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        from eagle3lib.core.atomic import write_bytes_atomic

        tmp = Path(path).with_suffix(".tmp-save")
        save_file({"draft_ids": self.draft_ids.contiguous(), "counts": self.counts.contiguous()}, str(tmp),
                  metadata={"vocab_size": str(self.vocab_size)})
        write_bytes_atomic(path, tmp.read_bytes())
        tmp.unlink(missing_ok=True)

    @classmethod
    def load(cls, path: str | Path) -> DraftVocab:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            md = f.metadata() or {}
            return cls(f.get_tensor("draft_ids").long(), int(md["vocab_size"]), f.get_tensor("counts").long())


def count_loss_tokens(reader, indices: list[int], vocab_size: int) -> torch.Tensor:
    """int64 [V] counts of the loss-masked tokens of the given samples (reads only input_ids and loss_mask)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for i in indices:
        ids, mask = _ids_and_mask(reader, i)
        sel = ids[mask]
        if sel.numel() and int(sel.max()) >= vocab_size:
            raise ValueError(f"{reader.root}: sample {reader.ids[i]!r} holds token id {int(sel.max())} >= the verifier's "
                             f"vocab_size {vocab_size}: hidden states from a different verifier?")
        counts += torch.bincount(sel, minlength=vocab_size)
    return counts


def _ids_and_mask(reader, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and loss_mask of sample i without reading its hidden states (uses the store's memory-mapped shards)."""
    fast = getattr(reader, "_loc", None)
    if fast is not None and hasattr(reader, "_handle"):
        si, off = reader._loc[i]
        n = reader.lengths[i]
        f = reader._handle(si)
        return f.get_slice("input_ids")[off:off + n].long(), f.get_slice("loss_mask")[off:off + n].bool()
    s = reader[i]
    return s.input_ids.long(), s.loss_mask.bool()


def build_draft_vocab(counts: torch.Tensor, draft_vocab_size: int) -> DraftVocab:
    """Top `draft_vocab_size` ids by count (ties by lower id); ids never seen fill the rest by ascending id."""
    V = counts.numel()
    k = min(draft_vocab_size, V)
    # Stable order: sort by (-count, id). torch.sort is stable, so sort ids by -count with stable=True.
    order = torch.sort(-counts, stable=True).indices
    draft_ids = torch.sort(order[:k]).values.to(torch.int64)
    return DraftVocab(draft_ids, V, counts.to(torch.int64))
