"""The training estimate on the evaluation's own distribution: the train stage's estimator (the teacher-forced
training-time test, tau_est = 1 + sum_k full_acc_k over every answer position) computed on the verifier's greedy
answers to the held-out prompts (vLLM's base pass), instead of on the validation split (sampled answers to training
prompts).

Beside the measured vLLM greedy tau it separates the two reasons the validation estimate misses:
  validation estimate - this estimate    the shift between the validation split and held-out greedy decoding;
  this estimate - vLLM greedy tau        the estimator itself: it averages acceptance over every position of an
                                         answer, while a decoder drafts only where the previous round ended, and a
                                         round that starts after a long accepted run is not a random position.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from eagle3lib.config.verifier import VerifierConfig


def same_distribution_estimate(vcfg: VerifierConfig, model_path: str, ckpt: Path, prompts,
                               outputs: dict[str, list[int] | None], k: int, decay: float,
                               dtype: str = "float32") -> dict[str, Any] | None:
    """{"tau", "accept_rate_pos", "positions", "sequences"} of drafter `ckpt` (K = k) on prompt + greedy answer, the
    answer's tokens counted as training counts loss positions; None when no answer came back."""
    from eagle3lib.data.chat_tokens import Tokenized
    from eagle3lib.data.hidden_store import HiddenSample
    from eagle3lib.data.packing import collate
    from eagle3lib.model.checkpoint import load_drafter
    from eagle3lib.model.hf_extract import HFExtractor
    from eagle3lib.model.ttt import STAT_KEYS, TTTModel, summarize
    from eagle3lib.model.verifier import load_verifier_head

    seqs = [Tokenized(p.id, np.asarray([*p.token_ids, *out], dtype=np.int32),
                      np.asarray([False] * len(p.token_ids) + [True] * len(out), dtype=bool))
            for p in prompts if (out := outputs.get(p.id))]
    if not seqs:
        return None
    drafter, dcfg = load_drafter(ckpt, verifier_path=model_path)
    head = load_verifier_head(model_path, vcfg.trust_remote_code)
    k = min(k, dcfg.ttt_steps)
    model = TTTModel(drafter, head.norm_weight, head.lm_head, head.rms_norm_eps, k, decay).eval()
    extractor = HFExtractor(model_path, dcfg.aux_layer_ids, dtype=dtype, device="cpu",
                            trust_remote_code=vcfg.trust_remote_code)
    stats = torch.zeros(len(STAT_KEYS), k, dtype=torch.float64)
    with torch.no_grad():
        for tok, aux, final in extractor.extract(seqs):
            s = HiddenSample(tok.id, torch.as_tensor(tok.input_ids, dtype=torch.long), torch.as_tensor(tok.loss_mask),
                             aux.float(), final.float())
            mb = collate(SimpleNamespace(lengths=[len(s)]), [[0]], len(s), {0: s})  # one answer per row
            stats += model(mb, torch.ones(k))[1]
    est = summarize(stats, decay)
    rates = [est[f"full_acc_{i}"] for i in range(k)]
    return {"tau": est["tau_est"], "accept_rate_pos": rates, "positions": int(stats[0, 0]), "sequences": len(seqs)}
