"""The Jupyter kernel the runner executes stage notebooks in: on IPC sockets in a private folder instead of localhost
TCP. No port can collide with a vLLM server's or another run's, and ipykernel's "running over TCP without encryption"
warning no longer repeats on the console for every stage."""

from __future__ import annotations

import os

from jupyter_client.manager import KernelManager


def ipc_kernel_manager(socket_dir: str) -> type[KernelManager]:
    """A KernelManager class whose kernels listen on Unix sockets under `socket_dir` (short: sockets have a ~100-byte
    path limit, so a temporary folder, not the run directory)."""

    class IPCKernelManager(KernelManager):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.transport = "ipc"
            self.ip = os.path.join(socket_dir, "kernel")

    return IPCKernelManager
