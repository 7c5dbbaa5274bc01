"""chat_template_kwargs (vLLM's): more variables for the chat template, such as Qwen3's
`enable_thinking`. Here a template that, like Qwen3's, writes an empty think block when
thinking is turned off: the offline chat, HTTP (/tokenize, chat completions) and gRPC give it
the same variables and so the same prompt; a name the template call takes itself (tokenize,
tools, ...) or something that is not an object is refused by name."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import openai
import pytest

from engine_service.core.config import EngineConfig
from engine_service.core.engine import LLMEngine
from engine_service.core.errors import InvalidRequestError
from engine_service.serving.server import EngineServer, ServerOptions
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from prefix_index.tools.redis_process import free_port
from tests.http.http_util import call
from tests.http.inprocess import with_chat_template
from tests.http.test_engine_errors import error_of

THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}")
THINK_OFF = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
MESSAGES = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="module")
def think_template_model(tiny_llama_dir, tmp_path_factory) -> Path:
    return with_chat_template(tiny_llama_dir, tmp_path_factory.mktemp("think_template"),
                              THINK_TEMPLATE)


def test_the_offline_chat_gives_the_template_its_variables(think_template_model):
    from engine_service.llm import LLM
    from engine_service.model.sampling_params import SamplingParams

    llm = LLM(model=str(think_template_model), num_blocks=64)
    one = SamplingParams(max_tokens=1)
    [plain] = llm.chat(MESSAGES, one)
    [off] = llm.chat(MESSAGES, one, chat_template_kwargs={"enable_thinking": False})
    assert not plain.prompt.endswith(THINK_OFF) and off.prompt.endswith(THINK_OFF)
    with pytest.raises(InvalidRequestError, match="chat_template_kwargs must not set 'tokenize'"):
        llm.chat(MESSAGES, one, chat_template_kwargs={"tokenize": True})
    with pytest.raises(InvalidRequestError, match="must be a JSON object of template variables, "
                                                  "got a list"):
        llm.chat(MESSAGES, one, chat_template_kwargs=[("enable_thinking", False)])


def test_http_and_grpc_give_the_template_the_same_variables(think_template_model, test_certs):
    engine = LLMEngine(EngineConfig(model=str(think_template_model), num_blocks=256))
    off = {"enable_thinking": False}

    async def body() -> dict:
        server = EngineServer(engine, ServerOptions(
            port=0, http_port=free_port(), tls=test_certs.material("engine")))
        port = await server.start()
        base = f"https://127.0.0.1:{server.http.port}"
        context = test_certs.ssl_context("client")

        def post(route: str, payload: dict) -> tuple[int, dict]:
            return call(f"{base}{route}", payload, context=context)

        try:
            got = {}
            got["plain"] = await asyncio.to_thread(post, "/tokenize", {"messages": MESSAGES})
            got["off"] = await asyncio.to_thread(post, "/tokenize", {
                "messages": MESSAGES, "chat_template_kwargs": off})
            got["completion"] = await asyncio.to_thread(post, "/v1/chat/completions", {
                "messages": MESSAGES, "max_tokens": 1, "chat_template_kwargs": off})
            got["reserved"] = await asyncio.to_thread(post, "/v1/chat/completions", {
                "messages": MESSAGES, "max_tokens": 1,
                "chat_template_kwargs": {"tools": [], "enable_thinking": False}})
            got["not_object"] = await asyncio.to_thread(post, "/tokenize", {
                "messages": MESSAGES, "chat_template_kwargs": [1]})
            got["no_messages"] = await asyncio.to_thread(post, "/tokenize", {
                "prompt": "hi", "chat_template_kwargs": off})
            chat = pb.ChatMessages(template_kwargs_json=json.dumps(off), messages=[
                pb.ChatMessage(role="user", content=MESSAGES[0]["content"])])
            async with test_certs.aio_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.GenerationStub(channel)
                got["grpc"] = await stub.Tokenize(pb.TokenizeRequest(chat=chat), timeout=30)
                chat.template_kwargs_json = '{"enable_thinking": fals'
                with pytest.raises(grpc.aio.AioRpcError) as raised:
                    await stub.Tokenize(pb.TokenizeRequest(chat=chat), timeout=30)
                got["grpc_bad"] = raised.value
            return got
        finally:
            await server.stop(0)

    got = asyncio.run(body())
    (status, plain), (status_off, thinking_off) = got["plain"], got["off"]
    assert status == status_off == 200, (plain, thinking_off)
    assert thinking_off["count"] > plain["count"]
    assert got["grpc"].prompt.endswith(THINK_OFF)
    assert list(got["grpc"].token_ids) == thinking_off["tokens"]  # gRPC's tokens are HTTP's
    status, completion = got["completion"]
    assert status == 200 and completion["usage"]["prompt_tokens"] == thinking_off["count"]
    for case, param, says in (
            ("reserved", "chat_template_kwargs", "chat_template_kwargs must not set 'tools'"),
            ("not_object", "chat_template_kwargs", ""),
            ("no_messages", "chat_template_kwargs", "must be left unset without messages")):
        status, reply = got[case]
        assert status == 400, (case, reply)
        assert reply["error"]["param"] == param and says in reply["error"]["message"], reply
    assert got["grpc_bad"].code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "chat.template_kwargs_json must be a JSON object" in got["grpc_bad"].details()


def test_the_openai_client_s_extra_body_reaches_the_engine(client, http_engine):
    """Through the openai package, as users send it (extra_body); SmolLM2's template has no
    enable_thinking, so the prompt is the same."""
    replies = [client.chat.completions.create(
        model=http_engine.model, messages=MESSAGES, max_tokens=2, temperature=0,
        extra_body=extra) for extra in ({}, {"chat_template_kwargs": {"enable_thinking": False}})]
    assert replies[0].usage.prompt_tokens == replies[1].usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=http_engine.model, messages=MESSAGES, max_tokens=2,
                                       extra_body={"chat_template_kwargs": {"tokenize": True}})
    assert error_of(raised)["param"] == "chat_template_kwargs"
