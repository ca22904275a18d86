"""A hidden-states KV connector for vLLM's `extract_hidden_states` speculative method that works on CPU and GPU.

vLLM 0.32 ships `ExampleHiddenStatesConnector`, which copies a finished request's hidden states out of the cache-only
KV layer on a CUDA stream into pinned memory and writes them from a thread pool. On CPU that fails
("pin_memory=True requires a CUDA or other accelerator backend"). This subclass keeps vLLM's scheduler side and file
protocol (one `<req_id>.safetensors` per request with `hidden_states` [T, n_layers, H] and `token_ids` [T], its path
returned in `kv_transfer_params.hidden_states_path`, a companion `.lock` held exclusively until the file is written),
and replaces the worker-side write:
- KV cache on CPU: gather the rows and write the file synchronously, to a temporary name renamed into place, then
  release the lock. The request is reported finished only after that, so its blocks stay valid during the copy.
- KV cache on a GPU: vLLM's own asynchronous path (stream copy into pinned memory, background write).
Loaded by vLLM with `--kv-transfer-config '{"kv_connector": "EagleHiddenStatesConnector",
"kv_connector_module_path": "eagle3lib.vllm.connector", "kv_role": "kv_producer",
"kv_connector_extra_config": {"shared_storage_path": DIR}}'`. The consumer deletes the files (they pile up otherwise).
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)


class _Done:
    """Stands in for the CUDA event the parent polls in get_finished: the synchronous write is already complete."""

    def query(self) -> bool:
        return True


class EagleHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        if self._kv_cache.is_cuda:
            super()._submit_async_write(pending)
            return
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (torch.arange(self._block_size, dtype=torch.long).reshape(1, -1)
                 + block_ids.reshape(-1, 1) * self._block_size).flatten()
        num_tokens = pending.token_ids.shape[0]
        hidden = extract_from_kv_cache(self._kv_cache, slots, num_tokens).contiguous().clone()
        tensors = {"hidden_states": hidden, "token_ids": pending.token_ids.clone()}
        os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        tmp = f"{pending.filename}.{os.getpid()}.tmp"
        try:
            save_file(tensors, tmp)
            os.replace(tmp, pending.filename)  # a reader never sees a partial file, lock or no lock
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
            if lock_fd is not None:
                os.close(lock_fd)  # releases LOCK_EX: a client waiting on LOCK_SH reads now
        self._req_copy_events[pending.req_id] = _Done()
