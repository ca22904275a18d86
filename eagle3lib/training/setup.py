"""What a training run checks before it starts: the device, the kernels backend, and that the hidden-state store was
extracted from the configured verifier; and the errors the run raises."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from eagle3lib.config.train import TrainConfig
from eagle3lib.model.verifier import weights_fingerprint

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class TrainingError(RuntimeError):
    """Bad input or a failed run; the message says what and where."""


class TrainingDiverged(TrainingError):
    pass


class TrainingInterrupted(RuntimeError):
    """SIGTERM: a checkpoint was saved; running the stage again resumes from it."""


def select_kernels(choice: str, device: torch.device) -> str:
    """"auto" -> triton on CUDA, torch elsewhere (kernels.select_backend decides and logs); explicit choices are checked."""
    from eagle3lib import kernels

    try:
        return kernels.select_backend(device, choice)
    except RuntimeError as e:
        raise TrainingError(f"train.kernels={choice}: {e}") from None


def training_device(cfg: TrainConfig) -> torch.device:
    """This process's device: train.device, and under torchrun the GPU of its LOCAL_RANK."""
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise TrainingError("train.device=cuda but CUDA is not available")
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def drafter_layer_for(cfg: TrainConfig, vconf: PretrainedConfig) -> str:
    """train.drafter_layer resolved for this verifier and machine (eagle3lib/model/drafter_shape.py)."""
    from eagle3lib.model.drafter_shape import choose_drafter_layer

    try:
        return choose_drafter_layer(cfg.drafter_layer, vconf, torch.cuda.is_available())
    except ValueError as e:
        raise TrainingError(str(e)) from None


def check_store(meta: dict[str, Any], store_dir: Path, vconf: PretrainedConfig, aux_ids: list[int],
                hidden_states: str = "offline", verifier: str = "", model_path: str = "") -> None:
    """Hidden states must come from the configured verifier: the same weights (where the store recorded them), hidden
    size, vocabulary and feature layers; an offline run needs a store that holds them (online runs use its tokens
    only). Shapes alone let a store of builtin:tiny train a drafter labelled for tiny-long, and a fine-tune of the same
    base would pass them too."""
    where = store_dir / "store.json"
    if hidden_states == "offline" and meta.get("dtype") == "none":
        raise TrainingError(f"{where}: the store holds tokens only (extracted for train.hidden_states="
                            f"{meta.get('hidden_states', 'online')}), and train.hidden_states is offline: run the "
                            "extract stage again (--force) for an offline store, or train with hidden_states online")
    problems = []
    if int(meta.get("hidden_size", -1)) != int(vconf.hidden_size):
        problems.append(f"hidden_size {meta.get('hidden_size')} != the verifier's {vconf.hidden_size}")
    if "vocab_size" in meta and int(meta["vocab_size"]) != int(vconf.vocab_size):
        problems.append(f"vocab_size {meta['vocab_size']} != the verifier's {vconf.vocab_size}")
    if "num_layers" in meta and int(meta["num_layers"]) != int(vconf.num_hidden_layers):
        problems.append(f"num_layers {meta['num_layers']} != the verifier's {vconf.num_hidden_layers}")
    if list(meta.get("aux_layer_ids", [])) != list(aux_ids):
        problems.append(f"aux_layer_ids {meta.get('aux_layer_ids')} != the profile's {aux_ids}")
    theirs, ours = meta.get("verifier_weights"), weights_fingerprint(model_path) if model_path else None
    if theirs and ours and theirs != ours:
        problems.append(f"it was extracted from {meta.get('verifier')} ({meta.get('verifier_path')}, weights {theirs}), "
                        f"this profile's verifier.model is {verifier} ({model_path}, weights {ours})")
    if problems:
        raise TrainingError(f"{where}: hidden states from a different verifier or layers ({'; '.join(problems)})")
