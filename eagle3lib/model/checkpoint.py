"""Drafter checkpoints in the speculators format that vLLM loads as an EAGLE-3 speculator, plus the resume state.

A checkpoint folder:
  config.json          speculators format: `speculators_model_type: "eagle3"`, `speculators_config` (K speculative
                       tokens, verifier name_or_path), `transformer_layer_config` (a llama config), `draft_vocab_size`,
                       `eagle_aux_hidden_state_layer_ids` and the norm flags exactly as trained. No top-level
                       `model_type` (vLLM's speculators detection needs its absence).
  model.safetensors    fc, layers.N.*, norm, lm_head, d2t (int64 offsets), t2d (bool); fp32. No embed_tokens: vLLM
                       shares the verifier's. (vLLM silently loads a checkpoint without d2t or lm_head and then accepts
                       nothing, so `save_drafter` refuses to write one.)
  training_state.pt    step checkpoints only: optimizer (keyed by parameter name), scheduler step, RNG states, data
                       position, counters and the run's drafter config. Tensors, numbers and strings only, loaded with
                       torch.load(weights_only=True): nothing is unpickled.
Step checkpoints live in RUN_DIR/train/checkpoints/step_NNNNNNNN/ (written to a temporary folder, then renamed, so a
folder with that name is always complete; which one a run resumes: eagle3lib/training/checkpoints.py); the final one
is RUN_DIR/train/final/ (no training state).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from eagle3lib.config.verifier import aux_order_problem
from eagle3lib.core.atomic import write_error
from eagle3lib.model.drafter import DrafterConfig, Eagle3Drafter
from eagle3lib.model.drafter_shape import NO_Q_LORA
from eagle3lib.model.layouts import (
    EAGLE_ARCH,
    UnsupportedDrafter,
    config_from_eagle,
    default_layout,
    detect_layout,
    eagle_config,
    from_layout,
    from_llama_fields,
    to_layout,
)

TRAINING_STATE = "training_state.pt"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")  # refused as weights: loading them runs code


class CheckpointError(ValueError):
    pass


def speculators_config(cfg: DrafterConfig) -> dict[str, Any]:
    if cfg.drafter_layer != "llama":
        raise CheckpointError(f"a {cfg.drafter_layer} drafter layer has no speculators layout (its transformer_layer_config "
                              "is a llama layer): write it in the EAGLE layout (--layout eagle)")
    layer = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": cfg.hidden_act,
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    if cfg.parallel_drafting and (cfg.fc_norm or cfg.norm_output):
        # vllm/transformers_utils/configs/speculators/algos.py update_peagle does not pass these flags on: vLLM would
        # serve another function than the one trained
        raise CheckpointError("a P-EAGLE drafter (train.parallel_drafting) with fc_norm / norm_output: vLLM 0.32 reads "
                              "neither flag for speculators_model_type peagle; train it without them")
    kind = "peagle" if cfg.parallel_drafting else "eagle3"  # vLLM: peagle = method eagle3 + parallel_drafting
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": kind,
        **({"mask_token_id": cfg.mask_token_id} if cfg.parallel_drafting else {}),
        "speculators_version": "0.9.0",
        "speculators_config": {
            "algorithm": kind,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": cfg.ttt_steps}],
            "verifier": {"name_or_path": cfg.verifier, "architectures": []},
        },
        "transformer_layer_config": layer,
        "draft_vocab_size": cfg.draft_vocab_size,
        "target_hidden_size": cfg.hidden_size,
        "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layer_ids),
        "norm_before_residual": cfg.norm_before_residual,
        "norm_before_fc": cfg.norm_before_fc,
        "fc_norm": cfg.fc_norm,
        "norm_output": cfg.norm_output,
        "torch_dtype": "float32",
        "eagle3lib": {"drafter_config": cfg.to_dict()},
    }


def config_from_speculators(d: dict[str, Any]) -> DrafterConfig:
    """DrafterConfig from a speculators eagle3 config.json (ours, or one written by speculators itself)."""
    if d.get("speculators_model_type") not in ("eagle3", "peagle"):
        raise CheckpointError(f"not an EAGLE-3 speculators config (speculators_model_type={d.get('speculators_model_type')!r})")
    if "model_type" in d:
        raise CheckpointError("config.json has a top-level model_type: vLLM would not detect it as a speculators model")
    t = d["transformer_layer_config"]
    if problem := aux_order_problem(d.get("eagle_aux_hidden_state_layer_ids") or [], "eagle_aux_hidden_state_layer_ids"):
        raise CheckpointError(problem)
    if t.get("model_type", "llama") != "llama":
        raise CheckpointError(f"transformer_layer_config.model_type {t.get('model_type')!r}: only llama drafters are supported")
    spec = d.get("speculators_config", {})
    return from_llama_fields(
        t,
        draft_vocab_size=int(d.get("draft_vocab_size") or t["vocab_size"]),
        aux_layer_ids=list(d.get("eagle_aux_hidden_state_layer_ids") or []),
        # vLLM's default when the key is absent: true for eagle3, false for peagle
        # (vllm/transformers_utils/configs/speculators/algos.py, update_eagle3 / update_peagle)
        norm_before_residual=bool(d.get("norm_before_residual", d.get("speculators_model_type") != "peagle")),
        norm_output=bool(d.get("norm_output", False)),
        norm_before_fc=bool(d.get("norm_before_fc", False)),
        fc_norm=bool(d.get("fc_norm", False)),
        ttt_steps=int((spec.get("proposal_methods") or [{}])[0].get("speculative_tokens", 3)),
        verifier=str((spec.get("verifier") or {}).get("name_or_path") or ""),
        parallel_drafting=d.get("speculators_model_type") == "peagle",
        mask_token_id=int(d.get("mask_token_id") or 0),
    )


def drafter_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The drafter's state dict as vLLM names it (the training wrapper's prefixes removed)."""
    out = {}
    for k, v in state.items():
        for prefix in ("module.", "drafter.", "_orig_mod."):
            while k.startswith(prefix):
                k = k[len(prefix):]
        out[k] = v
    return out


def check_replaceable(out_dir: Path) -> None:
    """A checkpoint replaces only a folder that is a checkpoint: its own files, no subfolder. `export RUN/train/final
    --out RUN/train` once replaced the whole train folder (checkpoints, best/, metrics, manifest) with two files."""
    if not out_dir.exists():
        return
    if not out_dir.is_dir():
        raise CheckpointError(f"{out_dir}: exists and is not a folder; choose another output folder")
    others = sorted(p.name + ("/" if p.is_dir() else "") for p in out_dir.iterdir()
                    if p.is_dir() or not (p.name in ("model.safetensors", TRAINING_STATE) or p.suffix == ".json"))
    if others:
        shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
        raise CheckpointError(f"{out_dir}: exists and is not a drafter checkpoint (it holds {shown}); nothing was "
                              "written: choose a new or empty output folder")


def save_drafter(state: dict[str, torch.Tensor], cfg: DrafterConfig, out_dir: str | Path,
                 training_state: dict[str, Any] | None = None, extra_files: dict[str, Any] | None = None,
                 layout: str | None = None) -> Path:
    """Write a complete checkpoint folder atomically (temporary folder, fsync, rename), in the speculators layout or
    the EAGLE one (eagle3lib/model/layouts.py); by default the speculators layout for a llama drafter layer, the EAGLE
    layout for an MLA one."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    check_replaceable(out_dir)
    layout = layout or default_layout(cfg)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in drafter_tensors(state).items()}
    tensors.pop("embed_tokens", None)
    full_vocab = cfg.draft_vocab_size == cfg.vocab_size
    if full_vocab:  # vLLM has no d2t parameter then, and a d2t tensor would fail to load
        tensors.pop("d2t", None)
        tensors.pop("t2d", None)
    if cfg.parallel_drafting and layout != "speculators":
        raise CheckpointError("a P-EAGLE drafter is written in the speculators layout only (speculators_model_type "
                              "peagle is how vLLM finds its mask token)")
    needed = ("fc.weight", "lm_head.weight", "norm.weight", *(() if full_vocab else ("d2t",)),
              *(("mask_hidden",) if cfg.parallel_drafting else ()))
    for need in needed:
        if need not in tensors:
            raise CheckpointError(f"refusing to write a drafter checkpoint without {need} (vLLM would load it silently "
                                  "and never accept a draft)")
    if tensors["lm_head.weight"].shape[0] != cfg.draft_vocab_size or (
            not full_vocab and tensors["d2t"].numel() != cfg.draft_vocab_size):
        raise CheckpointError("lm_head / d2t do not match draft_vocab_size")
    if not full_vocab:
        tensors["d2t"] = tensors["d2t"].to(torch.int64)
    config = speculators_config(cfg) if layout == "speculators" else eagle_config(cfg)
    tensors = dict(sorted(to_layout(tensors, layout).items()))
    tmp = out_dir.parent / f".tmp-{out_dir.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if training_state is not None:
            torch.save(training_state, tmp / TRAINING_STATE)
        for name, obj in (extra_files or {}).items():
            (tmp / name).write_text(json.dumps(obj, indent=2) + "\n")
        for p in tmp.iterdir():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        if out_dir.exists():
            old = out_dir.parent / f".old-{out_dir.name}-{os.getpid()}"
            os.replace(out_dir, old)
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    except Exception as e:  # disk full, quota: the previous checkpoint under this name (if any) is untouched
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"{out_dir}: cannot write the checkpoint ({write_error(out_dir, e)}); earlier "
                              "checkpoints are intact") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _config_json(ckpt_dir: str | Path) -> tuple[Path, dict[str, Any]]:
    path = Path(ckpt_dir) / "config.json"
    if not path.exists():
        raise CheckpointError(f"{path}: no config.json (not a drafter checkpoint)")
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(d, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    if d.get("auto_map") or d.get("trust_remote_code"):
        raise CheckpointError(f"{path}: asks for remote code (auto_map {d.get('auto_map')!r}); eagle3lib never runs "
                              "code that comes with a checkpoint")
    return path, d


def read_layout(ckpt_dir: str | Path) -> str:
    """'speculators' or 'eagle', from the folder's config.json."""
    path, d = _config_json(ckpt_dir)
    layout = detect_layout(d)
    if layout is None:
        raise CheckpointError(f"{path}: not an EAGLE-3 drafter: neither speculators_model_type 'eagle3' (speculators "
                              f"layout) nor architectures [{EAGLE_ARCH}] (EAGLE layout); architectures="
                              f"{d.get('architectures')!r}, model_type={d.get('model_type')!r}")
    return layout


def read_config(ckpt_dir: str | Path) -> DrafterConfig:
    """The drafter config of a folder in either layout."""
    layout = read_layout(ckpt_dir)
    path, d = _config_json(ckpt_dir)
    try:
        return config_from_speculators(d) if layout == "speculators" else config_from_eagle(d)
    except (CheckpointError, UnsupportedDrafter) as e:
        raise CheckpointError(f"{path}: {e}") from None
    except KeyError as e:
        raise CheckpointError(f"{path}: missing field {e}") from None
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: malformed ({e})") from None


LAYER_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "hidden_act", "rms_norm_eps")


def _speculators_problems(d: dict[str, Any]) -> list[str]:
    problems = []
    if "model_type" in d:
        problems.append("a top-level model_type (vLLM then does not detect the speculators format)")
    if d.get("speculators_model_type") not in ("eagle3", "peagle"):
        problems.append(f"speculators_model_type is {d.get('speculators_model_type')!r}, not 'eagle3' (or 'peagle')")
    spec = d.get("speculators_config")
    methods = spec.get("proposal_methods") if isinstance(spec, dict) else None
    if not isinstance(spec, dict):
        problems.append("no speculators_config")
    elif not (isinstance(methods, list) and methods and isinstance(methods[0], dict)
              and isinstance(methods[0].get("speculative_tokens"), int)):
        problems.append("no speculators_config.proposal_methods[0].speculative_tokens")
    layer = d.get("transformer_layer_config")
    if not isinstance(layer, dict):
        problems.append("no transformer_layer_config")
    else:
        problems += [f"no transformer_layer_config.{k}" for k in LAYER_KEYS if k not in layer]
    if not isinstance(d.get("draft_vocab_size"), int):
        problems.append("no draft_vocab_size")
    problems += _aux_ids_problems(d.get("eagle_aux_hidden_state_layer_ids"), "eagle_aux_hidden_state_layer_ids")
    return problems


MLA_KEYS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")


def _eagle_problems(d: dict[str, Any]) -> list[str]:
    problems = [f"no {k}" for k in LAYER_KEYS if k not in d]
    if d.get("model_type") == "deepseek_v3":
        problems.append("model_type 'deepseek_v3' (vLLM turns it into a DeepSeek MTP model; an MLA EAGLE-3 drafter "
                        "says 'deepseek_v2')")
    if d.get("model_type") == "deepseek_v2":
        problems += [f"no {k} (an MLA drafter layer needs it)" for k in MLA_KEYS if not isinstance(d.get(k), int)]
    if not isinstance(d.get("draft_vocab_size"), int):
        problems.append("no draft_vocab_size")
    if int(d.get("num_hidden_layers") or 1) != 1:
        problems.append(f"num_hidden_layers {d.get('num_hidden_layers')}: the EAGLE layout holds one layer (midlayer)")
    ec = d.get("eagle_config") if isinstance(d.get("eagle_config"), dict) else {}
    return problems + _aux_ids_problems(ec.get("eagle_aux_hidden_state_layer_ids"),
                                        "eagle_config.eagle_aux_hidden_state_layer_ids")


def _aux_ids_problems(ids: Any, key: str) -> list[str]:
    if isinstance(ids, list) and len(ids) == 3:
        problem = aux_order_problem(ids, key)
        return [problem] if problem else []
    return [f"{key} must list 3 layers (vLLM's drafter sizes fc for 3), got {ids!r}"]


def check_servable(ckpt_dir: str | Path) -> DrafterConfig:
    """What vLLM needs to load the folder as an EAGLE-3 speculator, checked before a server starts (vLLM fails minutes
    later, or loads silently and accepts nothing). Returns the drafter config; raises naming every missing field."""
    from safetensors import safe_open

    layout = read_layout(ckpt_dir)
    path, d = _config_json(ckpt_dir)
    problems = _speculators_problems(d) if layout == "speculators" else _eagle_problems(d)
    if problems:
        raise CheckpointError(f"{path}: not loadable by vLLM as an EAGLE-3 drafter: {'; '.join(problems)}")
    cfg = read_config(ckpt_dir)
    if cfg.drafter_layer == "mla" and not cfg.q_lora_rank:
        raise CheckpointError(f"{path}: q_lora_rank is {d.get('q_lora_rank')!r}: {NO_Q_LORA}")
    shapes: dict[str, tuple[int, ...]] = {}
    for f in weight_files(ckpt_dir):
        try:
            with safe_open(str(f), framework="pt") as sf:
                shapes.update({k: tuple(sf.get_slice(k).get_shape()) for k in sf.keys()})  # noqa: SIM118
        except Exception as e:
            raise CheckpointError(f"{f}: damaged weights ({type(e).__name__}: {e})") from None
    shapes = from_layout({k.removeprefix("model."): v for k, v in shapes.items()})
    need = {"fc.weight": (cfg.hidden_size, cfg.num_aux * cfg.hidden_size), "norm.weight": (cfg.hidden_size,),
            "lm_head.weight": (cfg.draft_vocab_size, cfg.hidden_size)}
    if cfg.draft_vocab_size != cfg.vocab_size:
        need["d2t"] = (cfg.draft_vocab_size,)  # without it vLLM loads, maps draft ids wrong and accepts nothing
    if cfg.parallel_drafting:  # without it vLLM fills the masked slots with zeros and warns only
        need["mask_hidden"] = (cfg.num_aux * cfg.hidden_size,)
    bad = [f"{k} {'missing' if k not in shapes else f'has shape {list(shapes[k])}'}, expected {list(v)}"
           for k, v in need.items() if shapes.get(k) != v]
    if bad:
        raise CheckpointError(f"{ckpt_dir}: weights vLLM needs are wrong: {'; '.join(bad)}")
    return cfg


def weight_files(ckpt_dir: str | Path) -> list[Path]:
    """The folder's *.safetensors files; a folder holding only pickle-based weights is refused, never unpickled."""
    files = sorted(Path(ckpt_dir).glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in Path(ckpt_dir).iterdir() if p.suffix in PICKLE_SUFFIXES) \
            if Path(ckpt_dir).is_dir() else []
        if pickles:
            raise CheckpointError(f"{Path(ckpt_dir) / pickles[0]}: pickle-based weights are refused (loading a pickle "
                                  "runs code); save them as safetensors with the tool that wrote them")
        raise CheckpointError(f"{ckpt_dir}: no *.safetensors weights")
    return files


def load_state(ckpt_dir: str | Path) -> dict[str, torch.Tensor]:
    """The weights of a folder in either layout, named as the drafter module names them."""
    from safetensors.torch import load_file

    files = weight_files(ckpt_dir)
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(str(f)))
        except Exception as e:  # truncated or overwritten file
            raise CheckpointError(f"{f}: damaged weights ({type(e).__name__}: {e})") from None
    return from_layout(drafter_tensors(state))


def load_drafter(ckpt_dir: str | Path, device: str | torch.device = "cpu", verifier_path: str | None = None,
                 dtype: torch.dtype = torch.float32) -> tuple[Eagle3Drafter, DrafterConfig]:
    """(drafter in eval mode, its config) from a checkpoint folder. The embedding comes from the checkpoint when it
    has one, else from the verifier (`verifier_path`, default: speculators_config.verifier.name_or_path)."""
    cfg = read_config(ckpt_dir)
    state = load_state(ckpt_dir)
    model = Eagle3Drafter(cfg)
    emb = state.pop("embed_tokens.weight", None)
    if "d2t" not in state:
        if cfg.draft_vocab_size != cfg.vocab_size:
            raise CheckpointError(f"{ckpt_dir}: no d2t but draft_vocab_size {cfg.draft_vocab_size} != vocab {cfg.vocab_size}")
        state["d2t"] = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64)
    if "t2d" not in state:
        t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
        t2d[state["d2t"] + torch.arange(cfg.draft_vocab_size)] = True
        state["t2d"] = t2d
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"{ckpt_dir}: weights do not match its config.json (missing {missing}, unexpected {unexpected})")
    if emb is None:
        from eagle3lib.model.verifier import load_verifier_head, resolve_model

        vp = verifier_path or cfg.verifier
        if not vp:
            raise CheckpointError(f"{ckpt_dir}: no embed_tokens and no verifier path to take them from")
        emb = load_verifier_head(resolve_model(vp)).embed_tokens
    with torch.no_grad():
        model.embed_tokens.copy_(emb.to(model.embed_tokens.dtype))
    return model.to(device=device, dtype=dtype).eval(), cfg
