"""The two vLLM servers an evaluation compares (the evaluate section decides which are given and which started): "spec" (the drafter as EAGLE-3 speculator) and "base" (the verifier
alone), each a running endpoint or a local server started in the background."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from eagle3lib.config.evaluate import EvaluateConfig
from eagle3lib.config.verifier import VerifierConfig
from eagle3lib.vllm.endpoint import ServerError, verifier_endpoint
from eagle3lib.vllm.measure import PassSettings
from eagle3lib.vllm.server import shared_verifier_url
from eagle3lib.vllm.serving import drafter_server


def pass_settings(cfg: EvaluateConfig, modes: list[str] | None = None) -> PassSettings:
    """The evaluate section as the vLLM layer's measurement settings (`modes`: these instead of evaluate.modes)."""
    return PassSettings(modes=tuple(modes if modes is not None else cfg.modes), temperature=cfg.temperature,
                        max_tokens=cfg.max_tokens, concurrency=cfg.concurrency, warmup_requests=cfg.warmup_requests,
                        request_timeout_s=cfg.request_timeout_s, connect_timeout_s=cfg.connect_timeout_s,
                        progress=cfg.progress, context_buckets=tuple(cfg.context_buckets), per_prompt=cfg.per_prompt)


class Servers:
    """The two vLLM servers of the measurement: "spec" (the drafter as EAGLE-3 speculator) and "base" (the verifier
    alone). A given URL is checked at once (an unreachable server fails before minutes of library work); a local server
    is started in a background thread, so its start-up (a minute or more on CPU) overlaps the library phase."""

    def __init__(self, cfg: EvaluateConfig, vcfg: VerifierConfig, model_path: str, out_dir: Path):
        self.cfg, self.vcfg, self.model_path, self.out_dir = cfg, vcfg, model_path, out_dir
        self.endpoints: dict[str, Any] = {}
        self.local: dict[str, Any] = {}
        self.threads: dict[str, threading.Thread] = {}
        self.errors: dict[str, BaseException] = {}
        self.start_seconds: dict[str, float] = {}  # launch to /health OK, local servers

    def url(self, which: str) -> tuple[str | None, str]:
        """(URL of a running server or None, the config key that names it). The base measurement also uses the
        runner's shared verifier server when it runs with exactly the settings a local one would get here (no
        evaluate.server_args): one start-up fewer, and still like-for-like with the spec server."""
        if which == "spec":
            return self.cfg.spec_server_url, "evaluate.spec_server_url"
        if self.cfg.base_server_url:
            return self.cfg.base_server_url, "evaluate.base_server_url"
        if not self.vcfg.server_url and not self.cfg.server_args and shared_verifier_url():
            return shared_verifier_url(), "the runner's shared verifier server"
        return (self.vcfg.server_urls or [None])[0], "verifier.server_url"

    def key_url(self, which: str) -> str | None:
        """What a measurement phase is keyed by: the URL of a given server, "shared" for the runner's (its port
        changes from run to run), None for a local one."""
        url, key = self.url(which)
        return "shared" if key == "the runner's shared verifier server" else url

    def open(self, which: str, ckpt: Path | None, k: int | None, background: bool) -> None:
        """The server `which`: a given one checked now, else a local one (`ckpt` drafting k tokens per round, None:
        the verifier alone) started in a background thread (`background`) or here."""
        url, key = self.url(which)
        if url:
            try:
                self.endpoints[which] = verifier_endpoint(self.vcfg, self.cfg.connect_timeout_s, base_url=url)
            except ServerError as e:
                raise ServerError(f"{key}: {e}") from None
            return
        server = drafter_server(self.vcfg, self.model_path, self.out_dir / f"vllm_{which}.log", ckpt, k,
                                server_args=self.cfg.server_args)
        self.local[which] = server

        def start() -> None:
            t0 = time.time()
            try:
                server.start()
                self.start_seconds[which] = round(time.time() - t0, 1)
            except BaseException as e:  # re-raised by get()
                self.errors[which] = e

        t = threading.Thread(target=start, name=f"vllm-{which}-start", daemon=True)
        self.threads[which] = t
        t.start()
        if not background:
            t.join()

    def get(self, which: str) -> Any:
        if which in self.threads:
            self.threads.pop(which).join()
            if which in self.errors:
                raise self.errors.pop(which)
            self.endpoints[which] = self.local[which].endpoint()
        return self.endpoints[which]

    def close(self, which: str) -> None:
        server = self.local.pop(which, None)
        if server is not None:
            server.stop()
            t = self.threads.pop(which, None)
            if t is not None:  # still starting: the process may appear only now
                t.join(timeout=60)
                server.stop()
        self.endpoints.pop(which, None)

    def close_all(self) -> None:
        for which in list(self.local):
            self.close(which)
