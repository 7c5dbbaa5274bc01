"""What a chat template is given with tools (the tiny model's SmolLM2 template has no place for
them; here one that writes everything it gets): the request's tools, an assistant's calls in
the history with their arguments as objects (templates write them with `tojson`), and a tool's
answer with the id of the call it answers. Asked over HTTP (/tokenize, then /detokenize) and
gRPC (Tokenize's rendered prompt) of an engine served in-process: the same prompt."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from engine_service.core.config import EngineConfig
from engine_service.core.engine import LLMEngine
from engine_service.serving.server import EngineServer, ServerOptions
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from prefix_index.tools.redis_process import free_port
from tests.http.http_util import call
from tests.http.inprocess import with_chat_template
from tests.http.test_tool_calls import WEATHER

# Writes the tools, each message's calls and the call a tool's answer is for.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system{% for tool in tools %} TOOL {{ tool | tojson }}"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message.role }}"
    "{% for call in message.tool_calls or [] %} CALL {{ call.id }} {{ call.function.name }} "
    "{{ call.function.arguments | tojson }}{% endfor %}"
    "{% if message.tool_call_id %} ANSWERS {{ message.tool_call_id }}:{% endif %}"
    " {{ message.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tool_template_model(tiny_llama_dir, tmp_path_factory) -> Path:
    """The tiny model with TOOL_TEMPLATE for its chat template."""
    return with_chat_template(tiny_llama_dir, tmp_path_factory.mktemp("tool_template"),
                              TOOL_TEMPLATE)


HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call-7", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}]},
    {"role": "tool", "tool_call_id": "call-7", "content": "sunny, 21 C"},
]


def test_the_template_gets_the_tools_the_calls_and_the_answers(tool_template_model,
                                                                test_certs):
    engine = LLMEngine(EngineConfig(model=str(tool_template_model), num_blocks=256))

    async def body() -> tuple[str, str]:
        server = EngineServer(engine, ServerOptions(
            port=0, http_port=free_port(), tls=test_certs.material("engine")))
        port = await server.start()
        base = f"https://127.0.0.1:{server.http.port}"
        context = test_certs.ssl_context("client")
        try:
            status, tokens = await asyncio.to_thread(
                call, f"{base}/tokenize", {"messages": HISTORY, "tools": [WEATHER]},
                context=context)
            assert status == 200, tokens
            status, text = await asyncio.to_thread(
                call, f"{base}/detokenize", {"tokens": tokens["tokens"]}, context=context)
            assert status == 200, text
            chat = pb.ChatMessages(tools_json=json.dumps([WEATHER]), messages=[
                pb.ChatMessage(role="user", content="Weather in Paris?"),
                pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(
                    id="call-7", name="get_weather", arguments='{"city": "Paris", "days": 2}')]),
                pb.ChatMessage(role="tool", tool_call_id="call-7", content="sunny, 21 C")])
            async with test_certs.aio_channel(f"127.0.0.1:{port}") as channel:
                reply = await pb_grpc.GenerationStub(channel).Tokenize(
                    pb.TokenizeRequest(chat=chat), timeout=30)
            return text["prompt"], reply.prompt
        finally:
            await server.stop(0)

    over_http, over_grpc = asyncio.run(body())
    # (/detokenize leaves the special tokens out)
    assert over_http == over_grpc.replace("<|im_start|>", "").replace("<|im_end|>", "")
    assert f"TOOL {json.dumps(WEATHER)}" in over_grpc  # the tool, whole
    # The arguments as an object (tojson writes it compact, keys sorted), not a quoted string.
    assert 'CALL call-7 get_weather {"city": "Paris", "days": 2}' in over_grpc
    assert "<|im_start|>tool ANSWERS call-7: sunny, 21 C<|im_end|>" in over_grpc


def test_the_offline_chat_gives_the_template_its_tools(tool_template_model):
    from engine_service.llm import LLM
    from engine_service.model.sampling_params import SamplingParams

    llm = LLM(model=str(tool_template_model), num_blocks=64)
    [out] = llm.chat(HISTORY, SamplingParams(max_tokens=1), tools=[WEATHER])
    assert f"TOOL {json.dumps(WEATHER)}" in out.prompt
    assert 'CALL call-7 get_weather {"city": "Paris", "days": 2}' in out.prompt  # as served
