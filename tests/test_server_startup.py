# .venv/bin/python -m pytest -q tests/test_server_startup.py
"""vLLM start-up failures named in the user's terms, not by vLLM's last log line: a verifier weights file cut short
and a reasoning parser vLLM does not have are refused before any server starts (they failed ~40 s in); a server killed
by a signal says so (it was reported as "too many open files", the ulimit advice in its log)."""

from __future__ import annotations

import shutil
import threading
import time

import psutil
import pytest

from eagle3lib.__main__ import main


def _run(capsys, tmp_path, *sets: str) -> tuple[int, str]:
    argv = ["run", "--run-dir", str(tmp_path / "run"), "--stages", "generate"]
    code = main([*argv, *[a for s in sets for a in ("--set", s)]])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


def test_what_vllm_would_refuse_at_start_up_is_named_before_any_server(tiny_verifier, tmp_path, capsys):
    code, err = _run(capsys, tmp_path, "verifier.reasoning_parser=none")
    assert code == 2 and "verifier.reasoning_parser: 'none' is not a reasoning parser of the installed vLLM (" in err
    assert "qwen3" in err and "null (no parser) is written without quotes" in err
    torn = shutil.copytree(tiny_verifier, tmp_path / "torn")
    weights = next(torn.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:-1000])  # an interrupted copy
    code, err = _run(capsys, tmp_path, f"verifier.model={torn}")
    assert code == 2 and f"verifier.model: {weights} is TRUNCATED: its header declares" in err, err
    assert not (tmp_path / "run" / "generate").exists()


@pytest.mark.slow
def test_a_server_killed_during_start_up_is_said_to_be_killed(tiny_verifier, tmp_path):
    from eagle3lib.vllm.server import ServerError, VLLMServer

    server = VLLMServer(model=str(tiny_verifier), log_path=tmp_path / "vllm.log", dtype="float32", kv_cache_gib=1)

    def kill_the_server() -> None:  # the out-of-memory killer's way: SIGKILL to the server, not to its guard
        while server.proc is None or not psutil.Process(server.proc.pid).children():
            time.sleep(0.2)
        time.sleep(2)
        psutil.Process(server.proc.pid).children()[0].kill()

    threading.Thread(target=kill_the_server, daemon=True).start()
    with pytest.raises(ServerError, match=r"vLLM server was killed by SIGKILL during start-up \(the out-of-memory "):
        server.start()
