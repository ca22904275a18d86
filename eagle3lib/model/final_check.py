"""Does the stored final hidden state reproduce the verifier's own logits? Checked by the extract stage on its first
samples, before the rest is extracted.

The drafter's training target is softmax(lm_head(norm(final))), computed from the stored final state. If an extraction
path hands back another layer's output (a dropped or shifted last layer: vLLM #48124 on DeepSeek-V3 backbones, an
off-by-one in the layer ids: TorchSpec #87) or a post-norm state, the targets are silently wrong and nothing fails until
the trained drafter is served, a week later. The check compares, position by position, the log-probability of the
actual next token and the top-1 token of two computations:
    ours       log_softmax(lm_head(norm(stored final state)))      (eagle3lib.model.verifier.VerifierHead)
    reference  the verifier's own logits: the HF model's full forward, or vLLM's prompt_logprobs of the same request
A faithful store differs only by its storage rounding (bf16 here: ~0.01 in log-probability); a wrong layer moves the
log-probabilities by whole nats and the top-1 token at most positions (tests/test_extract_backends.py shifts a layer).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from typing import Any, NamedTuple

import torch

MIN_TOP1_AGREEMENT = 0.9  # near-ties may flip under bf16 rounding; a wrong layer agrees on far fewer positions
MAX_MEAN_ABS_LOGPROB_DIFF = 0.1  # nats; bf16 rounding of the final state costs ~0.01


class Reference(NamedTuple):
    """The verifier's own prediction of tokens 1..T-1 of one sample (a backend in another package returns the plain
    tuple)."""

    token_logprobs: torch.Tensor  # fp32 [T-1]: log p(token t | tokens < t)
    top1: torch.Tensor  # int64 [T-1]: argmax of the distribution at t-1


def reference_from_logits(logits: torch.Tensor, ids: torch.Tensor) -> Reference:
    """From full logits [T, V] of the sample's tokens ids [T]."""
    lp = torch.log_softmax(logits[:-1].float(), dim=-1)
    return Reference(lp.gather(1, ids[1:, None].long())[:, 0], lp.argmax(-1))


@dataclass
class CheckResult:
    samples: int
    positions: int
    top1_agreement: float
    mean_abs_logprob_diff: float
    max_abs_logprob_diff: float

    @property
    def ok(self) -> bool:
        return self.top1_agreement >= MIN_TOP1_AGREEMENT and self.mean_abs_logprob_diff <= MAX_MEAN_ABS_LOGPROB_DIFF

    def figures(self) -> dict[str, float | int | bool]:
        return {**{k: round(v, 5) if isinstance(v, float) else v for k, v in asdict(self).items()}, "ok": self.ok}


def compare(head, finals: list[torch.Tensor], ids: list[torch.Tensor], refs: list[tuple[torch.Tensor, torch.Tensor]]
            ) -> CheckResult:
    """`head`: the verifier's VerifierHead; per sample its stored final states [T, H], token ids [T] and Reference."""
    agree, n, diffs = 0, 0, []
    for final, tok, (ref_lp, ref_top1) in zip(finals, ids, refs, strict=True):
        lp = torch.log_softmax(head.target_logits(final[:-1]), dim=-1)
        ours = lp.gather(1, tok[1:, None].long())[:, 0]
        agree += int((lp.argmax(-1) == ref_top1).sum())
        n += int(ref_top1.numel())
        diffs.append((ours - ref_lp.float()).abs())
    d = torch.cat(diffs) if diffs else torch.zeros(0)
    return CheckResult(len(refs), n, agree / max(1, n), float(d.mean()) if n else 0.0, float(d.max()) if n else 0.0)


def failure_message(r: CheckResult, backend: str) -> str:
    return (f"the stored final hidden states do not reproduce the verifier's logits (extract.backend={backend}, "
            f"{r.samples} samples, {r.positions} positions: top-1 agrees on {r.top1_agreement:.1%}, needs "
            f"{MIN_TOP1_AGREEMENT:.0%}; mean |log-prob difference| {r.mean_abs_logprob_diff:.3f}, allowed "
            f"{MAX_MEAN_ABS_LOGPROB_DIFF}): the extraction captured another layer than the last decoder layer's output "
            "(a dropped or shifted final layer, or a post-norm state). Nothing was stored; check the backend and "
            "verifier.aux_layer_ids, or set extract.final_state_check: 0 to skip the check")


CHECK_TOKENS = 512  # per checked sample: the reference logits are [tokens, vocab] fp32 (163,840 wide for Kimi)


class FinalStateMismatch(ValueError):
    """The final states a backend hands back do not reproduce the verifier's logits."""


def check_backend(backend: Any, samples: list, model_path: str, trust_remote_code: bool, name: str,
                  store_dtype: str = "bfloat16") -> dict[str, Any]:
    """The first samples' final states from `backend` (an extractor with .extract and .reference), rounded as the
    store keeps them, against the verifier's own logits. Raises FinalStateMismatch; returns the figures and seconds.
    Run before anything is stored (the extract stage) or trained on (online hidden states)."""
    from eagle3lib.data.hidden_store import as_stored
    from eagle3lib.model.verifier import load_verifier_head

    t0 = time.time()
    cut = [replace(s, input_ids=s.input_ids[:CHECK_TOKENS], loss_mask=s.loss_mask[:CHECK_TOKENS]) for s in samples]
    head = load_verifier_head(model_path, trust_remote_code)
    finals = [as_stored(f, store_dtype).float() for _, _, f in backend.extract(cut)]
    refs = [backend.reference(s) for s in cut]
    ids = [torch.from_numpy(s.input_ids.astype("int64")) for s in cut]
    result = compare(head, finals, ids, refs)
    if not result.ok:
        raise FinalStateMismatch(failure_message(result, name))
    return {**result.figures(), "seconds": round(time.time() - t0, 2)}


def check_line(figures: dict[str, Any]) -> str:
    return (f"final-state check: the final states reproduce the verifier's logits ({figures['positions']} positions of "
            f"{figures['samples']} samples: top-1 agrees on {figures['top1_agreement']:.1%}, mean |log-prob difference| "
            f"{figures['mean_abs_logprob_diff']:.4f})")
