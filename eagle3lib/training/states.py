"""Hidden states computed while training (train.hidden_states online | hybrid), instead of read from an offline store.

Offline extraction stores (3 auxiliary + 1 final) x hidden x 2 bytes per token: 56 KiB at Kimi's hidden size, 5 TB
for the field run's 37,312 samples. Online, the verifier computes each micro-batch's states right before the drafter's
step (in the trainer's prefetch thread, so the verifier's forward overlaps the drafter's step) and nothing is written:

    HiddenStateReader (tokens only)  ->  OnlineStates.fetch(indices)  ->  {index: HiddenSample}  ->  collate
                                             |  extractor.extract(samples)   HF in this process, or a vLLM server
                                             |  as_stored(x, extract.dtype)  rounded as the offline store would keep it
                                             '  StatesCache (hybrid)         epoch 0 keeps what fits cache_budget_gb

Rounding the computed states to extract.dtype is deliberate: online trains on exactly the tensors the offline store
would hold, so both give the same per-step losses (tests/test_online.py) and switching modes never changes a run.

Every torchrun rank computes the states of its own micro-batches. Hybrid: each rank writes its own cache store
(states-cache/rank-R/, a crash-safe HiddenStateWriter, budget / world bytes each); after epoch 0 every rank reads all
of them, so a sample cached by one rank serves whichever rank gets it later. A killed run keeps the cache's complete
shards: the resumed run reads those samples instead of computing them again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from eagle3lib.config.extract import ExtractConfig
from eagle3lib.config.train import TrainConfig
from eagle3lib.config.verifier import VerifierConfig
from eagle3lib.data.chat_tokens import Tokenized
from eagle3lib.data.hidden_store import (
    STORE_META,
    HiddenSample,
    HiddenStateReader,
    HiddenStateWriter,
    as_stored,
    bytes_per_token,
)
from eagle3lib.data.store_index import read_index, store_totals

GB = 1e9
CACHE_DIR = "states-cache"
SHARD_BYTES = 1 << 30  # cache shards of about 1 GiB (64 Kimi samples of 2K tokens would be 7 GiB)


def as_tokenized(s: HiddenSample, n: int | None = None) -> Tokenized:
    """The sample's first n tokens (all when n is None), as the extractors take them."""
    return Tokenized(s.sample_id, s.input_ids[:n].numpy().astype("int32"), s.loss_mask[:n].numpy().astype(bool))


@dataclass
class StateCounts:
    """What the run computed and read, for the manifest (per process; the trainer sums over ranks)."""

    computed_samples: int = 0
    computed_tokens: int = 0
    cached_samples: int = 0  # read back from the hybrid cache instead of computed
    cached_tokens: int = 0
    verifier_s: float = 0.0  # wall time inside the extractor
    server_restarts: int = 0  # a vLLM server that died and was started again

    def as_list(self) -> list[float]:
        return [self.computed_samples, self.computed_tokens, self.cached_samples, self.cached_tokens, self.verifier_s,
                self.server_restarts]


class StatesCache:
    """Hybrid mode's disk cache of the first epoch's states: this rank writes rank-R/, reads every rank-*/."""

    def __init__(self, root: Path, meta: dict[str, Any], dtype: str, budget_bytes: float, rank: int, world: int):
        self.root = root
        self.bpt = bytes_per_token(int(meta["hidden_size"]), dtype, len(meta["aux_layer_ids"]))
        self.writer = HiddenStateWriter(root / f"rank-{rank}", meta, samples_per_shard=64, dtype=dtype,
                                        max_shard_bytes=SHARD_BYTES)
        # The budget bounds the whole cache folder: each rank adds an equal share of what is left. A run resumed at
        # another world size finds caches of ranks it no longer has (or rank caches larger than its share): those
        # bytes count too, so the folder stays within cache_budget_gb (a share of budget / world alone was exceeded)
        own = self.writer.totals()["bytes"]
        others = sum(store_totals(read_index(d, strict=False))["bytes"] for d in sorted(root.glob("rank-*"))
                     if d.name != f"rank-{rank}")
        self.budget = own + max(0.0, budget_bytes - others - own) / world
        self.full = False
        self.lookup: dict[str, tuple[HiddenStateReader, int]] = {}
        self.refresh()

    def refresh(self) -> None:
        """Index the complete shards of every rank's cache (after epoch 0, and at start for a resumed run)."""
        self.lookup = {}
        for d in sorted(self.root.glob("rank-*")):
            if (d / STORE_META).is_file():  # another rank may be creating its cache right now: skip it until it has one
                r = HiddenStateReader(d)
                self.lookup.update({sid: (r, i) for i, sid in enumerate(r.ids)})

    @property
    def bytes_used(self) -> int:
        return self.writer.totals()["bytes"] + self.writer._buf_bytes

    def get(self, sample_id: str) -> HiddenSample | None:
        hit = self.lookup.get(sample_id)
        return hit[0][hit[1]] if hit else None

    def offer(self, s: HiddenSample) -> None:
        if s.sample_id in self.writer or s.sample_id in self.lookup:
            return
        if self.bytes_used + len(s) * self.bpt > self.budget:
            self.full = True  # later samples are computed again each epoch
            return
        self.writer.add(s)

    def seal(self) -> None:
        self.writer.flush()


@dataclass
class OnlineStates:
    """fetch(indices) -> the samples with their hidden states, computed (or, hybrid, read from the cache)."""

    reader: HiddenStateReader  # the extract stage's store: tokens (any states it holds are not used)
    extractor: Any  # .extract(list[Tokenized]) yielding (sample, aux [T, n, H], final [T, H]) in order
    dtype: str  # extract.dtype: the states are rounded as the offline store would keep them
    cache: StatesCache | None = None
    counts: StateCounts = field(default_factory=StateCounts)
    setup_s: float = 0.0  # loading the verifier (or starting its server)
    restarts_left: int = 0  # train.server_restarts not used yet
    check: dict[str, Any] = field(default_factory=dict)  # the final-state check's figures
    max_tokens: int | None = None  # train.packed_row_tokens: a row keeps a sample's first tokens only, so the verifier
    # computes (and the staging folder and the cache hold) no more than those; causal, so the states are the same

    def fetch(self, indices: list[int], epoch: int, offer: bool = True) -> dict[int, HiddenSample]:
        """The samples with their states; offer=False (validation) keeps them out of the hybrid cache, which holds
        the training split's first epoch."""
        out: dict[int, HiddenSample] = {}
        todo: list[HiddenSample] = []
        keys: list[int] = []
        for i in dict.fromkeys(indices):
            tok = self.reader[i]
            hit = self.cache.get(tok.sample_id) if self.cache else None
            if hit is not None:
                out[i] = hit
                self.counts.cached_samples += 1
                self.counts.cached_tokens += len(hit)
            else:
                todo.append(tok)
                keys.append(i)
        if todo:
            t0 = time.time()
            results = self._extract([as_tokenized(s, self.max_tokens) for s in todo])
            self.counts.verifier_s += time.time() - t0
            for i, s, (_, aux, final) in zip(keys, todo, results, strict=True):
                n = aux.shape[0]
                hs = HiddenSample(s.sample_id, s.input_ids[:n], s.loss_mask[:n], as_stored(aux, self.dtype),
                                  as_stored(final, self.dtype))
                out[i] = hs
                self.counts.computed_samples += 1
                self.counts.computed_tokens += len(hs)
                if self.cache is not None and epoch == 0 and offer:
                    self.cache.offer(hs)
        return out

    def _extract(self, samples: list[Tokenized]) -> list:
        """The extractor's results; a vLLM server that died is started again (the generate stage's policy, up to
        train.server_restarts times) and the samples are asked again: nothing was trained on yet."""
        while True:
            try:
                return list(self.extractor.extract(samples))
            except Exception:
                died = getattr(self.extractor, "server_died", lambda: False)()
                if not died or self.restarts_left <= 0:
                    raise
                self.restarts_left -= 1
                self.counts.server_restarts += 1
                print(f"[train] the vLLM server computing the hidden states exited; restarting it "
                      f"({self.counts.server_restarts} so far, train.server_restarts)", flush=True)
                self.extractor.restart()

    def close(self) -> None:
        if self.cache is not None:
            self.cache.seal()
        close = getattr(self.extractor, "close", None)
        if close:
            close()


def cache_meta(reader_meta: dict[str, Any], packed_row_tokens: int) -> dict[str, Any]:
    """The cache's store meta: the verifier and layers of the tokens store (a cache of another verifier is refused),
    and the length its samples are cut at (rows keep packed_row_tokens of a sample)."""
    keys = ("verifier", "num_layers", "hidden_size", "vocab_size", "aux_layer_ids", "max_sample_tokens")
    meta = {k: reader_meta[k] for k in keys if k in reader_meta}
    meta["max_sample_tokens"] = min(int(meta.get("max_sample_tokens") or packed_row_tokens), packed_row_tokens)
    return meta


def tensor_counts(counts: StateCounts) -> torch.Tensor:
    return torch.tensor(counts.as_list(), dtype=torch.float64)


def max_micro_batch_bytes(plan, deal_fn, lengths: list[int], cfg: TrainConfig, world: int, bpt_staged,
                          vrows: list[list[int]] = ()) -> int:
    """The most staging bytes one micro-batch of this process needs, training's and validation's (the staging budget
    must hold at least that); samples count as computed: cut at packed_row_tokens (OnlineStates.max_tokens)."""
    def size(mb) -> int:
        return sum(bpt_staged(min(lengths[i], cfg.packed_row_tokens)) for r in mb for i in r)

    most = 0
    for epoch in plan.steps:
        for rows in epoch:
            for per_rank in deal_fn(rows, lengths, cfg.packed_row_tokens, world, cfg.micro_batch_rows):
                most = max([most, *(size(mb) for mb in per_rank)])
    for rank in range(world):  # validation: each rank takes every world-th row, micro_batch_rows at a time
        mine = list(vrows)[rank::world]
        for j in range(0, len(mine), cfg.micro_batch_rows):
            most = max(most, size(mine[j: j + cfg.micro_batch_rows]))
    return most


def open_extractor(ecfg: ExtractConfig, vcfg: VerifierConfig, model_path: str, aux_ids: list[int], num_layers: int,
                   hidden_size: int, device: torch.device, work_dir: Path, staging_budget: int,
                   max_position_embeddings: int | None):
    """The verifier that computes the states: extract.backend's, on this rank's device (hf) or its own vLLM server
    (vllm, started here; its hidden-state files pass through a staging folder of at most `staging_budget` bytes)."""
    if ecfg.backend == "hf":
        from eagle3lib.model.hf_extract import HFExtractor, hf_compute_dtype

        dev = str(device) if device.type == "cuda" else ecfg.device
        return HFExtractor(model_path, aux_ids, dtype=hf_compute_dtype(ecfg, vcfg), device=dev,
                           device_map=ecfg.device_map, trust_remote_code=vcfg.trust_remote_code,
                           batch_tokens=ecfg.batch_tokens)
    from eagle3lib.vllm.hidden_states import VLLMExtractor

    ex = VLLMExtractor(model_path, vcfg, aux_ids, num_layers, work_dir, ecfg.max_sample_tokens,
                       concurrency=ecfg.concurrency, request_timeout_s=ecfg.request_timeout_s,
                       extra_args=ecfg.vllm_args, max_position_embeddings=max_position_embeddings,
                       staging_budget=staging_budget, hidden_size=hidden_size)
    return ex.start()


def open_states(t, ecfg: ExtractConfig, vcfg: VerifierConfig, log) -> OnlineStates:
    """The trainer's online (or hybrid) states, checked before the first step: the staging budget holds the largest
    micro-batch (vllm), the cache belongs to this verifier, and the final states reproduce the verifier's logits."""
    from eagle3lib.data.packing import deal
    from eagle3lib.model.final_check import FinalStateMismatch, check_backend, check_line
    from eagle3lib.training.setup import TrainingError

    cfg, H = t.cfg, int(t.vconf.hidden_size)
    staging = int(cfg.staging_budget_gb * GB)
    if ecfg.backend == "vllm":
        from eagle3lib.vllm.hidden_states import staged_bytes

        need = max_micro_batch_bytes(t.plan, deal, t.lengths, cfg, t.world,
                                     lambda n: staged_bytes(n, len(t.aux_ids) + 1, H), t.vrows)
        if need > staging:
            raise TrainingError(f"train.staging_budget_gb={cfg.staging_budget_gb}: {staging:,} bytes cannot hold one "
                                f"micro-batch's hidden states ({need:,} bytes for the largest of this plan's "
                                f"micro-batches); raise it to at least {need / GB:.3g} or lower train.micro_batch_rows "
                                "/ packed_row_tokens")
    cache = None
    if cfg.hidden_states == "hybrid":
        try:
            cache = StatesCache(t.out_dir / CACHE_DIR, cache_meta(t.reader.meta, cfg.packed_row_tokens), ecfg.dtype, cfg.cache_budget_gb * GB,
                                t.rank, t.world)
        except ValueError as e:  # StoreError: a cache of another verifier, layers or dtype
            raise TrainingError(f"train.hidden_states=hybrid: {e}") from None
        if not cfg.cache_budget_gb:
            log("train.hidden_states=hybrid with cache_budget_gb 0: nothing is kept, every epoch runs online")
    t0 = time.time()
    extractor = open_extractor(ecfg, vcfg, t.model_path, t.aux_ids, int(t.vconf.num_hidden_layers), H, t.device,
                               t.out_dir / f"online-{ecfg.backend}-rank{t.rank}", staging,
                               getattr(t.vconf, "max_position_embeddings", None))
    states = OnlineStates(t.reader, extractor, ecfg.dtype, cache, setup_s=time.time() - t0,
                          restarts_left=cfg.server_restarts, max_tokens=cfg.packed_row_tokens)
    if ecfg.final_state_check and hasattr(extractor, "reference"):
        first = [as_tokenized(t.reader[i]) for i in t.split.train[: ecfg.final_state_check]]
        try:
            states.check = check_backend(extractor, first, t.model_path, vcfg.trust_remote_code, ecfg.backend, ecfg.dtype)
        except FinalStateMismatch as e:
            states.close()
            raise TrainingError(str(e)) from None
        log(check_line(states.check))
    log(f"hidden states: {cfg.hidden_states}, computed by extract.backend={ecfg.backend} as training consumes them "
        f"(rounded as extract.dtype={ecfg.dtype})" + (f"; the first epoch's kept up to {cfg.cache_budget_gb} GB in "
                                                      f"{CACHE_DIR}/" if cache else ""))
    return states


def states_figures(states: OnlineStates, reduce) -> dict[str, Any]:
    """The manifest's figures of an online/hybrid run, summed over ranks (`reduce`: an all-reduce of a tensor)."""
    c = reduce(tensor_counts(states.counts))
    cache_bytes = reduce(torch.tensor([float(states.cache.bytes_used if states.cache else 0)], dtype=torch.float64))
    out = {"states_computed_samples": int(c[0]), "states_computed_tokens": int(c[1]),
           "states_cached_samples": int(c[2]), "states_cached_tokens": int(c[3]),
           "states_verifier_s": round(float(c[4]), 2),  # summed over ranks: verifier time spent computing states
           "states_server_restarts": int(c[5]),
           "states_setup_s": round(states.setup_s, 2), "states_cache_bytes": int(cache_bytes[0]),
           "states_peak_staged_bytes": int(getattr(states.extractor, "peak_staged", 0))}
    out.update({f"final_state_{k}": v for k, v in states.check.items()})
    return out
