# .venv/bin/python -m pytest -q tests/test_extract.py
"""The extract stage with the HF backend on the tiny verifier: the layer-index convention against HF
`output_hidden_states`, batching/padding invariance, the stage end to end (manifest, reader, resume), the disk check,
bad inputs, and the notebook."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eagle3lib.config.extract import ExtractConfig
from eagle3lib.config.verifier import VerifierConfig
from eagle3lib.core.manifest import read_manifest
from eagle3lib.data.chat_tokens import ChatTokenizer, TokenizeStats
from eagle3lib.data.hidden_store import HiddenStateReader
from eagle3lib.extraction.engine import ExtractError, InsufficientDiskError, extract
from eagle3lib.model.hf_extract import HFExtractor
from eagle3lib.tiny import corpus

FIGURES = ["verifier", "aux_layer_ids", "num_layers", "hidden_size", "vocab_size", "dtype", "samples", "tokens",
           "loss_tokens", "bytes", "bytes_per_token", "wall_s", "samples_per_s", "tokens_per_s", "backend",
           "skipped_no_assistant", "truncated", "dropped_too_long", "shards"]


@pytest.fixture(scope="module")
def tok(tiny_verifier):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_verifier)


@pytest.fixture(scope="module")
def model32(tiny_verifier):
    from eagle3lib.model.verifier import load_hf_model

    return load_hf_model(str(tiny_verifier), dtype="float32")


def _tokenized(tok, n, seed=11, max_sample_tokens=2048):
    from eagle3lib.data.datasets import Conversation

    convs = [Conversation(f"c{i}", corpus.sample(seed, i)["messages"]) for i in range(n)]
    return list(ChatTokenizer(tok, max_sample_tokens)(convs, TokenizeStats()))


def _write_generate(run: Path, n: int, seed: int = 21) -> list[str]:
    """RUN/generate/shard-00000.jsonl in the generate stage's record format; returns the ids with status ok."""
    gen = run / "generate"
    gen.mkdir(parents=True, exist_ok=True)
    ok, lines = [], []
    for i in range(n):
        s = corpus.sample(seed, i)
        status = "failed" if i % 7 == 3 else "ok"
        msgs = s["messages"] if status == "ok" else [m for m in s["messages"] if m["role"] != "assistant"]
        lines.append(json.dumps({"id": f"g{i:03d}", "category": s.get("category"), "status": status, "messages": msgs}))
        if status == "ok":
            ok.append(f"g{i:03d}")
    (gen / "shard-00000.jsonl").write_text("\n".join(lines) + "\n")
    return ok


# ------------------------------------------------------------------------------------------- index convention


def test_layer_index_convention_against_hf_output_hidden_states(tok, model32):
    """Id k = HF hidden_states[k] = input of decoder layer k; final = last layer's output BEFORE the norm.
    In transformers 5.19 hidden_states[L] is post-norm (capture_outputs ties it to last_hidden_state)."""
    L = model32.config.num_hidden_layers
    samples = _tokenized(tok, 3)
    ids = torch.from_numpy(samples[0].input_ids.astype("int64"))[None]
    with torch.no_grad():
        out = model32(input_ids=ids, output_hidden_states=True)
    hs = out.hidden_states
    assert len(hs) == L + 1
    aux_ids = [0, 2, 4, 5, L - 1]  # edges included; the store keeps 3, the capture takes any
    ex = HFExtractor("", aux_ids, model=model32, device="cpu")
    (aux, final), = ex.forward([samples[0]])
    ex.close()
    for j, k in enumerate(aux_ids):
        torch.testing.assert_close(aux[:, j], hs[k][0], rtol=1e-5, atol=1e-5)
    norm = model32.model.norm
    with torch.no_grad():
        # hidden_states[L] is the normed state in transformers 5.x, so it is NOT the final hidden state we store ...
        torch.testing.assert_close(norm(final), hs[L][0], rtol=1e-5, atol=1e-5)
        assert (final - hs[L][0]).abs().max() > 0.1
        # ... and the training target lm_head(norm(final)) is exactly the verifier's logits
        torch.testing.assert_close(model32.lm_head(norm(final)), out.logits[0], rtol=1e-4, atol=1e-4)
        # final is the output of the last decoder layer: the residual stream after layer L-1
        assert not torch.allclose(final, hs[L - 1][0])


def test_hooks_capture_only_requested_layers_and_reject_bad_ids(model32):
    def n_hooks():  # transformers 5.x keeps its own output-capturing hooks on the layers: count ours on top
        return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model32.model.layers)

    before = n_hooks()
    ex = HFExtractor("", [2, 4, 5], model=model32, device="cpu")
    assert n_hooks() == before + 4  # 3 pre-hooks + 1 hook on the last layer: no state of the other layers is kept
    ex.close()
    assert n_hooks() == before
    with pytest.raises(ValueError, match=r"\[8\] out of range .* 8 decoder layers"):
        HFExtractor("", [2, 4, 8], model=model32, device="cpu")


def test_padding_and_batching_do_not_change_the_states(tok, model32):
    samples = _tokenized(tok, 6)
    assert len({len(s) for s in samples}) > 3
    one = list(HFExtractor("", [2, 4, 5], model=model32, device="cpu", batch_tokens=1).extract(samples))
    ex = HFExtractor("", [2, 4, 5], model=model32, device="cpu", batch_tokens=10**6)
    padded = list(ex.extract(samples, window=4))
    ex.close()
    assert [s.id for s, _, _ in padded] == [s.id for s in samples]  # input order kept
    for (s1, a1, f1), (s2, a2, f2) in zip(one, padded, strict=True):
        assert s1.id == s2.id and a1.shape == (len(s1), 3, model32.config.hidden_size)
        torch.testing.assert_close(a1, a2, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(f1, f2, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------------------- the stage


def _cfg(**kw):
    base = dict(source="generate", backend="hf", samples_per_shard=4, max_sample_tokens=2048, progress=False, disk_margin_gib=0.0)
    return ExtractConfig(**{**base, **kw})


def test_stage_end_to_end_manifest_reader_and_resume(tmp_path, tok, tiny_verifier):
    ok_ids = _write_generate(tmp_path, 20)
    vcfg = VerifierConfig(model="builtin:tiny")
    out = tmp_path / "extract"
    res = extract(_cfg(), vcfg, out, tmp_path / "generate")
    m = read_manifest(out)
    assert m["status"] == "complete"
    fig = m["figures"]
    assert [k for k in FIGURES if k not in fig] == []
    assert fig["samples"] == len(ok_ids) and fig["backend"] == "hf" and fig["aux_layer_ids"] == [2, 4, 5]
    assert fig["num_layers"] == 8 and fig["hidden_size"] == 192 and fig["dtype"] == "bfloat16"
    assert fig["shards"] == -(-len(ok_ids) // 4) and fig["skipped_no_assistant"] == 0
    r = HiddenStateReader(out)
    assert sorted(r.ids) == sorted(ok_ids) and sum(r.lengths) == fig["tokens"]
    assert fig["bytes"] == sum(e["bytes"] for e in r.entries) and fig["loss_tokens"] == sum(int(r[i].loss_mask.sum()) for i in range(len(r)))
    assert fig["bytes_per_token"] == pytest.approx(fig["bytes"] / fig["tokens"], rel=1e-3)
    assert r.meta["verifier"] == "builtin:tiny" and r.meta["vocab_size"] == fig["vocab_size"]
    # the stored tokens and mask are the chat template's; the states those of a direct bf16 HF run
    sample = r[3]
    conv = next(json.loads(x) for x in (tmp_path / "generate" / "shard-00000.jsonl").read_text().splitlines() if json.loads(x)["id"] == sample.sample_id)
    ids, mask = ChatTokenizer(tok, 2048).encode(conv["messages"])
    assert sample.input_ids.tolist() == ids.tolist() and sample.loss_mask.tolist() == mask.tolist()
    assert sample.aux_hidden.dtype == torch.bfloat16 and sample.aux_hidden.shape == (len(ids), 3, 192)
    assert res["figures"]["tokens_this_run"] == fig["tokens"]

    # resume: lose the last shard (as if killed before it was written), re-run: only its samples are extracted again
    last = r.entries[-1]
    (out / "shards" / last["shard"]).unlink()
    idx = (out / "index.jsonl").read_text().splitlines()
    (out / "index.jsonl").write_text("\n".join(idx[:-1]) + "\n")
    fig2 = extract(_cfg(), vcfg, out, tmp_path / "generate")["figures"]
    assert fig2["samples_this_run"] == len(last["ids"]) and fig2["resumed_samples"] == len(ok_ids) - len(last["ids"])
    r2 = HiddenStateReader(out)
    assert sorted(r2.ids) == sorted(ok_ids) and len(set(r2.ids)) == len(r2.ids)
    assert torch.equal(r2[r2.ids.index(last["ids"][0])].final_hidden, r[r.ids.index(last["ids"][0])].final_hidden)
    fig3 = extract(_cfg(), vcfg, out, tmp_path / "generate")["figures"]
    assert fig3["samples_this_run"] == 0 and fig3["samples"] == len(ok_ids)
    assert fig3["tokens_per_s"] == fig2["tokens_per_s"] > 0  # a no-op re-run keeps the measured throughput
    assert fig["num_gpus"] == 1 and fig["setup_s"] >= 0 and fig["wall_s"] >= fig["setup_s"]
    # a different storage dtype in the same folder is refused, naming the mismatch
    with pytest.raises(ValueError, match="dtype"):
        extract(_cfg(dtype="float8_e4m3fn"), vcfg, out, tmp_path / "generate")


def test_truncation_and_fp8_in_the_stage(tmp_path, tiny_verifier):
    _write_generate(tmp_path, 8)
    out = tmp_path / "extract"
    fig = extract(_cfg(max_sample_tokens=40, dtype="float8_e4m3fn"), VerifierConfig(model="builtin:tiny"), out,
                           tmp_path / "generate")["figures"]
    r = HiddenStateReader(out)
    assert fig["truncated"] + fig["dropped_too_long"] > 0 and max(r.lengths) <= 40
    assert fig["dtype"] == "float8_e4m3fn" and r[0].aux_hidden.dtype == torch.bfloat16
    assert fig["bytes_per_token"] < 0.6 * (4 * 192 * 2)


def test_disk_check_refuses_with_the_numbers(tmp_path, tiny_verifier, capsys):
    _write_generate(tmp_path, 6)
    with pytest.raises(InsufficientDiskError, match=r"not enough disk .* GiB free"):
        extract(_cfg(disk_margin_gib=1e9), VerifierConfig(model="builtin:tiny"), tmp_path / "x", tmp_path / "generate")
    assert "disk estimate:" in capsys.readouterr().err
    assert not list((tmp_path / "x" / "shards").glob("*.safetensors"))


def test_bad_inputs_are_clear_errors(tmp_path, tiny_verifier):
    v = VerifierConfig(model="builtin:tiny")
    with pytest.raises(ExtractError, match=r"aux_layer_ids: \[9\] out of range .* 8 layers"):
        extract(_cfg(), VerifierConfig(model="builtin:tiny", aux_layer_ids=[2, 4, 9]), tmp_path / "a", tmp_path)
    with pytest.raises(ExtractError, match="verifier.model: cannot load"):
        extract(_cfg(), VerifierConfig(model=str(tmp_path / "no-such-model")), tmp_path / "b", tmp_path)
    with pytest.raises(ExtractError, match="no generate output"):
        extract(_cfg(), v, tmp_path / "c", tmp_path / "generate")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ExtractError, match=f"no conversations in {empty}"):
        extract(_cfg(source=str(empty)), v, tmp_path / "d")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Hi {i}"}]}) + "\n" for i in range(3)))
    with pytest.raises(ExtractError, match=f"no sample of {prompts} is usable: 3 conversations, 3 without assistant tokens"):
        extract(_cfg(source=str(prompts)), v, tmp_path / "e")  # prompts only
    bad = tmp_path / "bad.jsonl"
    good = corpus.sample(3, 0)["messages"]
    bad.write_text(json.dumps({"messages": good}) + "\n"
                   + json.dumps({"messages": [{"role": "user", "content": [{"type": "image_url"}]}, good[-1]]}) + "\n")
    # refused where it is read (an image part: the verifier reads text), before any sample is tokenized
    with pytest.raises(ValueError, match=rf"{bad}:2: messages\[0\]\.content\[0\] is a part of type 'image_url'"):
        extract(_cfg(source=str(bad)), v, tmp_path / "f")
    fig = extract(_cfg(source=str(bad), on_bad_record="skip"), v, tmp_path / "g")["figures"]
    assert fig["records_dropped"] == {"bad record (bad_content)": 1} and fig["samples"] == 1


@pytest.mark.slow
def test_notebook_runs_headless(tmp_path, tiny_verifier):
    """The notebook's wiring: papermill with a prefill-only dataset source and 2 torchrun ranks; the manifest is what the
    library wrote."""
    import papermill as pm

    from eagle3lib.core.paths import NOTEBOOKS_DIR

    data = tmp_path / "convs.jsonl"
    corpus.write_conversations(data, 6, 4, "n")
    run = tmp_path / "run"
    pm.execute_notebook(str(NOTEBOOKS_DIR / "02_extract.ipynb"), str(tmp_path / "out.ipynb"), kernel_name="python3",
                        parameters={"profile": "tiny", "run_dir": str(run),
                                    "overrides": {"extract.source": str(data), "extract.progress": False,
                                                  "extract.nproc_per_node": 2}},
                        progress_bar=False, cwd=str(tmp_path))
    m = read_manifest(run / "extract")
    assert m["status"] == "complete" and m["figures"]["samples"] == 6 and m["params"]["extract"]["source"] == str(data)
    # two torchrun ranks: the notebook shows a row per rank
    out = json.loads((tmp_path / "out.ipynb").read_text())
    shown = "".join("".join(o.get("data", {}).get("text/html", "")) for c in out["cells"] for o in c.get("outputs", []))
    assert m["figures"]["world_size"] == 2 and "<th>rank</th>" in shown and "tokens_per_s" in shown


def test_truncated_answers_are_kept_as_generated_and_counted(tmp_path, tok, tiny_verifier, capsys):
    """An answer cut at generate.max_tokens is the verifier's own tokens: kept by default as the ids vLLM generated (no
    end-of-turn token after them); without those ids, or with extract.truncated_answers: drop, it is dropped. The log,
    the manifest and the report count both, by reason."""
    from eagle3lib.reports.extract import records_table

    gen = tmp_path / "generate"
    gen.mkdir()
    lines, cut = [], {}
    for i, status in enumerate(["truncated", "truncated", "truncated", "empty", "ok", "ok"]):
        msgs = corpus.sample(21, i)["messages"]
        rec = {"id": f"g{i}", "status": status, "messages": msgs}
        if status == "truncated" and i < 2:
            ids = tok.encode(msgs[-1]["content"], add_special_tokens=False)[:9]
            cut[f"g{i}"] = rec["answer_token_ids"] = ids + ids[-3:] * 12 if i == 1 else ids  # g1 loops to its end
        lines.append(json.dumps(rec))
    (gen / "shard-00000.jsonl").write_text("\n".join(lines) + "\n")
    v = VerifierConfig(model="builtin:tiny")
    fig = extract(_cfg(), v, tmp_path / "extract", gen)["figures"]
    assert fig["records_kept"] == {"truncated": 2, "ok": 2}
    assert fig["records_dropped"] == {"truncated, without the generated token ids": 1, "empty answer": 1}
    assert "generate records kept: 2 truncated, 2 ok; dropped: 1 truncated, without" in capsys.readouterr().err
    r = HiddenStateReader(tmp_path / "extract")
    for sid, ids in cut.items():
        s = r[r.ids.index(sid)]
        assert s.input_ids.tolist()[-len(ids):] == ids and s.loss_mask[-len(ids):].all()  # no end-of-turn after them
    assert sorted(records_table(fig).rows()) == [("dropped", "empty answer", 1),
                                                 ("dropped", "truncated, without the generated token ids", 1),
                                                 ("kept", "ok", 2), ("kept", "truncated", 2)]
    assert fig["looping_answers"] == 1 and fig["loop_tokens_trimmed"] == 0
    fig = extract(_cfg(looping_answers="trim"), v, tmp_path / "extract-trim", gen)["figures"]
    assert fig["looping_answers"] == 1 and fig["loop_tokens_trimmed"] == 33  # 13 periods of 3 (its first in ids): 2 kept
    fig = extract(_cfg(truncated_answers="drop"), v, tmp_path / "extract-drop", gen)["figures"]
    assert fig["records_kept"] == {"ok": 2} and fig["samples"] == 2
    assert fig["records_dropped"] == {"truncated (extract.truncated_answers: drop)": 3, "empty answer": 1}
    # a folder answered for more prompts than its latest generate run selected (max_samples lowered since): only the
    # selected ones are this run's data, the others counted
    (gen / "prompt_ids.json").write_text(json.dumps([f"g{i}" for i in range(5)]))
    fig = extract(_cfg(), v, tmp_path / "extract-selected", gen)["figures"]
    assert fig["records_kept"] == {"truncated": 2, "ok": 1} and fig["samples"] == 3
    assert fig["records_dropped"]["not among the generate run's prompts (generate.max_samples lowered after it was "
                                  "answered)"] == 1
