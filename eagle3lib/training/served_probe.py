"""Acceptance as served, during training: every `train.served_eval_every` steps (and at the last step) the drafter as
it is now decodes a small fixed set of held-out prompts by real speculative decoding, greedy and at the serving
temperature, and its measured tau goes to metrics.jsonl (kind "served") beside the validation's estimate.

Why: the estimate (the product of per-position accuracies on teacher-forced held-out rows) tracked vLLM's greedy tau
within 1% on the demo, but nothing showed it holds at temperature, on other data or another model; the probe measures
what serving pays for while there is still time to pick the checkpoint (`train.best_by: served_greedy |
served_sampled`).

How: the weights are written as a drafter checkpoint (the one vLLM would load), then either read back through the
evaluate stage's loader and decoded with the library's speculative decoding (eagle3lib/model/speculative.py) and the
HF verifier loaded once into the training process (`train.served_eval_backend: library`), or served by a vLLM server
started for the probe with that checkpoint as its speculator (`vllm`, on `train.served_eval_gpus`: vLLM cannot swap a
running server's speculator weights). Rank 0 measures; the other ranks wait. Prompts: the first
`served_eval_prompts` validation samples by id, each cut where its first answer token starts. One fixed seed per
prompt, so two probes differ only by the drafter.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle3lib.config.train import TrainConfig
from eagle3lib.config.verifier import VerifierConfig
from eagle3lib.model.checkpoint import load_drafter, save_drafter
from eagle3lib.model.drafter import DrafterConfig
from eagle3lib.model.speculative import DecodeResult, EagleDrafter, Verifier, speculative_decode, summarize_runs
from eagle3lib.model.verifier import eos_ids, load_hf_model, load_tokenizer
from eagle3lib.training import distributed as dist


def probe_prompts(reader: Any, val: list[int], n: int) -> list[tuple[str, list[int]]]:
    """(sample id, prompt token ids) of the first `n` validation samples by id: each sample's tokens up to its first
    loss-masked (answer) token. Samples without one (nothing to answer) are passed over."""
    out = []
    for i in sorted(val, key=lambda j: reader.ids[j]):
        s = reader[i]
        first = torch.nonzero(s.loss_mask, as_tuple=False)
        if first.numel() and int(first[0, 0]) > 0:
            out.append((s.sample_id, s.input_ids[: int(first[0, 0])].tolist()))
        if len(out) == n:
            break
    return out


@dataclass(frozen=True)
class ProbeSettings:
    """What the probe measures and where: the train section's served_eval_* keys and the run's serving facts."""

    every: int  # train.served_eval_every
    k: int  # train.ttt_steps: drafts per round
    max_tokens: int
    temperature: float  # the sampled pass's (0: greedy only)
    backend: str  # "library" or "vllm"
    gpus: str | None  # CUDA_VISIBLE_DEVICES of the probe's vLLM server
    n_prompts: int
    seed: int  # train.seed: one fixed sampling seed per prompt derives from it
    verifier: VerifierConfig
    model_path: str
    log_dir: Path  # where the vLLM server logs

    @classmethod
    def of(cls, cfg: TrainConfig, vcfg: VerifierConfig, model_path: str, log_dir: Path) -> ProbeSettings:
        return cls(cfg.served_eval_every, cfg.ttt_steps, cfg.served_eval_max_tokens, cfg.served_eval_temperature,
                   cfg.served_eval_backend, cfg.served_eval_gpus, cfg.served_eval_prompts, cfg.seed, vcfg, model_path,
                   log_dir)


class ServedProbe:
    """Rank 0's probe: the prompts (and, for the library, the verifier) are loaded at the first probe and kept."""

    def __init__(self, how: ProbeSettings, device: torch.device, rank: int,
                 prompts: Callable[[int], list[tuple[str, list[int]]]]):
        self.how, self.device, self.rank, self.prompts_of = how, device, rank, prompts
        self.verifier: Verifier | None = None
        self.prompts: list[tuple[str, list[int]]] | None = None
        self.eos: list[int] = []
        self.load_s = 0.0

    def due(self, step: int, total_steps: int) -> bool:
        return bool(self.how.every) and (step % self.how.every == 0 or step == total_steps)

    def _open(self) -> None:
        how, t0 = self.how, time.time()
        self.prompts = self.prompts_of(how.n_prompts)
        if how.backend == "library":
            trust = how.verifier.trust_remote_code
            model = load_hf_model(how.model_path, "float32", trust_remote_code=trust).to(self.device)
            self.verifier = Verifier(model)
            self.eos = eos_ids(load_tokenizer(how.model_path, trust), how.model_path)
        self.load_s = time.time() - t0

    def measure(self, module: Any, dcfg: DrafterConfig, step: int, epoch: float,
                elapsed_s: Callable[[], float]) -> dict[str, Any] | None:
        """The probe's record on rank 0 (None on the others, and when there is no held-out prompt); every rank takes
        part in gathering the weights of `module`."""
        state = dist.model_state(module)
        # the training's random stream is left as it was (loading a model draws from it): a run with probes trains
        # exactly as one without, and a resumed run as an uninterrupted one
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            rec = self._measure_rank0(state, dcfg, step, epoch, elapsed_s) if self.rank == 0 else None
        dist.barrier()
        return rec

    def modes(self) -> dict[str, float]:
        return {"greedy": 0.0, **({"sampled": self.how.temperature} if self.how.temperature > 0 else {})}

    def _measure_rank0(self, state: dict[str, torch.Tensor], dcfg: DrafterConfig, step: int, epoch: float,
                       elapsed_s: Callable[[], float]) -> dict[str, Any] | None:
        if self.prompts is None:
            self._open()
        if not self.prompts:
            return None
        t0 = time.time()
        with tempfile.TemporaryDirectory(prefix="eagle3lib-probe-") as tmp:
            ckpt = save_drafter(state, dcfg, Path(tmp) / "drafter")
            got = self._vllm(ckpt) if self.how.backend == "vllm" else self._library(ckpt)
        rec: dict[str, Any] = {"kind": "served", "step": step, "backend": self.how.backend, "epoch": epoch,
                               "prompts": len(self.prompts)}
        for mode, s in got.items():
            rec[f"tau_{mode}"] = s["tau"]
            rec[f"accept_rate_pos_{mode}"] = s["accept_rate_pos"]
            rec[f"output_tokens_{mode}"] = s["output_tokens"]
        rec.update(probe_s=round(time.time() - t0, 3), load_s=round(self.load_s, 3), time=time.time(),
                   elapsed_s=elapsed_s())
        self.load_s = 0.0  # counted once, in the first probe's record
        return rec

    def _library(self, ckpt: Path) -> dict[str, dict[str, Any]]:
        """The library's speculative decoding, one prompt at a time, one fixed seed per prompt."""
        how = self.how
        drafter, _ = load_drafter(ckpt, device=self.device, verifier_path=how.model_path)
        out = {}
        with torch.no_grad():
            for mode, temperature in self.modes().items():
                eagle = EagleDrafter(drafter)
                runs: list[DecodeResult] = []
                for j, (_, prompt) in enumerate(self.prompts or []):
                    gen = torch.Generator().manual_seed(1_000_003 * how.seed + j)
                    runs.append(speculative_decode(self.verifier, eagle, prompt, how.max_tokens, how.k, eos=self.eos,
                                                   temperature=temperature, generator=gen))
                out[mode] = summarize_runs(runs, how.k)
        return out

    def _vllm(self, ckpt: Path) -> dict[str, dict[str, Any]]:
        """A vLLM server with this checkpoint as its speculator, the prompts as token ids, vLLM's spec-decode counters
        read around each pass (eagle3lib/vllm/measure.py): what serving measures, at the cost of a server start."""
        from eagle3lib.vllm.measure import EvalPrompt, run_pass
        from eagle3lib.vllm.serving import served

        how = self.how
        prompts = [EvalPrompt(pid, "probe", ids) for pid, ids in self.prompts or []]
        out = {}
        with served(how.verifier, how.model_path, how.log_dir / "served_probe_vllm.log", ckpt, how.k,
                    extra_env={"CUDA_VISIBLE_DEVICES": how.gpus} if how.gpus else None) as ep:
            for mode, temperature in self.modes().items():
                p = run_pass(ep, prompts, temperature=temperature, max_tokens=how.max_tokens,
                             concurrency=len(prompts), request_timeout_s=600.0, connect_timeout_s=10.0, counters=True,
                             label=f"probe {mode}", progress=False)
                out[mode] = {"tau": p.get("tau"), "accept_rate_pos": p.get("accept_rate_pos"),
                             "output_tokens": p.get("output_tokens")}
        return out
