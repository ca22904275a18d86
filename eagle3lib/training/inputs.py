"""What a training run reads before it builds anything: the verifier's config, the extract stage's hidden-state store
(checked against the verifier), the train / validation split, the drafter to start from (train.init_from) and the
draft vocabulary (counted once on rank 0, saved to RUN_DIR/train/draft_vocab.safetensors, reused on resume)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3lib.config.train import TrainConfig
from eagle3lib.config.verifier import VerifierConfig
from eagle3lib.data.hidden_store import HiddenStateReader, StoreError
from eagle3lib.data.packing import Split, nested_subset, split_samples
from eagle3lib.model.draft_vocab import DraftVocab, build_draft_vocab, count_loss_tokens
from eagle3lib.model.drafter_shape import drafter_config_from
from eagle3lib.model.interop import InitSource, check_init_source, read_init_source
from eagle3lib.model.verifier import aux_layer_ids, load_config, resolve_model
from eagle3lib.training import distributed as dist
from eagle3lib.training.checkpoints import list_checkpoints
from eagle3lib.training.setup import TrainingError, check_store, drafter_layer_for


@dataclass
class TrainInputs:
    model_path: str  # the verifier's folder (resolved from verifier.model)
    vconf: Any  # its transformers config
    aux_ids: list[int]  # the verifier layers whose states feed fc
    drafter_layer: str  # "llama" or "mla" (train.drafter_layer resolved)
    reader: HiddenStateReader  # the extract stage's store
    store_dir: Path
    lengths: list[int]  # tokens per stored sample
    split: Split  # store indices of the training and validation samples
    truncated: int  # training samples longer than train.packed_row_tokens
    init: InitSource | None  # train.init_from, read (None on resume: the checkpoint has the weights)
    vocab: DraftVocab


def load_inputs(cfg: TrainConfig, vcfg: VerifierConfig, store_dir: Path,
                out_dir: Path) -> TrainInputs:
    model_path = resolve_model(vcfg.model)
    vconf = load_config(model_path, vcfg.trust_remote_code)
    aux_ids = aux_layer_ids(vcfg.aux_layer_ids, vconf.num_hidden_layers)
    drafter_layer = drafter_layer_for(cfg, vconf)
    try:
        reader = HiddenStateReader(store_dir)
    except StoreError as e:
        raise TrainingError(str(e)) from None
    check_store(reader.meta, store_dir, vconf, aux_ids, cfg.hidden_states, vcfg.model, model_path)
    n_all = len(reader) if cfg.max_samples is None else min(len(reader), cfg.max_samples)
    if n_all == 0:
        raise TrainingError(f"{store_dir}: the hidden-state store holds no samples (did the extract stage run?)")
    lengths = reader.lengths
    split = split_samples(n_all, cfg.val_fraction, cfg.val_max_samples, cfg.seed, reader.ids[:n_all])
    if cfg.train_fraction < 1:
        split = Split(nested_subset(split.train, cfg.train_fraction, cfg.seed, reader.ids), split.val)
    if not split.train:
        raise TrainingError(f"{store_dir}: no training samples left after the validation split ({n_all} samples)")
    truncated = sum(1 for i in split.train if lengths[i] > cfg.packed_row_tokens)

    vocab_path = out_dir / "draft_vocab.safetensors"
    resumable = cfg.resume and list_checkpoints(out_dir / "checkpoints")
    init = read_init_source(cfg.init_from) if cfg.init_from and not resumable else None
    if init is not None:  # before any compute: does the drafter fit this verifier and these settings?
        n_draft = min(cfg.draft_vocab_size, int(vconf.vocab_size))
        check_init_source(init, drafter_config_from(cfg, vconf, aux_ids, n_draft, model_path, drafter_layer),
                          cfg.init_draft_vocab)
    if dist.rank() == 0 and not (resumable and vocab_path.exists()):
        counts = count_loss_tokens(reader, split.train, int(vconf.vocab_size))
        if int(counts.sum()) == 0:
            raise TrainingError(f"{store_dir}: no loss-masked (assistant) tokens in the training split")
        keep = init is not None and cfg.init_draft_vocab == "keep"
        vocab = DraftVocab(init.draft_ids, int(vconf.vocab_size), counts) if keep else \
            build_draft_vocab(counts, cfg.draft_vocab_size)
        vocab.save(vocab_path)
    dist.barrier()
    vocab = DraftVocab.load(vocab_path)
    if vocab.vocab_size != int(vconf.vocab_size):
        raise TrainingError(f"{vocab_path}: built for vocab {vocab.vocab_size}, verifier has {vconf.vocab_size}")
    return TrainInputs(model_path, vconf, aux_ids, drafter_layer, reader, store_dir, lengths, split, truncated, init,
                       vocab)
