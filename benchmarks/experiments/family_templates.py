"""Chat templates of the shape each served model family uses, for the support matrix's tiny models
(families.py beside this file). Miniatures: the markers, turn order and reasoning blocks of the family's own template,
none of its tool-calling branches. No `{% generation %}` markers, as in the real templates: the extract stage finds
assistant spans by prefix rendering, ending at the family's end-of-turn marker (what `eagle3lib init` decides).

Sources (each family's published tokenizer_config.json / chat_template.jinja, read for their markers):
  llama3   `<|start_header_id|>{role}<|end_header_id|>\\n\\n{content}<|eot_id|>` (Llama-3.1/3.3 Instruct)
  chatml   `<|im_start|>{role}\\n...<|im_end|>` with `<think>` blocks (Qwen3, Qwen3-MoE, Qwen3-Next)
  harmony  `<|start|>{role}<|channel|>analysis|final<|message|>...<|end|>` (gpt-oss)
  glm      `[gMASK]<sop><|user|>\\n...<|assistant|>\\n<think>...</think>...`; a turn ends where the next role begins
  minimax  `]~b]user\\n...[e~[` with `<think>` blocks (MiniMax-M2)
  gemma    `<start_of_turn>user\\n...<end_of_turn>`, the assistant's role is `model` (Gemma 3 / 4)
  mistral  `<s>[INST] ... [/INST]answer</s>` with a `[SYSTEM_PROMPT]` block (Mistral / Ministral)
"""

from __future__ import annotations

# the reasoning of an assistant message, '' when none (the tiny corpus writes `reasoning_content`)
_R = "{%- set r = m.reasoning_content if m.reasoning_content is defined and m.reasoning_content else '' -%}"

LLAMA3 = (
    "{{- '<|begin_of_text|>' -}}"
    "{%- for m in messages -%}"
    "{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\\n\\n' + m.content + '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- endif -%}"
)

CHATML_THINK = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}" + _R +
    "{{- '<|im_start|>assistant\\n<think>\\n' + r + '\\n</think>\\n\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)

HARMONY = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}" + _R +
    "{%- if r -%}{{- '<|start|>assistant<|channel|>analysis<|message|>' + r + '<|end|>' -}}{%- endif -%}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + m.content + '<|end|>' -}}"
    "{%- else -%}{{- '<|start|>' + m.role + '<|message|>' + m.content + '<|end|>' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|start|>assistant' -}}{%- endif -%}"
)

GLM = (
    "{{- '[gMASK]<sop>' -}}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}" + _R +
    "{{- '<|assistant|>\\n<think>' + r + '</think>\\n' + m.content -}}"
    "{%- else -%}{{- '<|' + m.role + '|>\\n' + m.content -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)

MINIMAX = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}" + _R +
    "{{- ']~b]ai\\n<think>\\n' + r + '\\n</think>\\n\\n' + m.content + '[e~[\\n' -}}"
    "{%- else -%}{{- ']~b]' + m.role + '\\n' + m.content + '[e~[\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- ']~b]ai\\n<think>\\n' -}}{%- endif -%}"
)

GEMMA = (
    "{{- '<bos>' -}}"
    "{%- for m in messages -%}"
    "{%- set role = 'model' if m.role == 'assistant' else ('user' if m.role == 'system' else m.role) -%}"
    "{{- '<start_of_turn>' + role + '\\n' + m.content + '<end_of_turn>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<start_of_turn>model\\n' -}}{%- endif -%}"
)

MISTRAL = (
    "{{- '<s>' -}}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}{{- '[SYSTEM_PROMPT]' + m.content + '[/SYSTEM_PROMPT]' -}}"
    "{%- elif m.role == 'user' -%}{{- '[INST]' + m.content + '[/INST]' -}}"
    "{%- else -%}{{- m.content + '</s>' -}}{%- endif -%}"
    "{%- endfor -%}"
)

# template name -> (its text, special tokens it needs, eos, pad, the marker that ends an assistant turn: what
# `eagle3lib init` must find; GLM has none, a turn ends where the next role begins, so the tokenizer's eos)
TEMPLATES: dict[str, tuple[str, tuple[str, ...], str, str, str]] = {
    "llama3": (LLAMA3, ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                        "<|eot_id|>"), "<|eot_id|>", "<|end_of_text|>", "<|eot_id|>"),
    "chatml": (CHATML_THINK, ("<|endoftext|>", "<|im_start|>", "<|im_end|>"), "<|im_end|>", "<|endoftext|>",
               "<|im_end|>"),
    "harmony": (HARMONY, ("<|startoftext|>", "<|endoftext|>", "<|start|>", "<|channel|>", "<|message|>", "<|end|>",
                          "<|return|>"), "<|return|>", "<|endoftext|>", "<|end|>"),
    "glm": (GLM, ("[gMASK]", "<sop>", "<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>"), "<|endoftext|>",
            "<|endoftext|>", "<|endoftext|>"),
    "minimax": (MINIMAX, ("]~!b[", "]~b]", "[e~[", "<|pad|>"), "[e~[", "<|pad|>", "[e~["),
    "gemma": (GEMMA, ("<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>"), "<end_of_turn>", "<pad>",
              "<end_of_turn>"),
    "mistral": (MISTRAL, ("<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"), "</s>",
                "<pad>", "</s>"),
}
