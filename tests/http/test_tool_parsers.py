"""tool_choice "auto" with --tool-call-parser: calls read out of the model's text (hermes'
<tool_call> blocks, Llama 3's JSON), the same whether the text comes whole or in any pieces
(seeded random cuts: the seed is printed), and served end to end: the tiny model's output held
to a call's text by a regex, read back as tool_calls, whole and streamed."""

from __future__ import annotations

import json
import random

import openai
import pytest

from openai_api.schemas import ChatCompletionRequest
from openai_api.to_engine import chat_call
from openai_api.tool_parsers import parse, reader
from tests.http.inprocess import served_in_process
from tests.http.test_tool_calls import ASK, WEATHER, streamed_calls

CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}'
HERMES_CASES = [
    (f"Let me look.<tool_call>{CALL}</tool_call>", "Let me look.", [("get_weather", 2)]),
    (f"<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n"
     '{"name": "get_time", "arguments": {}}\n</tool_call>\n', "",
     [("get_weather", 2), ("get_time", 0)]),
    ("<tool_call>{not json}</tool_call> after", "<tool_call>{not json}</tool_call> after", []),
    (f"<tool_call>{CALL}", "", [("get_weather", 2)]),  # unclosed at the end: still a call
    ("<tool_call>{\"name\": \"f\", \"argu", "<tool_call>{\"name\": \"f\", \"argu", []),
    ("a < b, and <tool_ is not a tag", "a < b, and <tool_ is not a tag", []),
    ("no calls at all \n", "no calls at all \n", []),
    # Text after a call keeps its own whitespace; before a call, and at the end, it is not
    # content (cuts after each whitespace once read the stream's apart from the whole's).
    (f"\n<tool_call>{CALL}</tool_call>Line one.\n\nLine two.\n    x = 1\n",
     "Line one.\n\nLine two.\n    x = 1", [("get_weather", 2)]),
    (f"Hi. <tool_call>{CALL}</tool_ca", "Hi.", [("get_weather", 2)]),  # cut in its END
    # Not calls: NaN is not JSON; a lone surrogate no UTF-8 reply can carry.
    ('<tool_call>{"name": "f", "arguments": {"d": NaN}}</tool_call>',
     '<tool_call>{"name": "f", "arguments": {"d": NaN}}</tool_call>', []),
    ('<tool_call>{"name": "\\ud800", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "\\ud800", "arguments": {}}</tool_call>', []),
]
LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}', "",
     [("get_weather", 2)]),
    (' {"name": "f", "parameters": {}}; {"name": "g", "parameters": {"x": 1}}', "",
     [("f", 0), ("g", 1)]),
    ('{"not": "a call"}', '{"not": "a call"}', []),
    ("Paris is sunny {today}", "Paris is sunny {today}", []),
]

MISTRAL_CASES = [
    ('Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]',
     "Sure.", [("get_weather", 2)]),  # v3's array
    ('[TOOL_CALLS] [{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"x": 1}}]',
     "", [("f", 0), ("g", 1)]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}[TOOL_CALLS]get_time[ARGS]{}',
     "", [("get_weather", 2), ("get_time", 0)]),  # v11's
    ('[TOOL_CALLS]f[CALL_ID]a1b2c3d4e[ARGS]{"x": 1}', "", [("f", 1)]),
    ("no calls [TOOL_CALLS] nope", "no calls [TOOL_CALLS] nope", []),
    ("[TOOL_CALLS][]", "[TOOL_CALLS][]", []),
    ('[TOOL_CALLS]f[ARGS]{"x": NaN}', '[TOOL_CALLS]f[ARGS]{"x": NaN}', []),
    ("a [TOOL_ is not the tag", "a [TOOL_ is not the tag", []),
    ('[TOOL_CALLS]f[ARGS]{"x": "a[TOOL_CALLS]b"}', "", [("f", 1)]),  # a tag in a string
    ("[TOOL_CALLS]some prose f[ARGS]{}", "[TOOL_CALLS]some prose f[ARGS]{}", []),  # no name
    ("plain text\n", "plain text\n", []),
]
PYTHONIC_CASES = [
    ('[get_weather(city="Paris", days=2), get_time(zone="UTC")]', "",
     [("get_weather", 2), ("get_time", 1)]),
    (" [f()]", "", [("f", 0)]),
    ("[f(x={1, 2})]", "[f(x={1, 2})]", []),  # a set: no JSON form
    ("[f(x=float('nan'))]", "[f(x=float('nan'))]", []),  # not a literal
    ("[f(1)]", "[f(1)]", []),  # positional
    ('[os.system(cmd="ls")]', '[os.system(cmd="ls")]', []),
    ("Hello [f()]", "Hello [f()]", []),
    ("[1, 2]", "[1, 2]", []),
    ("[" * 200 + "]" * 200, "[" * 200 + "]" * 200, []),  # nested past the parser's bound
    ('[f(x="' + "(" * 70 + '")]', "", [("f", 1)]),  # brackets in a string: not nesting
    ("[f(x={1: 2})]", "[f(x={1: 2})]", []),  # a key JSON would make "1"
    ("[f(x={True: 1, 'true': 2})]", "[f(x={True: 1, 'true': 2})]", []),
    ("[f(x=1, x=2)]", "[f(x=1, x=2)]", []),  # a keyword twice
]


def summary(content: str, calls: list[dict]) -> tuple[str, list[tuple[str, int]]]:
    """The content and each call's name and number of arguments (the ids are new each time)."""
    return content, [(c["function"]["name"], len(json.loads(c["function"]["arguments"])))
                     for c in calls]


@pytest.mark.parametrize(("name", "text", "content", "calls"),
                         [("hermes", *case) for case in HERMES_CASES]
                         + [("llama3_json", *case) for case in LLAMA_CASES]
                         + [("mistral", *case) for case in MISTRAL_CASES]
                         + [("pythonic", *case) for case in PYTHONIC_CASES])
def test_a_reply_s_calls_are_read_whole_and_in_any_pieces(name, text, content, calls):
    whole = parse(name, text)
    assert summary(whole.content, whole.calls) == (content, calls)
    assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-")
               for c in whole.calls)
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rng = random.Random(seed)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        read, got_content, got_calls = reader(name), "", []
        for piece in pieces:
            out = read.feed(piece)
            got_content += out.content
            got_calls += out.calls
        last = read.finish()
        assert summary(got_content + last.content, got_calls + last.calls) == (content, calls)


def test_text_that_may_start_a_call_is_held_back_until_it_cannot():
    read = reader("hermes")
    assert read.feed("Sure <tool").content == "Sure"  # (its space too: a call may follow)
    assert read.feed("box>").content == " <toolbox>"


def test_a_call_s_arguments_are_the_model_s_own_text():
    """Not re-encoded: the numbers as written, a "\\ud800" escape as text (decoded, it made
    the whole reply a 500: no UTF-8 carries it)."""
    [call] = parse("hermes", '<tool_call>{"name": "f", "arguments": {"x": 1.50, '
                             '"s": "\\ud800", "n": 1e999}}</tool_call>').calls
    assert call["function"]["arguments"] == '{"x": 1.50, "s": "\\ud800", "n": 1e999}'


def assert_one_weather_call(reply, chunks, content: str | None) -> None:
    """The reply, whole and streamed, is `content` and one get_weather call for Paris."""
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == content
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    calls, finishes = streamed_calls(chunks)
    assert finishes == ["tool_calls"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "Paris", "days": 2})]


@pytest.fixture(scope="module")
def hermes_server(tiny_llama_dir):
    """The tiny model served in-process, plain HTTP, with --tool-call-parser hermes."""
    with served_in_process(tiny_llama_dir, tool_call_parser="hermes") as base_url:
        yield base_url, tiny_llama_dir.name


def test_auto_reads_the_model_s_calls_whole_and_streamed(hermes_server):
    base_url, model = hermes_server
    # The model's text held to a sentence and a call in hermes' format (the tiny random
    # model writes no calls of its own): what a Qwen or Hermes model writes.
    call_text = r'\{"name": "get_weather", "arguments": \{"city": "Paris", "days": 2\}\}'
    said = rf"Checking\. <tool_call>{call_text}</tool_call>"
    ask = {"model": model, "messages": ASK, "tools": [WEATHER], "max_tokens": 80,
           "temperature": 0, "extra_body": {"structured_outputs": {"regex": said}}}
    with openai.OpenAI(base_url=base_url, api_key="none", max_retries=0) as client:
        reply = client.chat.completions.create(**ask)
        chunks = list(client.chat.completions.create(**ask, stream=True))
        plain = client.chat.completions.create(**{**ask, "extra_body": {"structured_outputs": {
            "regex": r"No call needed, it is sunny\."}}})
        two = client.chat.completions.create(**{**ask, "parallel_tool_calls": False,
                                                 "extra_body": {"structured_outputs": {
                                                     "regex": f"(<tool_call>{call_text}"
                                                              f"</tool_call>){{2}}"}}})
    # (the space before a call is not content)
    assert_one_weather_call(reply, chunks, content="Checking.")
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Checking."
    assert [c.function.name for c in two.choices[0].message.tool_calls] == ["get_weather"]
    assert plain.choices[0].message.content == "No call needed, it is sunny."
    assert plain.choices[0].message.tool_calls is None
    assert plain.choices[0].finish_reason == "stop"



@pytest.mark.parametrize(("parser", "tools", "asked", "sent"), [
    ("hermes", [WEATHER], None, False),  # <tool_call> may be a special token: kept in the text
    ("hermes", [WEATHER], True, True),  # the client's own choice stands
    ("mistral", [WEATHER], None, False),  # [TOOL_CALLS] is a special token
    ("hermes", None, None, None),  # no tools: no calls to read
    ("llama3_json", [WEATHER], None, None),  # its calls are plain JSON
    (None, [WEATHER], None, None),
])
def test_parsers_whose_tags_may_be_special_keep_special_tokens(parser, tools, asked, sent):
    body = {"messages": ASK, "max_tokens": 8}
    if tools is not None:
        body["tools"] = tools
        body["tool_choice"] = "auto" if parser else "none"
    if asked is not None:
        body["skip_special_tokens"] = asked
    call = chat_call(ChatCompletionRequest.model_validate(body), "r", tool_call_parser=parser)
    sampling = call.requests[0].sampling
    assert (sampling.skip_special_tokens if sampling.HasField("skip_special_tokens")
            else None) == sent


CALL_TEXTS = {  # the model's output held to a call in each format (the tiny model writes none)
    "mistral": r'Checking\. \[TOOL_CALLS\]get_weather\[ARGS\]\{"city": "Paris", "days": 2\}',
    "pythonic": r'\[get_weather\(city="Paris", days=2\)\]',
}


@pytest.fixture(scope="module", params=sorted(CALL_TEXTS))
def parser_server(request, tiny_llama_dir):
    with served_in_process(tiny_llama_dir, tool_call_parser=request.param) as base_url:
        yield request.param, base_url, tiny_llama_dir.name


def test_mistral_and_pythonic_calls_are_read_whole_and_streamed(parser_server):
    parser, base_url, model = parser_server
    ask = {"model": model, "messages": ASK, "tools": [WEATHER], "max_tokens": 60,
           "temperature": 0, "extra_body": {"structured_outputs": {"regex": CALL_TEXTS[parser]}}}
    with openai.OpenAI(base_url=base_url, api_key="none", max_retries=0) as client:
        reply = client.chat.completions.create(**ask)
        chunks = list(client.chat.completions.create(**ask, stream=True))
    assert_one_weather_call(reply, chunks,
                            content="Checking." if parser == "mistral" else None)


@pytest.mark.parametrize("name", ["hermes", "mistral"])
def test_a_reply_ending_in_a_long_run_of_whitespace_keeps_it(name):
    """Whitespace held (it may come before a call) is kept in pieces and given back whole at
    the end of a reply without calls (in pieces: a run copied again with each of 65,536
    pieces cost 1.7 s of the event loop)."""
    read = reader(name)
    assert read.feed("Hello").content == "Hello"
    assert all(read.feed("\n\n").content == "" for _ in range(4096))
    assert read.feed(" x").content == "\n\n" * 4096 + " x"
    assert all(read.feed("\n\n").content == "" for _ in range(4096))
    assert read.finish().content == "\n\n" * 4096
