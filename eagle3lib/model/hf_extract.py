"""Hidden states with HF transformers: forward hooks on just the captured layers, length-sorted padded batches.

Index convention (CONTRIBUTING "Verifier conventions"): feature id k = the hidden state *entering* decoder layer k
(a forward pre-hook on layers[k]) = HF `output_hidden_states[k]` for k < L. The final hidden state is the *output* of
the last decoder layer (a forward hook on layers[L-1]), before the final norm. In transformers 5.x `hidden_states[L]`
is NOT that: `capture_outputs` replaces it with `last_hidden_state`, which is post-norm (tests check both facts).

Only the base model runs (no lm_head: at vocab 163,840 the logits would dwarf everything), without a KV cache, and
only 4 tensors per batch are kept, not L+1: less memory and time than `output_hidden_states=True`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from eagle3lib.config.extract import ExtractConfig
from eagle3lib.config.verifier import VerifierConfig
from eagle3lib.data.chat_tokens import Tokenized
from eagle3lib.model.verifier import LayerCapture, base_model, decoder_layers, load_hf_model


def pad_batch(batch: list[Tokenized], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded input ids and the attention mask of a batch of tokenized samples."""
    T = max(len(s) for s in batch)
    ids = torch.full((len(batch), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), T), dtype=torch.long)
    for b, s in enumerate(batch):
        ids[b, : len(s)] = torch.from_numpy(s.input_ids.astype("int64"))
        mask[b, : len(s)] = 1
    return ids, mask


def pick_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def hf_compute_dtype(cfg: ExtractConfig, vcfg: VerifierConfig) -> str:
    """The HF backend's compute precision (extract.hf_dtype): explicit, or verifier.dtype on GPUs and float32 on CPU."""
    if cfg.hf_dtype != "auto":
        return cfg.hf_dtype
    on_gpu = cfg.device_map is not None or pick_device(cfg.device).startswith("cuda")
    return vcfg.dtype if on_gpu else "float32"


def length_batches(samples: list[Tokenized], batch_tokens: int) -> list[list[int]]:
    """Indices of `samples` grouped so that batch size x longest length <= batch_tokens, longest first."""
    order = sorted(range(len(samples)), key=lambda i: -len(samples[i]))
    batches: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        longest = len(samples[cur[0]]) if cur else len(samples[i])
        if cur and (len(cur) + 1) * longest > batch_tokens:
            batches.append(cur)
            cur = []
        cur.append(i)
    if cur:
        batches.append(cur)
    return batches


class HFExtractor:
    """`extract(samples)` yields (sample, aux [T, 3, H], final [T, H]) on CPU, in input order."""

    def __init__(self, model_path: str, aux_ids: list[int], dtype: str = "bfloat16", device: str = "auto",
                 device_map: str | None = None, trust_remote_code: bool = False, batch_tokens: int = 16384,
                 model: Any = None):
        self.device = pick_device(device)
        if model is None:
            model = load_hf_model(model_path, dtype=dtype, device_map=device_map, trust_remote_code=trust_remote_code)
            if device_map is None:
                model = model.to(self.device)
        self.model = model
        self.base = base_model(model)
        self.layers = decoder_layers(model)
        self.capture = LayerCapture(self.layers, aux_ids)
        self.batch_tokens = batch_tokens
        self.input_device = self.base.get_input_embeddings().weight.device
        self.pad_id = 0

    @torch.inference_mode()
    def forward(self, batch: list[Tokenized]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        ids, mask = pad_batch(batch, self.pad_id)
        self.base(input_ids=ids.to(self.input_device), attention_mask=mask.to(self.input_device), use_cache=False)
        aux, final = self.capture.pop()
        aux, final = aux.cpu(), final.cpu()
        return [(aux[b, : len(s)].clone(), final[b, : len(s)].clone()) for b, s in enumerate(batch)]

    @torch.inference_mode()
    def reference(self, sample: Tokenized):
        """The verifier's own prediction of the sample's tokens (full forward, lm_head included): what the stored
        final state must reproduce (eagle3lib/model/final_check.py)."""
        from eagle3lib.model.final_check import reference_from_logits

        ids = torch.from_numpy(sample.input_ids.astype("int64"))
        logits = self.model(input_ids=ids[None].to(self.input_device), use_cache=False).logits[0]
        self.capture.captured = {}  # the hooks fired too: not a batch to store
        return reference_from_logits(logits.float().cpu(), ids)

    def extract(self, samples: Iterable[Tokenized], window: int = 0) -> Iterator[tuple[Tokenized, torch.Tensor, torch.Tensor]]:
        """Reads `window` samples at a time (default: enough for ~4 full batches), batches them by length, yields in order."""
        it = iter(samples)
        while True:
            chunk: list[Tokenized] = []
            budget = window or 4 * self.batch_tokens
            tokens = 0
            for s in it:
                chunk.append(s)
                tokens += len(s)
                if (window and len(chunk) >= window) or (not window and tokens >= budget):
                    break
            if not chunk:
                return
            results: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
            for idx in length_batches(chunk, self.batch_tokens):
                for i, r in zip(idx, self.forward([chunk[i] for i in idx]), strict=True):
                    results[i] = r
            for i, s in enumerate(chunk):
                yield s, *results.pop(i)

    def close(self) -> None:
        self.capture.remove()
