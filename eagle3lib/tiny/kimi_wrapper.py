"""The tiny-kimi text weights inside Kimi-K2.5's multimodal wrapper (`Kimi_K25ForConditionalGeneration`: a nested
`text_config`, a tiny random vision tower), so the HF paths (hooks inside `language_model`, the verifier head's tensor
names, the nested config) run on it as on the released checkpoint's layout. `builtin:tiny-kimi-k25` resolves to it
(eagle3lib/tiny/build.py caches it under the text weights' key and this file's fingerprint)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any


def _tiny_vision_config() -> dict[str, Any]:
    """The smallest vision tower Kimi_K25 builds: it is never run on images here, only carried like the real one."""
    return {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
            "patch_size": 14, "pos_emb_height": 8, "pos_emb_width": 8, "pos_emb_time": 2, "merge_kernel_size": [2, 2]}


def kimi_k25_wrapper(text_dir: Path, out_dir: Path) -> Path:
    """Write the tiny-kimi text model inside `Kimi_K25ForConditionalGeneration` (same text weights, a seeded random
    vision tower) with its tokenizer files, atomically. Its logits equal the text model's (tests/test_tiny_kimi.py)."""
    import torch
    from transformers import DeepseekV3ForCausalLM, Kimi_K25Config, Kimi_K25ForConditionalGeneration

    text_cfg = json.loads((text_dir / "config.json").read_text())
    cfg = Kimi_K25Config(
        text_config=text_cfg, vision_config=_tiny_vision_config(), projection_hidden_size=32,
        tie_word_embeddings=False,  # the wrapper's default is tied; the text model's lm_head is its own
        image_token_id=text_cfg["vocab_size"] - 1, video_token_id=text_cfg["vocab_size"] - 2,  # padded rows: unused ids
        vision_start_token_id=text_cfg["vocab_size"] - 3, vision_end_token_id=text_cfg["vocab_size"] - 4,
    )
    torch.manual_seed(0)
    model = Kimi_K25ForConditionalGeneration(cfg)
    # through from_pretrained, so the checkpoint's per-expert tensors become the module's fused ones
    text = DeepseekV3ForCausalLM.from_pretrained(text_dir, dtype=torch.float32)
    model.model.language_model.load_state_dict(text.model.state_dict())  # strict: every weight and router bias
    model.lm_head.load_state_dict(text.lm_head.state_dict())
    tmp = out_dir.parent / f".tmp-{out_dir.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.eval().save_pretrained(tmp, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (text_dir / name).exists():
            shutil.copy(text_dir / name, tmp / name)
    shutil.rmtree(out_dir, ignore_errors=True)
    os.replace(tmp, out_dir)
    return out_dir
