"""One local verifier server shared by the stages of one `run` that serve the verifier alone with the same settings
(the verifier report, generate, evaluate's base measurement); the runner calls `before` and `after` each stage."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

from eagle3lib.config.profile import Profile


class SharedServerError(RuntimeError):
    """The shared server did not start (the runner reports it as the stage's failure)."""


class SharedServer:
    """One local verifier server for every stage of this invocation that serves the verifier alone with the same
    settings: the verifier report, generate, and evaluate's base measurement (kept up, idle at ~2% of a core, through
    extract and train). Each vLLM start-up saved is a minute or more on CPU. Started before the first of them,
    stopped after the last, behind the guard; used only when at least two of them run."""

    def __init__(self, prof: Profile, run_dir: Path, will_run: list[str], say: Callable[[str], None] = print):
        self.server, self.say = None, say
        self.first = self.last = None
        self.start_s: float | None = None
        users = []
        if "verifier" in will_run and prof.section("verifier_report").serve:
            users.append("verifier")
        if "generate" in will_run:
            users.append("generate")
        ev = prof.section("evaluate")
        if "evaluate" in will_run and ev.vllm and not ev.base_server_url and not ev.server_args:
            users.append("evaluate")  # like-for-like: a local base server would get exactly these settings
        if prof.verifier.server_url or len(users) < 2 or users[0] == "evaluate":
            return
        self.users, self.first, self.last = users, users[0], users[-1]
        self.prof, self.log = prof, run_dir / "vllm-verifier.log"

    def before(self, stage: str) -> None:
        if stage != self.first or self.server is not None:
            return
        from eagle3lib.model.verifier import resolve_model
        from eagle3lib.vllm.server import SHARED_URL_ENV, server_for_verifier

        vcfg = self.prof.verifier
        t0 = time.time()
        self.say(f"starting one verifier server for {', '.join(self.users)} (log: {self.log})")
        try:
            self.server = server_for_verifier(vcfg, resolve_model(vcfg.model), self.log).start()
        except Exception as e:
            raise SharedServerError(f"stage '{stage}' failed: the verifier server did not start: {e}") from None
        os.environ[SHARED_URL_ENV] = self.server.base_url
        self.start_s = round(time.time() - t0, 1)
        self.say(f"verifier server up in {self.start_s:.0f} s at {self.server.base_url}")

    def after(self, stage: str) -> None:
        if stage == self.last:
            self.stop()

    def stop(self) -> None:
        from eagle3lib.vllm.server import SHARED_URL_ENV

        os.environ.pop(SHARED_URL_ENV, None)
        if self.server is not None:
            self.server.stop()
            self.server = None
