"""A reasoning model's thinking apart from its answer (--reasoning-parser qwen3 | deepseek_r1):
the reader gives one split whole or streamed however the text is cut (inside a tag too); a
server with the flag puts the thinking in the message's reasoning_content (and vLLM's newer
name, reasoning), whole and streamed, the answer in content or its tool calls; an output held
to a schema thinks only if it writes <think>."""

from __future__ import annotations

import random

import openai
import pytest

from openai_api.reasoning_parsers import ThinkReader, split
from tests.http.http_util import call
from tests.http.inprocess import served_in_process, with_chat_template
from tests.http.test_engine_errors import error_of
from tests.http.test_tool_calls import WEATHER

ASK = [{"role": "user", "content": "Weather in Paris?"}]

# (parser, reply, its thinking (None: none), its answer)
SPLITS = [
    ("qwen3", "<think>\nHmm.\n</think>\n\nParis is sunny.", "\nHmm.\n", "Paris is sunny."),
    ("qwen3", "Paris is sunny.", None, "Paris is sunny."),  # thinking turned off
    ("qwen3", "  <think>a</think>b", "a", "b"),
    ("qwen3", "<think>cut sho", "cut sho", ""),
    ("qwen3", "<thi", None, "<thi"),
    ("qwen3", "x</think>y", None, "x</think>y"),  # no <think>: all answer
    ("qwen3", "<think></think>", "", ""),
    ("deepseek_r1", "Hmm.\n</think>\n\nParis is sunny.", "Hmm.\n", "Paris is sunny."),
    ("deepseek_r1", "<think>Hmm.</think>Sunny.", "Hmm.", "Sunny."),  # its own <think> dropped
    ("deepseek_r1", "all thinking, cut short", "all thinking, cut short", ""),
    ("deepseek_r1", "a</think>b</think>c", "a", "b</think>c"),  # the first </think> ends it
    ("deepseek_r1", "", "", ""),
    ("deepseek_r1", "plan</think>\n    return x\n", "plan", "    return x\n"),  # indent kept
    ("qwen3", "\n\n  <think>a</think>b", "a", "b"),
    ("qwen3", "\n\n  Paris.", None, "\n\n  Paris."),
]


@pytest.mark.parametrize(("parser", "text", "reasoning", "content"), SPLITS)
def test_a_reply_s_thinking_and_answer(parser, text, reasoning, content):
    assert split(parser, text) == (reasoning, content)


@pytest.mark.parametrize(("parser", "text", "reasoning", "content"), SPLITS)
def test_streamed_in_any_pieces_it_splits_as_whole(parser, text, reasoning, content):
    for seed in range(200):
        rng = random.Random(seed)
        reader, got_reasoning, got_content, at = ThinkReader(parser), "", "", 0
        while at < len(text):
            piece = text[at:at + rng.randint(1, 5)]
            at += len(piece)
            read = reader.feed(piece)
            got_reasoning, got_content = got_reasoning + read.reasoning, got_content + read.content
        last = reader.finish()
        got = (got_reasoning + last.reasoning if reader.thought else None,
               got_content + last.content)
        assert got == (reasoning, content), f"seed {seed}"


def test_a_tag_cut_in_two_is_held_not_sent():
    reader = ThinkReader("deepseek_r1")
    assert reader.feed("Hmm </thi").reasoning == "Hmm "
    read = reader.feed("nk>Sun")
    assert (read.reasoning, read.content) == ("", "Sun")


@pytest.fixture(scope="module")
def thinking_server(tiny_llama_dir):
    """The tiny model served in-process, plain HTTP, with --reasoning-parser deepseek_r1 and
    --tool-call-parser hermes."""
    with (served_in_process(tiny_llama_dir, tool_call_parser="hermes",
                            reasoning_parser="deepseek_r1") as base_url,
          openai.OpenAI(base_url=base_url, api_key="none", max_retries=0) as client):
        yield client, tiny_llama_dir.name


def _whole_and_streamed(client, **ask) -> tuple[object, tuple[str, str, list]]:
    reply = client.chat.completions.create(**ask)
    reasoning, content, calls = "", "", []
    for chunk in client.chat.completions.create(**ask, stream=True):
        delta = chunk.choices[0].delta
        # No empty deltas: what a parser holds back is not sent as "" (vLLM sends nothing).
        assert (delta.model_dump(exclude_none=True) not in ({}, {"content": ""})
                or chunk.choices[0].finish_reason is not None), chunk
        extra = delta.model_extra or {}
        assert extra.get("reasoning_content") == extra.get("reasoning")
        reasoning += extra.get("reasoning_content") or ""
        content += delta.content or ""
        calls += delta.tool_calls or []
    return reply, (reasoning, content, calls)


def test_the_thinking_goes_to_reasoning_content_whole_and_streamed(thinking_server):
    client, model = thinking_server
    # The tiny model's text held to what a reasoning model writes (the template opened the
    # thinking: deepseek_r1's format).
    said = r"I should look it up\.\n</think>\n\nIt is sunny in Paris\."
    ask = {"model": model, "messages": ASK, "max_tokens": 60, "temperature": 0,
           "extra_body": {"structured_outputs": {"regex": said}}}
    reply, streamed = _whole_and_streamed(client, **ask)
    message = reply.choices[0].message
    # Held to a regex, the output thinks only where it writes <think>: this one does not.
    assert (message.model_extra["reasoning_content"], message.content) == (
        None, "I should look it up.\n</think>\n\nIt is sunny in Paris.")
    said = r"<think>I should look it up\.\n</think>\n\nIt is sunny in Paris\."
    ask["extra_body"] = {"structured_outputs": {"regex": said}}
    reply, streamed = _whole_and_streamed(client, **ask)
    message = reply.choices[0].message
    assert message.model_extra["reasoning_content"] == "I should look it up.\n"
    assert message.model_extra["reasoning"] == "I should look it up.\n"
    assert message.content == "It is sunny in Paris."
    assert streamed == ("I should look it up.\n", "It is sunny in Paris.", [])


def test_unconstrained_the_reply_is_thinking_until_it_ends_it(thinking_server):
    """deepseek_r1: the template opened the thinking, so the tiny model's text (which never
    writes </think>) is all thinking, and there is no answer."""
    client, model = thinking_server
    ask = {"model": model, "messages": ASK, "max_tokens": 12, "temperature": 0}
    reply, (reasoning, content, _) = _whole_and_streamed(client, **ask)
    message = reply.choices[0].message
    assert message.content is None and message.model_extra["reasoning_content"]
    assert reasoning == message.model_extra["reasoning_content"] and content == ""
    assert reply.choices[0].finish_reason == "length"


def test_a_call_after_the_thinking_is_read_from_the_answer(thinking_server):
    client, model = thinking_server
    call = r'\{"name": "get_weather", "arguments": \{"city": "Paris", "days": 2\}\}'
    said = rf"<think>A tool knows\.</think>\n<tool_call>{call}</tool_call>"
    ask = {"model": model, "messages": ASK, "tools": [WEATHER], "max_tokens": 80,
           "temperature": 0, "extra_body": {"structured_outputs": {"regex": said}}}
    reply, (reasoning, content, calls) = _whole_and_streamed(client, **ask)
    message = reply.choices[0].message
    assert message.model_extra["reasoning_content"] == "A tool knows."
    assert message.content is None
    [made] = message.tool_calls
    assert (made.function.name, made.function.arguments) == (
        "get_weather", '{"city": "Paris", "days": 2}')
    assert reply.choices[0].finish_reason == "tool_calls"
    assert (reasoning, content) == ("A tool knows.", "")
    assert [c.function.name for c in calls] == ["get_weather"]


def test_a_json_answer_is_all_content(thinking_server):
    client, model = thinking_server
    reply = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=30, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": {
            "type": "object", "properties": {"sunny": {"type": "boolean"}},
            "required": ["sunny"], "additionalProperties": False}}})
    message = reply.choices[0].message
    assert message.model_extra["reasoning_content"] is None
    assert message.content.replace(" ", "") in ('{"sunny":true}', '{"sunny":false}')


# A template that opens the thinking for the model, or closes it when thinking is turned off
# (Qwen3.5's, Qwen3 Thinking-2507's, DeepSeek-V3.1's kind), and writes an assistant's thinking
# sent back as history.
OPENING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def opening_servers(tiny_llama_dir, tmp_path_factory):
    """The tiny model with OPENING_TEMPLATE behind two servers: qwen3's parser and
    deepseek_r1's."""
    model_dir = with_chat_template(tiny_llama_dir, tmp_path_factory.mktemp("opening"),
                                   OPENING_TEMPLATE)
    with (served_in_process(model_dir, reasoning_parser="qwen3") as qwen3,
          served_in_process(model_dir, reasoning_parser="deepseek_r1") as deepseek_r1):
        yield {"qwen3": qwen3, "deepseek_r1": deepseek_r1}, model_dir.name


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_the_reply_starts_where_the_prompt_left_the_thinking(opening_servers, parser):
    """Opened by the template: the reply is thinking (qwen3's too, which would look for its
    own <think>); closed by it (enable_thinking false): all answer (deepseek_r1's too)."""
    urls, model = opening_servers
    with openai.OpenAI(base_url=urls[parser], api_key="none", max_retries=0) as client:
        ask = {"model": model, "messages": ASK, "max_tokens": 8, "temperature": 0}
        reply, (reasoning, content, _) = _whole_and_streamed(client, **ask)
        message = reply.choices[0].message
        assert message.content is None and message.model_extra["reasoning_content"]
        assert (reasoning, content) == (message.model_extra["reasoning_content"], "")
        off = {**ask, "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
        reply, (reasoning, content, _) = _whole_and_streamed(client, **off)
        message = reply.choices[0].message
        assert message.model_extra["reasoning_content"] is None and message.content
        assert (reasoning, content) == ("", message.content)


def test_a_reply_sent_back_as_history_gives_the_template_its_thinking(opening_servers):
    """The openai package's multi-turn pattern: the reply's message (with reasoning_content
    and reasoning) appended to the messages; the template gets the thinking."""
    urls, model = opening_servers
    base = urls["deepseek_r1"].removesuffix("/v1")
    with openai.OpenAI(base_url=urls["deepseek_r1"], api_key="none", max_retries=0) as client:
        reply = client.chat.completions.create(model=model, messages=ASK, max_tokens=4,
                                               temperature=0)
        thinking = reply.choices[0].message.model_extra["reasoning_content"]
        history = [*ASK, reply.choices[0].message, {"role": "user", "content": "And?"}]
        again = client.chat.completions.create(model=model, messages=history, max_tokens=4,
                                               temperature=0)
        assert again.choices[0].finish_reason == "length"
        dumped = reply.choices[0].message.model_dump(exclude_none=True)
        status, tokens = call(f"{base}/tokenize", {"messages": [*ASK, dumped]})
        assert status == 200, tokens
        status, text = call(f"{base}/detokenize", {"tokens": tokens["tokens"]})
        assert f"<think>{thinking}</think>" in text["prompt"]
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(model=model, max_tokens=4, messages=[
                {"role": "user", "content": "Hi", "reasoning_content": "hmm"}])
        assert error_of(raised)["param"] == "messages[0].reasoning_content"


def test_a_continued_message_s_own_tags_say_where_the_reply_starts(opening_servers):
    """continue_final_message on "<think>Let me": the reply goes on thinking (the prompt ends
    inside the thinking, not with <think>); on a message whose thinking is closed, all
    answer."""
    from openai_api.reasoning_parsers import continued_state

    assert continued_state("<think>Let me") == "open"
    assert continued_state("<think>a</think>The answer is") == "closed"
    assert continued_state("Red, green and") is None
    urls, model = opening_servers
    with openai.OpenAI(base_url=urls["qwen3"], api_key="none", max_retries=0) as client:
        for begun, thinking in (("<think>Let me", True), ("<think>ok</think>It is", False)):
            ask = {"model": model, "max_tokens": 8, "temperature": 0,
                   "messages": [*ASK, {"role": "assistant", "content": begun}],
                   "extra_body": {"continue_final_message": True}}
            reply, (reasoning, content, _) = _whole_and_streamed(client, **ask)
            message = reply.choices[0].message
            assert bool(message.model_extra["reasoning_content"]) == thinking, message
            assert (message.content is None) == thinking, message
            assert bool(reasoning) == thinking and bool(content) != thinking
