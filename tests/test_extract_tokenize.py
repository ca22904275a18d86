# .venv/bin/python -m pytest -q tests/test_extract_tokenize.py
"""Chat rendering + loss masks for extraction: {% generation %} markers, the prefix-rendering fallback for templates
without them (a Qwen3-style template that drops earlier turns' reasoning), and the length / no-assistant policies."""

from __future__ import annotations

import numpy as np
import pytest

from eagle3lib.data.chat_tokens import ChatTokenizer, TokenizeError, TokenizeStats, has_generation_markers
from eagle3lib.data.datasets import Conversation
from eagle3lib.tiny import corpus

# Qwen3's template logic (reasoning rendered only for assistant turns after the last user query, '<|im_end|>\n' after
# every turn, no generation markers), reduced to the roles the corpus uses. MARKED is the same with the assistant
# body wrapped in {% generation %}, so transformers' own assistant mask is the reference for the prefix method.
QWEN3_LIKE = (
    "{%- set ns = namespace(found=false, last_query_index=messages|length - 1) -%}"
    "{%- for m in messages[::-1] -%}{%- set i = (messages|length - 1) - loop.index0 -%}"
    "{%- if m.role == 'user' and not ns.found -%}{%- set ns.found = true -%}{%- set ns.last_query_index = i -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- set r = m.reasoning_content if m.reasoning_content is defined and m.reasoning_content is not none else '' -%}"
    "GEN_OPEN"
    "{%- if loop.index0 > ns.last_query_index -%}"
    "{{- '<think>\\n' + r.strip('\\n') + '\\n</think>\\n\\n' + m.content.lstrip('\\n') -}}"
    "{%- else -%}{{- m.content -}}{%- endif -%}"
    "{{- '<|im_end|>' -}}"
    "GEN_CLOSE"
    "{{- '\\n' -}}"
    "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
    "{%- endif -%}"
)
# A template whose rendering of earlier turns depends on the conversation's length in a way that breaks prefix
# stability (the first user message becomes the "last query" when a conversation ends on a user turn), so the
# prefix render of a later turn is not a prefix of the full render: the fallback must still find the spans.
UNSTABLE = QWEN3_LIKE.replace("and not ns.found", "and ns.last_query_index == messages|length - 1")
TEMPLATES = {
    name: (t.replace("GEN_OPEN", "").replace("GEN_CLOSE", ""),
           t.replace("GEN_OPEN", "{%- generation -%}").replace("GEN_CLOSE", "{%- endgeneration -%}"))
    for name, t in {"qwen3_like": QWEN3_LIKE, "unstable": UNSTABLE}.items()
}


@pytest.fixture(scope="module")
def tok(tiny_verifier):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_verifier)


def _with_template(tok, template):
    import copy

    t = copy.deepcopy(tok)
    t.chat_template = template
    return t


def _convs(n, seed=7):
    return [corpus.sample(seed, i)["messages"] for i in range(n)]


def test_tiny_template_mask_covers_exactly_the_assistant_turns(tok):
    assert has_generation_markers(tok)
    ct = ChatTokenizer(tok, 4096)
    assert ct.mask_method == "generation"
    msgs = next(m for m in _convs(50) if sum(x["role"] == "assistant" for x in m) >= 2)  # multi-turn
    ids, mask = ct.encode(msgs)
    # every assistant turn starts with <think> and ends with <|im_end|>; user/system text is outside
    tokens = [tok.decode([int(t)]) for t in ids]
    starts = [i for i in range(1, len(ids)) if mask[i] and not mask[i - 1]]
    ends = [i for i in range(len(ids)) if mask[i] and (i + 1 == len(ids) or not mask[i + 1])]
    assert len(starts) == sum(x["role"] == "assistant" for x in msgs) == len(ends)
    assert all(tokens[i] == "<think>" for i in starts) and all(tokens[i] == "<|im_end|>" for i in ends)
    assert tokens[starts[0] - 1].endswith("\n") and "<|im_start|>assistant\n" in "".join(tokens[starts[0] - 6 : starts[0]])
    user = next(x["content"] for x in msgs if x["role"] == "user")
    assert user not in "".join(t for t, m in zip(tokens, mask, strict=True) if m)


@pytest.mark.parametrize("template", ["tiny", "qwen3_like", "unstable"])
def test_prefix_fallback_matches_generation_markers(tok, template):
    """Templates without {% generation %} (Qwen3's, Kimi's) get the same mask from prefix rendering."""
    plain = tok if template == "tiny" else _with_template(tok, TEMPLATES[template][0])
    marked = tok if template == "tiny" else _with_template(tok, TEMPLATES[template][1])
    assert has_generation_markers(marked) and (template == "tiny" or not has_generation_markers(plain))
    ref = ChatTokenizer(marked, 4096, mask_method="generation")
    fb = ChatTokenizer(plain, 4096)
    assert fb.mask_method == ("prefix" if template != "tiny" else "generation")
    fb.mask_method = "prefix"
    multi = 0
    for msgs in _convs(120):
        a_ids, a_mask = ref.encode(msgs)
        b_ids, b_mask = fb.encode(msgs)
        assert np.array_equal(a_ids, b_ids)
        assert np.array_equal(a_mask, b_mask), [tok.decode([int(t)]) for t, x, y in zip(a_ids, a_mask, b_mask, strict=True) if x != y]
        multi += sum(m["role"] == "assistant" for m in msgs) > 1
    assert multi >= 5  # multi-turn conversations exercised (qwen3_like drops their earlier reasoning)


def _conv(i, msgs):
    return Conversation(f"c{i}", msgs, source=f"test:{i}")


def test_length_policies_and_skips_are_counted(tok):
    msgs = _convs(40)
    lens = [len(ChatTokenizer(tok, 10**6).encode(m)[0]) for m in msgs]
    limit = sorted(lens)[len(lens) // 2]
    convs = [_conv(i, m) for i, m in enumerate(msgs)]
    convs.append(_conv(100, [{"role": "user", "content": "Hello"}]))  # no assistant turn
    convs.append(_conv(0, msgs[0]))  # duplicate id
    st = TokenizeStats()
    out = list(ChatTokenizer(tok, limit, "truncate")(convs, st))
    longer = sum(n > limit for n in lens)
    assert st.skipped_no_assistant == 1 and st.duplicate_ids == 1 and st.conversations == 42
    assert st.truncated + st.dropped_too_long == longer and st.kept == len(out) == 40 - st.dropped_too_long
    assert all(len(s) <= limit for s in out) and sum(s.truncated for s in out) == st.truncated
    assert st.tokens == sum(len(s) for s in out) and st.loss_tokens == sum(s.loss_tokens for s in out)
    st2 = TokenizeStats()
    out2 = list(ChatTokenizer(tok, limit, "drop")(convs, st2))
    assert st2.dropped_too_long == longer and st2.truncated == 0 and len(out2) == 40 - longer


def test_untokenizable_sample_names_itself_or_is_skipped(tok):
    bad = _conv(5, [{"role": "user", "content": [{"type": "image_url"}]}, {"role": "assistant", "content": "x"}])
    good = _conv(6, _convs(1)[0])
    with pytest.raises(TokenizeError, match=r"test:5.*'c5'.*chat template"):
        list(ChatTokenizer(tok, 2048)([good, bad], TokenizeStats()))
    st = TokenizeStats()
    assert [s.id for s in ChatTokenizer(tok, 2048)([good, bad], st, on_bad_record="skip")] == ["c6"]
    assert st.bad_samples == 1 and "c5" in st.errors[0]


class _SlowTokenizer:
    """The tiny tokenizer seen as a slow one (no offset mapping), like Kimi's tiktoken tokenizer."""

    is_fast = False

    def __init__(self, tok):
        self._tok = tok

    def __getattr__(self, name):
        return getattr(self._tok, name)


def test_prefix_fallback_without_offsets(tok):
    plain, marked = TEMPLATES["qwen3_like"]
    ref = ChatTokenizer(_with_template(tok, marked), 4096)
    slow = ChatTokenizer(_SlowTokenizer(_with_template(tok, plain)), 4096)
    assert slow.mask_method == "prefix"
    for msgs in _convs(40, seed=8):
        a_ids, a_mask = ref.encode(msgs)
        b_ids, b_mask = slow.encode(msgs)
        assert np.array_equal(a_ids, b_ids) and np.array_equal(a_mask, b_mask)


def test_tool_calls_and_schemas_render_and_only_the_calls_are_trained(tok):
    """Agentic data through a template that renders tools (tests/fixtures/tools/chat_template.jinja, Qwen3's tool
    format): the schemas and the tool's result are context, the assistant's call and its answer are trained on."""
    from eagle3lib.data.datasets import load_conversations

    fixtures = __import__("pathlib").Path(__file__).parent / "fixtures" / "tools"
    t = _with_template(tok, (fixtures / "chat_template.jinja").read_text())
    weather = load_conversations(fixtures / "agentic.jsonl")[0]
    ids, mask = ChatTokenizer(t, 4096).encode(weather.messages, weather.tools)
    text, trained = tok.decode(ids), tok.decode(ids[mask])
    assert '"parameters": {"type": "object"' in text and "<tool_response>\n{\"temp_c\": 18" in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>' in trained
    assert "It is 18 degrees" in trained and "temp_c" not in trained and "<tools>" not in trained
    no_tools, _ = ChatTokenizer(t, 4096).encode(weather.messages)
    assert len(no_tools) < len(ids)  # the schemas are in the tokens only when given


@pytest.mark.parametrize("template", ["tiny", "qwen3_like"])
def test_answers_are_trained_on_as_generated(tok, template):
    """vLLM's qwen3 parser leaves the newlines around the reasoning in both fields ("\\nR\\n", "\\n\\nC"). The tiny
    verifier's template adds its own around them, so re-rendering changes the answer the verifier generated; Qwen3's
    strips them and re-renders it exactly. With the generated ids the sample is the rendered prompt + those ids either
    way, loss on every one of them, and the difference is counted."""
    t = tok if template == "tiny" else _with_template(tok, TEMPLATES["qwen3_like"][0])
    prompt = [{"role": "user", "content": "What is the capital of France?"}]
    generated = t.encode("<think>\nThe user asks.\n</think>\n\nParis.<|im_end|>", add_special_tokens=False)
    msgs = [*prompt, {"role": "assistant", "reasoning_content": "\nThe user asks.\n", "content": "\n\nParis."}]
    conv = Conversation("a", msgs, extra={"answer_token_ids": generated})
    stats = TokenizeStats()
    (got,) = list(ChatTokenizer(t, 4096)([conv], stats))
    head = t.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert got.input_ids.tolist() == [*head, *generated] and got.loss_mask.tolist() == [0] * len(head) + [1] * len(generated)
    assert stats.answers_as_generated == 1 and stats.rerendered_differently == (1 if template == "tiny" else 0)
    assert stats.rerendered_examples == (["a"] if template == "tiny" else [])
    (rendered,) = list(ChatTokenizer(t, 4096, answer_tokens="rendered")([conv], TokenizeStats()))
    answer_end = int(np.flatnonzero(rendered.loss_mask)[-1]) + 1  # Qwen3 renders a "\n" after the turn's <|im_end|>
    assert (rendered.input_ids[:answer_end].tolist() == got.input_ids.tolist()) == (template != "tiny")
    with pytest.raises(TokenizeError, match="does not end with an assistant turn"):
        ChatTokenizer(t, 4096).encode_generated(prompt, generated)


def test_answer_as_generated_after_earlier_turns_by_either_mask_method(tok):
    """A second turn's answer after a first answered one: the first is masked where the template renders it (the
    prefix method, used for templates without generation markers such as Kimi's, agrees with the markers' mask), the
    generation prompt is not, the generated ids all are."""
    plain, marked = (_with_template(tok, t) for t in TEMPLATES["qwen3_like"])
    msgs = [{"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "reasoning_content": "Add them.", "content": "4."},
            {"role": "user", "content": "And 3 + 3?"},
            {"role": "assistant", "reasoning_content": "\nAdd again.\n", "content": "\n\n6."}]
    generated = plain.encode("<think>\nAdd again.\n</think>\n\n6.<|im_end|>", add_special_tokens=False)
    conv = Conversation("b", msgs, extra={"answer_token_ids": generated})
    got = {t: list(ChatTokenizer(x, 4096)([conv], TokenizeStats()))[0] for t, x in (("prefix", plain), ("markers", marked))}
    assert got["prefix"].input_ids.tolist() == got["markers"].input_ids.tolist()
    assert got["prefix"].loss_mask.tolist() == got["markers"].loss_mask.tolist()
    head = plain.apply_chat_template(msgs[:3], add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert got["prefix"].input_ids.tolist() == [*head, *generated]
    first = plain.encode("4.<|im_end|>", add_special_tokens=False)  # Qwen3 drops an earlier turn's reasoning
    assert 0 < int(got["prefix"].loss_mask[: len(head)].sum()) == len(first)


def test_samples_are_built_on_the_prompt_the_server_tokenized(tok):
    """The server sends back the prompt's ids (vLLM's prompt_token_ids). Rendered alike here, the sample is the same
    and earlier answers keep their mask; rendered otherwise (a system prompt the server's template flags added, other
    chat_template_kwargs), the server's ids are the sample's, only the last answer in the loss, and it is counted."""
    msgs = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4."},
            {"role": "user", "content": "And 3 + 3?"}, {"role": "assistant", "content": "6."}]
    generated = tok.encode("6.<|im_end|>", add_special_tokens=False)
    here, here_mask = ChatTokenizer(tok, 4096).encode_generated(msgs, generated)
    served = here[: len(here) - len(generated)].tolist()
    stats = TokenizeStats()
    (same,) = list(ChatTokenizer(tok, 4096)([Conversation("a", msgs, extra={
        "answer_token_ids": generated, "prompt_token_ids": served})], stats))
    assert same.input_ids.tolist() == here.tolist() and same.loss_mask.tolist() == here_mask.tolist()
    assert here_mask[: len(served)].any()  # the first answer is in the loss
    assert (stats.prompts_as_served, stats.prompts_rendered_differently) == (1, 0)
    other = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, *msgs[:-1]], add_generation_prompt=True,
                                    tokenize=True, return_dict=True)["input_ids"]
    (built,) = list(ChatTokenizer(tok, 4096)([Conversation("b", msgs, extra={
        "answer_token_ids": generated, "prompt_token_ids": other})], stats))
    assert built.input_ids.tolist() == [*other, *generated]
    assert built.loss_mask.tolist() == [0] * len(other) + [1] * len(generated)
    assert (stats.prompts_as_served, stats.prompts_rendered_differently, stats.prompt_examples) == (1, 1, ["b"])
