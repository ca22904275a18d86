"""The chat formats of the tiny verifiers: special tokens, end-of-turn conventions and the chat template.

Two formats, each a faithful miniature of the real model family the tiny verifier stands in for:
  qwen3  `<|im_start|>assistant\\n<think>\\n{reasoning}\\n</think>\\n\\n{content}<|im_end|>`; vLLM's `qwen3` reasoning
         parser; `enable_thinking=False` pre-fills an empty think block; `{% generation %}` markers, so
         `return_assistant_tokens_mask=True` gives the loss mask.
  kimi   Kimi-K2.5's: `<|im_system|>system<|im_middle|>..<|im_end|><|im_user|>user<|im_middle|>..<|im_end|>
         <|im_assistant|>assistant<|im_middle|><think>{reasoning}</think>{content}<|im_end|>`; vLLM's `kimi_k2`
         parser; the generation prompt pre-fills `<think>` (thinking is the default), `thinking=False` (or
         `enable_thinking=False`) pre-fills `<think></think>`. Like the real one, the tokenizer's eos is `[EOS]` while
         turns end with `<|im_end|>` (generation_config lists both), and there are no `{% generation %}` markers: the
         extract stage finds assistant spans by prefix rendering with `extract.end_of_turn: ["<|im_end|>"]`, the path
         the real Kimi-K2.5 takes.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK = ("<think>", "</think>")  # added but not special: skip_special_tokens must keep them visible to the parsers


@dataclass(frozen=True)
class ChatFormat:
    name: str  # "qwen3" | "kimi": the reasoning parser family it imitates
    special: tuple[str, ...]  # special tokens, ids 0.. in this order (BPE training reserves them first)
    eos: str  # the tokenizer's eos_token
    pad: str  # the tokenizer's pad_token
    separator: str  # ends each dialogue in packed pretraining rows; never the pad token of a model with a padding_idx
    # (DeepSeek-V3's embedding keeps that row at zero, and RMSNorm's backward at an all-zero position overflows)
    stop: tuple[str, ...]  # generation_config eos_token_id: what ends a served answer
    template: str  # the Jinja chat template
    reasoning_parser: str  # vLLM's --reasoning-parser for this format


_QWEN3_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- set r = message.reasoning_content if message.reasoning_content is defined and message.reasoning_content is not none"
    " else (message.reasoning if message.reasoning is defined and message.reasoning is not none else '') -%}"
    "{%- generation -%}"
    "{{- '<think>\\n' + r + '\\n</think>\\n\\n' + (message.content if message.content is not none else '') + '<|im_end|>' -}}"
    "{%- endgeneration -%}"
    "{{- '\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)

_KIMI_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message.role == 'assistant' -%}"
    "{%- set r = message.reasoning_content if message.reasoning_content is defined and message.reasoning_content is not none"
    " else (message.reasoning if message.reasoning is defined and message.reasoning is not none else '') -%}"
    "{{- '<|im_assistant|>assistant<|im_middle|><think>' + r + '</think>' -}}"
    "{{- (message.content if message.content is not none else '') + '<|im_end|>' -}}"
    "{%- else -%}"
    "{{- '<|im_' + message.role + '|>' + message.role + '<|im_middle|>' + message.content + '<|im_end|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_assistant|>assistant<|im_middle|>' -}}"
    "{%- if (thinking is defined and thinking is false) or (enable_thinking is defined and enable_thinking is false) -%}"
    "{{- '<think></think>' -}}"
    "{%- else -%}{{- '<think>' -}}{%- endif -%}"
    "{%- endif -%}"
)

QWEN3 = ChatFormat(
    name="qwen3", special=("<|endoftext|>", "<|im_start|>", "<|im_end|>"), eos="<|im_end|>", pad="<|endoftext|>",
    separator="<|endoftext|>", stop=("<|im_end|>", "<|endoftext|>"), template=_QWEN3_TEMPLATE, reasoning_parser="qwen3",
)
KIMI = ChatFormat(
    name="kimi",
    special=("[BOS]", "[EOS]", "[PAD]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"),
    eos="[EOS]", pad="[PAD]", separator="[EOS]", stop=("<|im_end|>", "[EOS]"), template=_KIMI_TEMPLATE, reasoning_parser="kimi_k2",
)
FORMATS = {f.name: f for f in (QWEN3, KIMI)}
