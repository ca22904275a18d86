"""Memory of a drafter training step, from the drafter's shapes, before any memory is spent.

A profile whose longest packed row cannot fit the device is refused before training (`check_fits`) with the longest
`train.packed_row_tokens` that fits, instead of an out-of-memory error hours into a run. Terms (bytes):

    activations   T x K x per_step + T x once      what autograd keeps for the backward: T tokens of the micro-batch,
                                                  K TTT steps (counted from the autograd graph, see below)
    backward      0.15 x T x per_step              gradients of one step's activations alive while it runs backward
    attention     flash: 13 x the largest group of block scores (eagle3lib/model/ttt_flash.make_plan; constant in L)
                  doc: the [heads, L, L] scores and probabilities of each step: quadratic in L (sdpa/dense: the
                  same figure, an upper bound: SDPA keeps no probabilities; measured 0.5-0.8x of it)
    parameters    weights + AdamW's two moments (fp32; bf16 adds autocast's bf16 copy of the weights), per process
                  (DDP keeps a full copy; FSDP shards); the fp32 gradients are counted once, in step (see step_bytes)
    verifier head the frozen target head [vocab, H] and embedding rows the loss and the inputs need (+ the draft
                  vocabulary's rows of the head with train.target_logits: draft)
    target logits the verifier's logits on the draft vocabulary, fp32, held through the step (TTTModel.targets)
    inputs        the micro-batch's verifier states: 4 x H per token in the store's dtype (3 aux layers + final)

Activation bytes per token (`FP32`, `BF16`, llama layer): least-squares fits to the bytes the autograd graph keeps
(saved-tensor hooks: tests/test_memory_model.py's kept_bytes_per_token re-counts them, in fp32 and under bf16
autocast); the backward and attention multipliers are fitted to benchmarks/long_context.py's measured peaks (CPU,
fp32), which the model matches within 20% (that benchmark prints each ratio; --bf16 measures under autocast).

    .venv/bin/python -m eagle3lib.training.memory_model kimi-k2.5 --memory-gb 96 141   # a profile's rows, GiB
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eagle3lib.config.train import TrainConfig
from eagle3lib.model.drafter_shape import DrafterShape

GIB = 2**30
BACKWARD = 0.15  # share of one step's activations alive as gradients during its backward (fitted, see docstring)
FLASH_TRANSIENT = 13  # block-score-sized fp32 tensors alive at once in the flash backward (fitted)
QUADRATIC_TRANSIENT = 4  # [heads, L, L]-sized fp32 tensors alive at once in the dense layouts' backward (fitted)
HEADROOM = 0.9  # plan for this share of the device's memory: allocator fragmentation, CUDA context, communication


@dataclass(frozen=True)
class Activations:
    """Bytes per token autograd keeps: per TTT step (hidden, intermediate, heads x head_dim and kv_heads x head_dim per
    decoder layer; draft_vocab: the loss's fp32 logits) and once (steps >= 1 run on slightly fewer rows than step 0;
    bf16: autocast's bf16 copy of fc's input)."""

    hidden: float
    intermediate: float
    heads: float
    kv_heads: float
    draft_vocab: float
    once_hidden: float
    once_draft_vocab: float


# fp32: fitted over 11 drafter shapes (tests/test_memory_model.py::test_activation_bytes_match_the_autograd_graph).
FP32 = Activations(46.9, 15.5, 13.8, 7.9, 7.8, -8.8, -0.6)
# bf16 autocast: fitted over 60 drafter shapes (hidden 128-448, K 2-6) to the bytes kept under torch.autocast("cpu",
# dtype=torch.bfloat16), all within 2% (tests/test_memory_model.py::test_bf16_activation_bytes_match_the_autograd_graph
# checks two shapes it was not fitted on; `.venv/bin/python tests/test_memory_model.py` fits them again). Not FP32 / 2
# (which the model used before: 1.32x and 1.33x too little at hidden 256 and 512): the torch RMSNorm upcasts, keeping its input
# in fp32 and its fp32 normalised product, 7 fp32 [tokens, H] tensors per step. train.kernels triton's RMSNorm (CUDA)
# keeps its bf16 input and one scale per token instead: there these figures are an upper bound (no GPU measured them).
BF16 = Activations(34.5, 7.8, 5.9, 5.7, 7.4, 7.5, 1.0)


def activations(dtype_bytes: int) -> Activations:
    return BF16 if dtype_bytes == 2 else FP32


def per_step_bytes(s: DrafterShape, dtype_bytes: int = 4) -> float:
    """Bytes per token autograd keeps for one TTT step, in fp32 (4) or under bf16 autocast (2)."""
    c = activations(dtype_bytes)
    d = (s.qk_dim + s.v_dim) / 2  # the fits had equal widths
    layer = c.hidden * s.hidden + c.intermediate * s.intermediate + c.heads * s.heads * d + c.kv_heads * s.kv_heads * d
    return s.num_layers * layer + c.draft_vocab * s.draft_vocab


def once_bytes(s: DrafterShape, dtype_bytes: int = 4) -> float:
    """Bytes per token autograd keeps once per micro-batch, besides K x per_step_bytes."""
    c = activations(dtype_bytes)
    return c.once_hidden * s.hidden + c.once_draft_vocab * s.draft_vocab


def target_logits_bytes(s: DrafterShape) -> float:
    """Bytes per token of the verifier's target logits TTTModel.targets returns and the step holds to its end: the
    draft vocabulary's rows in fp32 (`.float()`) and the argmax (int64), with train.target_logits full or draft alike
    ("full" forms the whole vocabulary's logits only 4,096 rows at a time, before the forward: never the peak)."""
    return 4 * s.draft_vocab + 8


def flash_group_elements(heads: int, row_tokens: int, sample_tokens: int) -> int:
    """The largest group of block scores the flash attention forms for rows of samples of `sample_tokens`."""
    from eagle3lib.model.ttt_flash import make_plan

    doc = (torch.arange(row_tokens) // max(1, sample_tokens))[None]
    plan = make_plan(doc, heads)
    return max((n1 - n0) * plan.block * W * heads for _b, n0, n1, W in plan.groups)


def step_bytes(s: DrafterShape, K: int, row_tokens: int, sample_tokens: int, layout: str = "flash",
               dtype_bytes: int = 4, rows: int = 1) -> float:
    """Peak bytes one forward + backward adds over a micro-batch of `rows` packed rows of `row_tokens`, each holding
    samples of `sample_tokens` (the longest sample decides the attention's cost), with K TTT steps."""
    T = rows * row_tokens
    L = min(sample_tokens, row_tokens)
    per = per_step_bytes(s, dtype_bytes)
    total = T * (K * per + BACKWARD * per + once_bytes(s, dtype_bytes))
    # The parameters' fp32 gradients, counted once: DDP is built with gradient_as_bucket_view (training/distributed.py),
    # so each .grad is a view into DDP's all-reduce buckets, not a second fp32 copy beside them (4 x parameters more:
    # 3.7 GiB for the kimi-k2.5 drafter). FSDP's sharded gradients are counted whole here (an upper bound).
    total += 4 * s.parameters()
    if layout == "auto":
        from eagle3lib.model.ttt_attention import AUTO_DOC_MAX

        layout = "doc" if s.heads * L <= AUTO_DOC_MAX else "flash"
    if layout == "flash":
        total += FLASH_TRANSIENT * 4 * flash_group_elements(s.heads, row_tokens, L)
    else:
        n_samples = rows * max(1, row_tokens // max(1, L))
        # kept: each step >= 1's probabilities and the boolean mask; transient: a few score-sized tensors
        kept = n_samples * L * L * (s.num_layers * (K - 1) * s.heads * dtype_bytes + 2.5)
        total += kept + QUADRATIC_TRANSIENT * 4 * s.heads * L * (L + K) * (rows if layout != "doc" else 1)
    return total


def run_bytes(s: DrafterShape, K: int, row_tokens: int, sample_tokens: int, layout: str = "auto",
              dtype_bytes: int = 4, rows: int = 1, store_dtype_bytes: int = 2, shards: int = 1,
              target_logits: str = "full") -> dict[str, float]:
    """Every term of one process's peak, in bytes (`shards` = processes FSDP shards parameters over; 1 for DDP;
    `target_logits`: train.target_logits)."""
    P = s.parameters()
    head_rows = 2 * s.vocab + (s.draft_vocab if target_logits == "draft" else 0)
    terms = {
        "step": step_bytes(s, K, row_tokens, sample_tokens, layout, dtype_bytes, rows),
        "parameters": P * (dtype_bytes if dtype_bytes == 4 else 4 + dtype_bytes) / shards + 8 * P / shards,
        # frozen embedding + target head (fp32 copies), and its draft rows TTTModel copies for target_logits: draft
        "verifier_head": 4 * head_rows * s.hidden,
        "target_logits": rows * row_tokens * target_logits_bytes(s),
        "inputs": rows * row_tokens * 4 * s.hidden * (store_dtype_bytes + 4),  # stored + the fp32 copy training uses
    }
    terms["total"] = sum(terms.values())
    return terms


def longest_that_fits(s: DrafterShape, K: int, memory_bytes: float, layout: str = "auto", dtype_bytes: int = 4,
                      rows: int = 1, store_dtype_bytes: int = 2, shards: int = 1, step: int = 1024,
                      target_logits: str = "full") -> int:
    """The longest packed row (one sample filling it: the worst case) whose step fits `memory_bytes` x HEADROOM; 0 if
    none does. Rows grow in multiples of `step` tokens."""
    budget = memory_bytes * HEADROOM
    lo, hi = 0, 1 << 20
    while hi - lo > step:  # run_bytes grows with the row: bisect
        mid = (lo + hi) // 2 // step * step or step
        if run_bytes(s, K, mid, mid, layout, dtype_bytes, rows, store_dtype_bytes, shards,
                     target_logits)["total"] <= budget:
            lo = mid
        else:
            hi = mid
    return lo


def device_memory_bytes(device: torch.device) -> float:
    """Total memory of a CUDA device; on CPU the memory available now (MemAvailable)."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return float(line.split()[1]) * 1024
    return float("inf")


class DoesNotFit(ValueError):
    pass


def check_fits(s: DrafterShape, K: int, row_tokens: int, sample_tokens: int, memory_bytes: float, *, layout: str,
               dtype_bytes: int, rows: int, store_dtype_bytes: int, shards: int, where: str,
               target_logits: str = "full") -> dict[str, float]:
    """The model's terms; raises DoesNotFit naming the keys to lower and the longest row that fits."""
    terms = run_bytes(s, K, row_tokens, sample_tokens, layout, dtype_bytes, rows, store_dtype_bytes, shards,
                      target_logits)
    if terms["total"] <= memory_bytes * HEADROOM:
        return terms
    best = longest_that_fits(s, K, memory_bytes, layout, dtype_bytes, rows, store_dtype_bytes, shards,
                             target_logits=target_logits)
    parts = ", ".join(f"{k} {v / GIB:.1f}" for k, v in terms.items() if k != "total")
    raise DoesNotFit(
        f"{where}: a packed row of {row_tokens} tokens (longest sample {sample_tokens}) needs ~{terms['total'] / GIB:.1f}"
        f" GiB per process ({parts} GiB; eagle3lib/training/memory_model.py), more than {HEADROOM:.0%} of the "
        f"{memory_bytes / GIB:.1f} GiB this device has. Set train.packed_row_tokens and extract.max_sample_tokens to "
        f"at most {best}" + (" (nothing fits: lower train.micro_batch_rows or use distributed: fsdp)" if not best else "")
        + ", or train.memory_gb to plan for another device.")


def plan_of(cfg: TrainConfig, cuda: bool, store_dtype: str, world: int) -> dict:
    """check_fits' keywords for a train section (bf16 autocast: precision bfloat16, or auto on CUDA)."""
    bf16 = cfg.precision == "bfloat16" or (cfg.precision == "auto" and cuda)
    return dict(layout=cfg.attention, dtype_bytes=2 if bf16 else 4, rows=cfg.micro_batch_rows,
                store_dtype_bytes={"float32": 4, "bfloat16": 2}.get(store_dtype, 1),
                shards=world if cfg.distributed == "fsdp" else 1, target_logits=cfg.target_logits)


def check_train_memory(cfg: TrainConfig, dcfg, longest: int, device: torch.device, store_dtype: str,
                       world: int) -> dict[str, float]:
    """The train stage's check before any memory is spent (cfg: the train section; dcfg: the DrafterConfig; `longest`:
    the longest training sample, cut to the row). Returns the model's terms in GiB for the manifest."""
    memory = cfg.memory_gb * GIB if cfg.memory_gb else device_memory_bytes(device)
    terms = check_fits(DrafterShape.of(dcfg), cfg.ttt_steps, cfg.packed_row_tokens, longest, memory,
                       **plan_of(cfg, device.type == "cuda", store_dtype, world),
                       where=f"train (packed_row_tokens {cfg.packed_row_tokens})")
    return {k: round(v / GIB, 3) for k, v in terms.items()}
