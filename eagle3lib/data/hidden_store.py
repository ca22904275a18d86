"""On-disk store of verifier hidden states for drafter training: sharded safetensors, crash-safe, memory-mapped reads.

Layout of a store folder (the extract stage uses RUN_DIR/extract/):
  store.json                    the store's metadata (`meta`: verifier, hidden_size, vocab_size, num_layers,
                                aux_layer_ids, dtype, format), written once when the store is created
  index.jsonl                   one line per complete shard: {"shard", "ids", "lengths", "loss_tokens", "bytes"};
                                append-only, a torn last line is ignored
  index-rRRRRR.jsonl            the same, appended by extraction rank R of a multi-process run (below)
  shards/shard-NNNNN.safetensors  many samples each, their tokens concatenated along dim 0 (shard-rRRRRR-NNNNN from
                                rank R of a multi-process run):
      input_ids    int32 [N]           token ids
      loss_mask    bool  [N]           True on assistant tokens
      aux_hidden   [N, 3, H]           hidden states entering the 3 EAGLE-3 feature layers (bf16, fp32 or fp8 e4m3)
      final_hidden [N, H]              output of the last decoder layer, BEFORE the verifier's final norm
      aux_scale    f32 [N, 3]          fp8 only: per-token, per-layer dequantisation scale
      final_scale  f32 [N]             fp8 only: per-token dequantisation scale
    and in the safetensors header metadata: "ids" and "lengths" (JSON lists), so a shard describes itself.

Several writers (torchrun ranks, on one node or many, over a shared folder): rank R owns the shards named
shard-rRRRRR-* and its own index-rRRRRR.jsonl, so no two processes ever write the same file; every reader takes the
union of index.jsonl and the rank indexes (keyed by shard name, so a shard listed twice counts once). Repairs (damaged
shards, temporary files, a torn index) and `merge_index`, which folds the rank indexes into index.jsonl atomically,
run in one process while no rank writes (the extract stage: rank 0, between barriers).

Crash safety: a shard is written to a temporary name, fsynced and renamed, then listed in index.jsonl. A reader only
ever opens renamed (complete) shards; a shard that was renamed but not yet indexed (a kill between the two steps) is
recovered from its own header. Temporary files of a killed writer are never read and are removed on resume.

dtype "none" (train.hidden_states online/hybrid): a tokens-only store, input_ids and loss_mask without hidden states;
the trainer computes the states as it consumes the samples (eagle3lib/training/states.py).

fp8: e4m3 with one scale per token (and per layer for the aux states), scale = amax / 448, halves the bytes per token;
the reader dequantises to bf16. Relative error per element is at most 2^-4 of the token's amax (3 mantissa bits).
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3lib.core.atomic import write_error, write_json_atomic
from eagle3lib.data.store_index import (  # noqa: F401  (StoreError, STORE_META, read_store_meta: re-exported)
    DAMAGED_HINT,
    FORMAT,
    SHARDS_DIR,
    STORE_META,
    StoreError,
    fsync_dir,
    index_name,
    read_index,
    read_store_meta,
    repair_store,
    shard_name,
    shard_order,
    store_totals,
)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float8_e4m3fn": torch.float8_e4m3fn,
          "none": None}  # none: tokens only, the states are computed during training (online)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
META_KEYS = ("verifier", "hidden_size", "vocab_size", "num_layers", "aux_layer_ids")  # must match on resume (and
# dtype, format, and max_sample_tokens when both the store and the writer state it)


@dataclass
class HiddenSample:
    sample_id: str
    input_ids: torch.Tensor  # LongTensor [T]
    loss_mask: torch.Tensor  # BoolTensor [T], True on assistant tokens
    aux_hidden: torch.Tensor | None  # [T, 3, H] (as stored, fp8 dequantised to bf16); None in a tokens-only store
    final_hidden: torch.Tensor | None  # [T, H] final hidden state BEFORE the verifier's final norm; None likewise

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def bytes_per_token(hidden_size: int, dtype: str = "bfloat16", n_aux: int = 3) -> int:
    """Disk bytes per token: (n_aux + 1) x H hidden values, plus token id, mask and (fp8) scales."""
    if dtype in ("bfloat16", "float32"):
        return (n_aux + 1) * hidden_size * (2 if dtype == "bfloat16" else 4) + 4 + 1
    if dtype == "none":
        return 4 + 1
    if dtype == "float8_e4m3fn":
        return (n_aux + 1) * hidden_size * 1 + (n_aux + 1) * 4 + 4 + 1
    raise StoreError(f"unknown hidden-state dtype {dtype!r} (known: {', '.join(DTYPES)})")


# ------------------------------------------------------------------------------------------------------------- fp8


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (last dim) e4m3 quantisation: returns (q [..., H] float8_e4m3fn, scale [...] float32)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1).clamp_min(1e-12) / FP8_MAX
    q = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)


def as_stored(x: torch.Tensor, dtype: str) -> torch.Tensor:
    """x rounded as a store of `dtype` gives it back (fp8 dequantised, bf16 rounded), in the dtype a reader returns:
    states computed online are rounded so, and train exactly as the offline store would have them."""
    if dtype == "float8_e4m3fn":
        return dequantize_fp8(*quantize_fp8(x), dtype=torch.bfloat16)
    if dtype == "float32":
        return x.float()
    return x.to(torch.bfloat16)


# ---------------------------------------------------------------------------------------------------------- writer


class HiddenStateWriter:
    """Buffers samples and writes them as shards of `samples_per_shard` samples (or `max_shard_bytes`, if set).

    Resume-aware: opening a folder that already holds a store with the same verifier/layers/dtype continues it;
    `writer.done_ids` are the samples already stored (complete shards only), and adding one of them again raises.
    Samples still buffered when the process dies are lost and simply extracted again on the next run.
    `rank`: one of several concurrent writers (its own shard names and index file; no repairs, see the module doc).
    """

    def __init__(self, out_dir: str | Path, meta: dict[str, Any], samples_per_shard: int = 256,
                 dtype: str = "bfloat16", max_shard_bytes: int | None = None, rank: int | None = None):
        if dtype not in DTYPES:
            raise StoreError(f"hidden-state dtype {dtype!r} not supported (choose one of {', '.join(DTYPES)})")
        if samples_per_shard < 1:
            raise StoreError(f"samples_per_shard must be >= 1, got {samples_per_shard}")
        missing = [k for k in ("hidden_size", "aux_layer_ids") if k not in meta]
        if missing:
            raise StoreError(f"store meta lacks {missing}")
        self.root = Path(out_dir)
        self.shard_dir = self.root / SHARDS_DIR
        self.shard_dir.mkdir(parents=True, exist_ok=True)
        self.samples_per_shard = samples_per_shard
        self.max_shard_bytes = max_shard_bytes
        self.dtype = dtype
        self.meta = {**meta, "dtype": dtype, "format": FORMAT}
        self.hidden_size = int(self.meta["hidden_size"])
        self.n_aux = len(self.meta["aux_layer_ids"])
        self.rank = rank
        self._init_meta()
        if rank is None:  # the lone writer repairs; ranks find the store repaired by rank 0's lone writer
            self.damaged: list[str] = repair_store(self.root)  # their samples are extracted again
        else:
            self.damaged = []
        self.entries = read_index(self.root, strict=rank is None)
        self.done_ids: set[str] = {i for e in self.entries.values() for i in e["ids"]}  # every rank's, any world size
        own = [shard_order(n)[1] for n in self.entries if shard_order(n)[0] == (-1 if rank is None else rank)]
        self._next = 1 + max(own, default=-1)
        self._buf: list[HiddenSample] = []
        self._buf_ids: set[str] = set()
        self._buf_bytes = 0
        self.written_samples = 0  # by this writer (not counting resumed shards)
        self.written_tokens = 0
        self.written_bytes = 0

    # -- store metadata
    def _init_meta(self) -> None:
        path = self.root / STORE_META
        if path.exists():
            old = read_store_meta(self.root)
            keys = (*META_KEYS, "dtype", "format", "max_sample_tokens")
            diffs = [f"{k}: stored {old.get(k)!r}, now {self.meta.get(k)!r}" for k in keys
                     if k in self.meta and (k in old or k in META_KEYS) and old.get(k) != self.meta.get(k)]
            if diffs:
                raise StoreError(f"{self.root} already holds hidden states extracted differently ({'; '.join(diffs)}); "
                                 "use a new run directory or delete the old store")
            self.meta = {**old, **self.meta}
            if self.rank is not None:
                return  # written by rank 0 before the ranks start
        elif self.rank is not None:
            raise StoreError(f"{path} missing: rank 0 creates the store before the other ranks write")
        write_json_atomic(path, self.meta)

    # -- adding samples
    def __contains__(self, sample_id: str) -> bool:
        return sample_id in self.done_ids or sample_id in self._buf_ids

    def add(self, sample: HiddenSample) -> None:
        T = len(sample)
        H = self.hidden_size
        if sample.sample_id in self:
            raise StoreError(f"sample {sample.sample_id!r} is already in the store {self.root}")
        if T == 0:
            raise StoreError(f"sample {sample.sample_id!r} has no tokens")
        shapes = {"loss_mask": (T,), "aux_hidden": (T, self.n_aux, H), "final_hidden": (T, H)}
        if self.dtype == "none":
            shapes = {"loss_mask": (T,)}
            sample = HiddenSample(sample.sample_id, sample.input_ids, sample.loss_mask, None, None)
        for name, shape in shapes.items():
            got = tuple(getattr(sample, name).shape)
            if got != shape:
                raise StoreError(f"sample {sample.sample_id!r}: {name} has shape {got}, expected {shape}")
        buf_dtype = torch.float32 if self.dtype == "float32" else torch.bfloat16
        if self.dtype != "none" and (sample.aux_hidden.dtype != buf_dtype or sample.final_hidden.dtype != buf_dtype):
            # buffer at storage precision (fp32 states would double a bf16 buffer); fp8 is quantised from bf16 at flush
            sample = HiddenSample(sample.sample_id, sample.input_ids, sample.loss_mask,
                                  sample.aux_hidden.to(buf_dtype), sample.final_hidden.to(buf_dtype))
        self._buf.append(sample)
        self._buf_ids.add(sample.sample_id)
        self._buf_bytes += T * bytes_per_token(H, self.dtype, self.n_aux)
        if len(self._buf) >= self.samples_per_shard or (self.max_shard_bytes and self._buf_bytes >= self.max_shard_bytes):
            self.flush()

    def flush(self) -> None:
        """Write the buffered samples as one shard (atomically), then index it."""
        if not self._buf:
            return
        from safetensors.torch import save_file

        buf = self._buf
        ids = [s.sample_id for s in buf]
        lengths = [len(s) for s in buf]
        input_ids = torch.cat([s.input_ids.reshape(-1) for s in buf]).to(torch.int32)
        loss_mask = torch.cat([s.loss_mask.reshape(-1) for s in buf]).to(torch.bool)
        if self.dtype == "none":
            tensors = {}
        elif self.dtype == "float8_e4m3fn":
            aux = torch.cat([s.aux_hidden for s in buf])
            final = torch.cat([s.final_hidden for s in buf])
            aux_q, aux_s = quantize_fp8(aux)
            fin_q, fin_s = quantize_fp8(final)
            tensors = {"aux_hidden": aux_q, "aux_scale": aux_s, "final_hidden": fin_q, "final_scale": fin_s}
        else:
            tensors = {"aux_hidden": torch.cat([s.aux_hidden for s in buf]),
                       "final_hidden": torch.cat([s.final_hidden for s in buf])}
        tensors.update(input_ids=input_ids, loss_mask=loss_mask)
        tensors = {k: v.contiguous() for k, v in tensors.items()}
        loss_tokens = int(loss_mask.sum())
        name = shard_name(self.rank, self._next)
        md = {"format": FORMAT, "ids": json.dumps(ids), "lengths": json.dumps(lengths), "loss_tokens": str(loss_tokens)}
        final_path = self.shard_dir / name
        tmp = self.shard_dir / f".{name}.{os.getpid()}.tmp"
        try:
            save_file(tensors, str(tmp), metadata=md)
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(tmp, final_path)
        except Exception as e:  # disk full, quota, I/O error: the complete shards stay, this one is redone on resume
            tmp.unlink(missing_ok=True)
            raise StoreError(f"{final_path}: cannot write the shard ({write_error(final_path, e)}); the store keeps its "
                             f"{len(self.entries)} complete shards, and a re-run resumes after them once there is "
                             "room") from None
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(self.shard_dir)
        entry = {"shard": name, "ids": ids, "lengths": lengths, "loss_tokens": loss_tokens,
                 "bytes": final_path.stat().st_size}
        with open(self.root / index_name(self.rank), "a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.entries[name] = entry
        self.done_ids.update(ids)
        self._next += 1
        self.written_samples += len(buf)
        self.written_tokens += int(input_ids.shape[0])
        self.written_bytes += entry["bytes"]
        self._buf, self._buf_ids, self._buf_bytes = [], set(), 0

    def close(self) -> None:
        self.flush()

    def __enter__(self) -> HiddenStateWriter:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is None:
            self.close()  # on an error the buffered samples are dropped: they are redone on resume

    # -- totals over the whole store (resumed shards included)
    def totals(self) -> dict[str, int]:
        return store_totals(self.entries)


# ---------------------------------------------------------------------------------------------------------- reader


class HiddenStateReader:
    """Random access by sample over a store; shards are opened lazily with safetensors `safe_open` (memory-mapped),
    and only the rows of the requested sample are read. Picklable (for DataLoader workers): open handles are dropped.

    `meta` is the store's metadata; `lengths`/`ids` describe every sample without loading tensors (for packing).
    """

    def __init__(self, extract_dir: str | Path, max_open_shards: int = 64):
        self.root = Path(extract_dir)
        self.meta: dict[str, Any] = read_store_meta(self.root)
        if self.meta.get("format") != FORMAT:
            raise StoreError(f"{self.root / STORE_META}: unknown store format {self.meta.get('format')!r}")
        self.entries = list(read_index(self.root).values())
        self.ids: list[str] = []
        self.lengths: list[int] = []
        self._loc: list[tuple[int, int]] = []  # per sample: (shard number in self.entries, token offset)
        for si, e in enumerate(self.entries):
            off = 0
            for sid, n in zip(e["ids"], e["lengths"], strict=True):
                self.ids.append(sid)
                self.lengths.append(int(n))
                self._loc.append((si, off))
                off += int(n)
        self.max_open_shards = max_open_shards
        self._handles: OrderedDict[int, Any] = OrderedDict()

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def shards(self) -> list[str]:
        return [e["shard"] for e in self.entries]

    def _handle(self, si: int) -> Any:
        from safetensors import safe_open

        h = self._handles.get(si)
        if h is None:
            path = self.root / SHARDS_DIR / self.entries[si]["shard"]
            try:
                h = safe_open(str(path), framework="pt")
            except Exception as e:  # missing, truncated, overwritten
                raise StoreError(f"{path}: cannot read this hidden-state shard ({type(e).__name__}: {e}); "
                                 f"{DAMAGED_HINT}") from None
            self._handles[si] = h
            if len(self._handles) > self.max_open_shards:
                self._handles.popitem(last=False)
        else:
            self._handles.move_to_end(si)
        return h

    def __getitem__(self, i: int) -> HiddenSample:
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range (store holds {len(self)})")
        si, off = self._loc[i]
        n = self.lengths[i]
        f = self._handle(si)

        def rows(name: str) -> torch.Tensor:
            return f.get_slice(name)[off : off + n]

        try:
            if self.meta.get("dtype") == "none":
                return HiddenSample(self.ids[i], rows("input_ids").long(), rows("loss_mask").bool(), None, None)
            aux, final = rows("aux_hidden"), rows("final_hidden")
            if aux.dtype == torch.float8_e4m3fn:
                aux = dequantize_fp8(aux, rows("aux_scale"))
                final = dequantize_fp8(final, rows("final_scale"))
            return HiddenSample(self.ids[i], rows("input_ids").long(), rows("loss_mask").bool(), aux, final)
        except Exception as e:
            path = self.root / SHARDS_DIR / self.entries[si]["shard"]
            raise StoreError(f"{path}: sample {self.ids[i]!r} does not read ({type(e).__name__}: {e}); "
                             f"{DAMAGED_HINT}") from None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_handles"] = OrderedDict()
        return state

    def __repr__(self) -> str:
        return (f"HiddenStateReader({str(self.root)!r}: {len(self)} samples, {self.num_tokens} tokens, "
                f"{len(self.entries)} shards, {self.meta.get('dtype')})")
