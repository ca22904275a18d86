"""The tiny verifiers' byte-level BPE tokenizer, saved with a chat format (eagle3lib/tiny/chat_format.py).

Think markers are single tokens (the reasoning parsers match token ids); assistant-mask and end-of-turn conventions
are the chat format's.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from eagle3lib.tiny.chat_format import QWEN3, THINK, ChatFormat

CHAT_TEMPLATE = QWEN3.template  # the dense tiny verifier's


def train_tokenizer(texts: Iterable[str], vocab_size: int, fmt: ChatFormat = QWEN3) -> Tokenizer:
    """Byte-level BPE with single-digit pre-splitting, so numbers are spelled digit by digit (learnable arithmetic)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(THINK),  # the think markers are appended after training
        special_tokens=list(fmt.special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK])
    return tok


def save_hf_tokenizer(tok: Tokenizer, out_dir: Path, model_max_length: int, fmt: ChatFormat = QWEN3) -> None:
    """Write tokenizer.json + tokenizer_config.json (with the chat template) that AutoTokenizer and vLLM load."""
    from transformers import PreTrainedTokenizerFast

    extra = {"bos_token": "[BOS]"} if "[BOS]" in fmt.special else {}
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=fmt.eos,
        pad_token=fmt.pad,
        additional_special_tokens=list(fmt.special),
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
        **extra,
    )
    hf.chat_template = fmt.template
    hf.save_pretrained(out_dir)
