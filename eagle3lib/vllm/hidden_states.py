"""Hidden states with vLLM: the `extract_hidden_states` speculative method plus a hidden-states KV connector.

The server is started with `eagle_aux_hidden_state_layer_ids` = the feature layers plus L (vLLM's id L is the output
of the last decoder layer before the final norm), and `eagle3lib.vllm.connector.EagleHiddenStatesConnector`, which
writes one safetensors file per request (`hidden_states` [T, n, H], `token_ids` [T]) into a scratch folder and returns
its path in `kv_transfer_params.hidden_states_path`. Each sample is one prefill-only request (token ids as the prompt,
max_tokens=1); `concurrency` requests are in flight so vLLM batches the prefills. The client waits on the file's
companion lock, reads it, checks the token ids, and deletes it. Tensor parallelism is vLLM's
(verifier.tensor_parallel_size); only TP rank 0 writes.

vLLM emits the requested layers in layer order: the ids are ascending, the one rule everywhere
(eagle3lib/config/verifier.py `aux_order_problem`), so the stored order is the order listed.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch

from eagle3lib.config.verifier import VerifierConfig, aux_order_problem
from eagle3lib.data.chat_tokens import Tokenized
from eagle3lib.vllm.endpoint import ServerError, http_client
from eagle3lib.vllm.measure import FULL_SOFTMAX
from eagle3lib.vllm.server import log_cause, server_for_verifier

CONNECTOR = "EagleHiddenStatesConnector"
CONNECTOR_MODULE = "eagle3lib.vllm.connector"


def speculative_config(layer_ids: list[int]) -> dict[str, Any]:
    return {"method": "extract_hidden_states", "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}}}


def kv_transfer_config(storage: str | Path) -> dict[str, Any]:
    return {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE, "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(storage)}}


def staged_bytes(n_tokens: int, n_layers: int, hidden_size: int) -> int:
    """An upper bound on the connector's file for a request of n_tokens: the states at 4 bytes (fp32 on CPU; bf16
    servers write half), the token ids, and a header."""
    return n_tokens * (n_layers * hidden_size * 4 + 8) + 4096


def read_hidden_file(path: str, timeout_s: float = 600.0, server_died=lambda: False) -> dict[str, torch.Tensor]:
    """Wait for the connector to finish the file (shared lock on `<path>.lock`, or the file appearing), read it, delete
    it. A server that dies before writing it never will: `server_died()` ends the wait."""
    from safetensors.torch import load_file

    lock = path + ".lock"
    deadline = time.time() + timeout_s
    if os.path.exists(lock):
        with open(lock) as lf:
            fcntl.flock(lf, fcntl.LOCK_SH)  # sleeps until the writer releases LOCK_EX
    while not os.path.exists(path):
        if server_died():
            raise ServerError(f"the vLLM server exited before writing the hidden states file {path}")
        if time.time() > deadline:
            raise ServerError(f"vLLM did not write the hidden states file {path} within {timeout_s:.0f} s")
        time.sleep(0.01)
    try:
        return load_file(path, device="cpu")
    finally:
        for p in (path, lock):
            try:
                os.remove(p)
            except FileNotFoundError:
                pass


class VLLMExtractor:
    """Starts a local vLLM extraction server; `extract(samples)` yields (sample, aux [T, n_aux, H], final [T, H])."""

    def __init__(self, model_path: str, verifier_cfg: VerifierConfig, aux_ids: list[int], num_layers: int, work_dir: str | Path,
                 max_sample_tokens: int, concurrency: int = 32, request_timeout_s: float = 3600.0,
                 extra_args: list[str] | None = None, max_position_embeddings: int | None = None,
                 staging_budget: int | None = None, hidden_size: int = 0):
        if verifier_cfg.server_url:
            raise ValueError("vLLM hidden-state extraction starts its own server (the hidden states are written to its "
                             "local disk): unset verifier.server_url, or extract with HF")
        self.work_dir = Path(work_dir)
        # the staging area: the connector's files wait here until read; staging_budget bounds its bytes (online training)
        self.storage = self.work_dir / "vllm-hidden-scratch"
        self.staging_budget = staging_budget
        self.peak_staged = 0  # the most bytes of files the in-flight requests could have written at once
        shutil.rmtree(self.storage, ignore_errors=True)  # leftovers of a killed run
        self.storage.mkdir(parents=True)
        self.aux_ids = list(aux_ids)
        if problem := aux_order_problem(aux_ids):
            raise ValueError(problem)
        self.layer_ids = [*aux_ids, num_layers]  # vLLM returns them in layer order: the order listed
        self.hidden_size = hidden_size  # sizes the staging budget's accounting
        self.concurrency = concurrency
        self.request_timeout_s = request_timeout_s
        max_model_len = max(verifier_cfg.max_model_len, max_sample_tokens + 1)  # +1: the one token each request generates
        env: dict[str, str] = {}
        if max_position_embeddings and max_model_len > max_position_embeddings:
            # a prompt of max_sample_tokens tokens plus the single sampled token, which is never fed back: positions stay in range
            env["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
        self.server = server_for_verifier(
            verifier_cfg, model_path, self.work_dir / "vllm.log",
            speculative_config=speculative_config(self.layer_ids), max_model_len=max_model_len, reasoning_parser=None,
            extra_args=[*verifier_cfg.extra_server_args, "--kv-transfer-config", json.dumps(kv_transfer_config(self.storage)),
                        *(extra_args or [])],
            extra_env=env,
        )
        self.client: httpx.Client | None = None
        self.model_name = ""
        self.start_s = 0.0

    def start(self) -> VLLMExtractor:
        t0 = time.time()
        self.server.start()
        self.start_s = time.time() - t0
        self.model_name = self.server.endpoint().model
        self.client = http_client(self.server.endpoint(), self.concurrency + 4, self.request_timeout_s)
        return self

    def server_died(self) -> bool:
        return self.server.proc is not None and self.server.proc.poll() is not None

    def restart(self) -> None:
        """Start the server again after it died (same port and settings); files of the lost requests are dropped."""
        self.close()
        self.storage.mkdir(parents=True)
        self.start()

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        self.server.stop()
        shutil.rmtree(self.storage, ignore_errors=True)

    def __enter__(self) -> VLLMExtractor:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def reference(self, sample: Tokenized) -> tuple[torch.Tensor, torch.Tensor]:
        """The server's own prediction of the sample's tokens (prompt_logprobs of the same prefill): (log p of each
        token 1..T-1, the top-1 token at each of 0..T-2), what the stored final state must reproduce
        (eagle3lib/model/final_check.py)."""
        _, _, body = self._request(sample, prompt_logprobs=True)
        entries = body["choices"][0].get("prompt_logprobs") or []
        ids = [int(x) for x in sample.input_ids]
        if len(entries) != len(ids):
            raise ServerError(f"sample {sample.id!r}: vLLM returned {len(entries)} prompt logprobs for {len(ids)} tokens")
        lp, top1 = [], []
        for t in range(1, len(ids)):
            e = {int(k): v for k, v in entries[t].items()}
            lp.append(float(e[ids[t]]["logprob"]))
            top1.append(next(k for k, v in e.items() if int(v.get("rank", 0)) == 1))
        return torch.tensor(lp), torch.tensor(top1, dtype=torch.long)

    def one(self, sample: Tokenized) -> tuple[torch.Tensor, torch.Tensor]:
        aux, final, _ = self._request(sample)
        return aux, final

    def _request(self, sample: Tokenized, prompt_logprobs: bool = False) -> tuple[torch.Tensor, torch.Tensor, dict]:
        assert self.client is not None, "start() the extractor first"
        ids = [int(x) for x in sample.input_ids]
        body = {"model": self.model_name, "prompt": ids, "max_tokens": 1, "temperature": 0.0, **FULL_SOFTMAX}
        if prompt_logprobs:
            body["prompt_logprobs"] = 1
        for attempt in range(3):
            try:
                r = self.client.post("/v1/completions", json=body)
                break
            except httpx.TransportError as e:
                if attempt == 2 or self.server.proc is not None and self.server.proc.poll() is not None:
                    raise ServerError(f"sample {sample.id!r}: vLLM request failed: {type(e).__name__}: {e}") from e
                time.sleep(2.0 * (attempt + 1))
        if r.status_code != 200:
            cause = log_cause(self.server.log_path) if self.server is not None and r.status_code >= 500 else None
            raise ServerError(f"sample {sample.id!r} ({len(ids)} tokens): vLLM answered HTTP {r.status_code}: "
                              + (f"its log ({self.server.log_path}) names {cause}" if cause else r.text[:500]))
        params = r.json().get("kv_transfer_params") or {}
        path = params.get("hidden_states_path")
        if not path:
            raise ServerError(f"sample {sample.id!r}: vLLM returned no kv_transfer_params.hidden_states_path "
                              "(is the extract_hidden_states speculative method active?)")
        data = read_hidden_file(path, self.request_timeout_s, self.server_died)
        hs, tok = data["hidden_states"], data["token_ids"]
        if tok.shape[0] != len(ids) or not torch.equal(tok.long(), torch.as_tensor(ids, dtype=torch.long)):
            raise ServerError(f"sample {sample.id!r}: the hidden states vLLM wrote are for other tokens "
                              f"({tok.shape[0]} tokens, expected {len(ids)})")
        if hs.shape[:2] != (len(ids), len(self.layer_ids)):
            raise ServerError(f"sample {sample.id!r}: hidden states of shape {tuple(hs.shape)}, expected "
                              f"[{len(ids)}, {len(self.layer_ids)}, H]")
        return hs[:, :-1].contiguous(), hs[:, -1].contiguous(), r.json()

    def file_bytes(self, n_tokens: int) -> int:
        return staged_bytes(n_tokens, len(self.layer_ids), self.hidden_size)

    def extract(self, samples: Iterable[Tokenized]) -> Iterator[tuple[Tokenized, torch.Tensor, torch.Tensor]]:
        """`concurrency` requests in flight (and, with a staging budget, no more than its bytes); results in input
        order. A request's file is read and deleted before its result is yielded, so the staging folder holds at most
        the files of the requests in flight."""
        window: deque[tuple[Tokenized, Future, int]] = deque()
        with ThreadPoolExecutor(self.concurrency, thread_name_prefix="extract-vllm") as pool:
            try:
                for s in samples:
                    need = self.file_bytes(len(s)) if self.staging_budget else 0
                    if self.staging_budget and need > self.staging_budget:
                        raise ServerError(f"sample {s.id!r}: its hidden states ({need:,} bytes) exceed the staging "
                                          f"budget ({self.staging_budget:,} bytes)")
                    while window and (len(window) >= self.concurrency or
                                      (self.staging_budget and sum(w[2] for w in window) + need > self.staging_budget)):
                        s0, f0, _ = window.popleft()  # the producer waits: the budget is full
                        yield s0, *f0.result()
                    window.append((s, pool.submit(self.one, s), need))
                    self.peak_staged = max(self.peak_staged, sum(w[2] for w in window))
                while window:
                    s0, f0, _ = window.popleft()
                    yield s0, *f0.result()
            finally:
                for _, f, _ in window:
                    f.cancel()
