"""The router's OpenAI-compatible HTTP API, on a real stack (Redis, index, two engines, the
router) over loopback, through the official `openai` client: the same routing, failover and
stream resumption as gRPC, the models its replicas serve, errors in OpenAI's shape."""

from __future__ import annotations

import asyncio
import signal
import time

import openai
import pytest

from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from prefix_index.tools.redis_process import free_port
from router.tools.launch import RouterProcess
from tests.http.http_util import call
from tests.http.test_tool_calls import ASK, WEATHER, streamed_calls, weather_arguments
from tests.router.stack import RouterStack, wait_until

API_KEY = "router-key-42"

CHAT = [{"role": "user", "content": "Count from one to ten."}]
PROMPT = "Once upon a time, in a land far away,"
DRAIN_TOKENS = 400  # the stream a draining router finishes


class HttpRouter:
    """The router's HTTPS front door (TLS on the session's certificates; clients verify the
    CA)."""

    def __init__(self, stack: RouterStack, http_port: int) -> None:
        self.stack = stack
        self.base_url = f"https://127.0.0.1:{http_port}"
        self.model = stack.model_dir.name

    def client(self, api_key: str = API_KEY, base_url: str | None = None,
               **kwargs) -> openai.OpenAI:
        kwargs = {"max_retries": 0, "timeout": 120} | kwargs
        return self.stack.certs.openai_client(f"{base_url or self.base_url}/v1", api_key,
                                              **kwargs)

    def async_client(self, api_key: str = API_KEY,
                     base_url: str | None = None) -> openai.AsyncOpenAI:
        return self.stack.certs.async_openai_client(f"{base_url or self.base_url}/v1", api_key,
                                                    max_retries=0, timeout=120)

    def call(self, url: str, *args, **kwargs) -> tuple[int, dict]:
        return call(url, *args, context=self.stack.certs.ssl_context(), **kwargs)


@pytest.fixture(scope="module")
def router(tiny_llama_dir, tmp_path_factory, test_certs):
    http_port = free_port()
    with RouterStack(tiny_llama_dir, tmp_path_factory.mktemp("http-router"), test_certs,
                     router_args=["--http-port", str(http_port), "--api-key", API_KEY],
                     api_key=API_KEY) as stack:
        yield HttpRouter(stack, http_port)


@pytest.fixture(scope="module")
def router_stub(router):
    with router.stack.channel() as channel:  # (with the key: it guards gRPC too)
        yield pb_grpc.GenerationStub(channel)


def texts_of(chunks) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            piece = choice.text if hasattr(choice, "text") else (choice.delta.content or "")
            texts[choice.index] = texts.get(choice.index, "") + piece
    return texts


def wait_idle(stack: RouterStack, timeout_s: float = 30.0) -> pb.EngineStatsResponse:
    """Every replica's blocks free and nothing live (the router sums its replicas' stats)."""
    def idle():
        stats = stack.router_stats()
        done = stats.num_live_requests == 0 and stats.num_free_blocks == stats.num_blocks
        return stats if done else None

    return wait_until(idle, timeout_s, "every replica idle with its blocks free")


def test_models_are_the_replicas(router):
    with router.client() as client:
        [model] = client.models.list().data
    assert model.id == router.model
    assert router.call(f"{router.base_url}/health")[0] == 200


def test_completions_and_chat_through_the_router(router, router_stub):
    with router.client() as client:
        whole = client.completions.create(model=router.model, prompt=PROMPT, max_tokens=10,
                                          temperature=0, logprobs=2)
        streamed = list(client.completions.create(
            model=router.model, prompt=PROMPT, max_tokens=10, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        chat = client.chat.completions.create(model=router.model, messages=CHAT, max_tokens=8,
                                              temperature=0, logprobs=True, top_logprobs=3)
        n = client.chat.completions.create(model=router.model, messages=CHAT, max_tokens=5,
                                           n=3, temperature=1.0, seed=5)
        # echo: a token-id prompt's text comes from the router's Detokenize
        ids = list(router_stub.Tokenize(pb.TokenizeRequest(text=PROMPT)).token_ids)
        echoed = client.completions.create(model=router.model, prompt=ids, max_tokens=10,
                                           temperature=0, echo=True)
        # echo with logprobs: a text prompt is tokenized by the router's Tokenize, and the
        # replica's prompt logprobs come through
        scored = client.completions.create(model=router.model, prompt=PROMPT, max_tokens=0,
                                           temperature=0, logprobs=1, echo=True)
    [choice] = whole.choices
    assert echoed.choices[0].text == PROMPT + choice.text
    assert scored.choices[0].text == PROMPT and scored.usage.completion_tokens == 0
    prompt_scores = scored.choices[0].logprobs.token_logprobs
    assert len(prompt_scores) == len(ids) and prompt_scores[0] is None
    assert all(v is not None and v <= 0 for v in prompt_scores[1:])
    assert texts_of(streamed) == {0: choice.text}
    assert streamed[-1].usage.completion_tokens == 10
    assert "".join(choice.logprobs.tokens) == choice.text
    content = chat.choices[0].logprobs.content
    assert len(content) == 8 and all(len(t.top_logprobs) == 3 for t in content)
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert sorted(c.index for c in n.choices) == [0, 1, 2]
    assert n.usage.completion_tokens == 15

    # Greedy over HTTP equals the same request over the router's gRPC.
    reply = router_stub.Generate(pb.GenerateRequest(
        text=PROMPT, sampling=pb.SamplingParams(temperature=0, max_tokens=10, logprobs=2)),
        timeout=60)
    assert reply.completions[0].text == choice.text
    assert choice.logprobs.token_logprobs == pytest.approx(
        [lp.logprob for lp in reply.completions[0].logprobs], abs=1e-5)
    grpc_chat = router_stub.Generate(pb.GenerateRequest(
        chat=pb.ChatMessages(messages=[pb.ChatMessage(**m) for m in CHAT]),
        sampling=pb.SamplingParams(temperature=0, max_tokens=8)), timeout=60)
    assert grpc_chat.completions[0].text == chat.choices[0].message.content


def test_logit_bias_through_the_router(router, router_stub):
    """OpenAI's logit_bias over the router's HTTP front, and gRPC's map over its gRPC one,
    reach a replica's sampler: +100 forces the token at every step."""
    forced_id = 4321
    reply = router_stub.Generate(pb.GenerateRequest(text=PROMPT, sampling=pb.SamplingParams(
        temperature=0, max_tokens=5, ignore_eos=True, logit_bias={forced_id: 100.0})),
        timeout=60)
    assert list(reply.completions[0].token_ids) == [forced_id] * 5
    with router.client() as client:
        http = client.completions.create(model=router.model, prompt=PROMPT, max_tokens=5,
                                         temperature=0, logit_bias={str(forced_id): 100},
                                         extra_body={"ignore_eos": True})
    assert http.choices[0].text == reply.completions[0].text


def test_a_forced_tool_call_through_the_router(router):
    """The tools travel in the wire chat (tools_json): the replica's forced call, whole and
    streamed, as the engine makes it (test_tool_calls.py)."""
    choice = {"type": "function", "function": {"name": "get_weather"}}
    with router.client() as client:
        reply = client.chat.completions.create(model=router.model, messages=ASK,
                                               tools=[WEATHER], tool_choice=choice,
                                               max_tokens=60, temperature=0)
        calls, finishes = streamed_calls(client.chat.completions.create(
            model=router.model, messages=ASK, tools=[WEATHER], tool_choice=choice,
            max_tokens=60, temperature=0, stream=True))
    call = reply.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and finishes == ["stop"]
    assert weather_arguments(calls[0]["arguments"]) == weather_arguments(call.function.arguments)


def test_async_stream_and_cached_tokens(router):
    system = "A long shared system prompt for the router's cache test. " * 10
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "One?"}]

    async def body():
        client = router.async_client()
        first = await client.chat.completions.create(model=router.model, messages=messages,
                                                     max_tokens=3, temperature=0)
        messages[1]["content"] = "Two?"
        stream = await client.chat.completions.create(
            model=router.model, messages=messages, max_tokens=3, temperature=0, stream=True,
            stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        await client.close()
        return first, chunks

    first, chunks = asyncio.run(body())
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    usage = chunks[-1].usage
    # kv-aware routing sends the repeated prefix where it is cached
    assert usage.prompt_tokens_details.cached_tokens >= 4 * 16
    assert len(texts_of(chunks)[0]) > 0


def test_errors_through_the_router(router):
    with router.client() as client:
        with pytest.raises(openai.BadRequestError) as raised:
            client.completions.create(model=router.model, prompt=PROMPT, max_tokens=4,
                                      temperature=-2)
        error = raised.value.response.json()["error"]
        assert error["param"] == "temperature" and "temperature must be >= 0" in error["message"]
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(model=router.model, messages=CHAT, max_tokens=4,
                                           tools=[{"type": "function",
                                                   "function": {"name": "f"}}])
        assert raised.value.response.json()["error"]["param"] == "tool_choice"  # ("auto")
        with pytest.raises(openai.NotFoundError) as raised:
            client.chat.completions.create(model="not-served", messages=CHAT, max_tokens=4)
        assert raised.value.response.json()["error"]["code"] == "model_not_found"
    with router.client("nope") as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()


def test_client_disconnect_through_the_router_frees_the_replicas_blocks(router):
    async def body() -> pb.EngineStatsResponse:
        client = router.async_client()
        stream = await client.completions.create(
            model=router.model, prompt=PROMPT, max_tokens=1500, temperature=0, stream=True,
            extra_body={"ignore_eos": True})
        received = 0
        async for chunk in stream:
            received += len(chunk.choices)
            if received >= 5:
                break
        busy = await asyncio.to_thread(router.stack.router_stats)
        await stream.close()
        await client.close()
        return busy

    busy = asyncio.run(body())
    assert busy.num_running == 1 and busy.num_free_blocks < busy.num_blocks
    wait_idle(router.stack)


def test_503_while_the_router_drains(router):
    """A second router on the same replicas (this module's stays up), drained with a stream
    running: new requests 503, /health 503, the running stream finishes."""
    http_port = free_port()
    second = RouterProcess(["--prefix-index", router.stack.index.target, "--http-port",
                            str(http_port), "--grace-s", "60", "--log-level", "WARNING"],
                           log_path=router.stack.log_dir / "router-2.log",
                           tls=router.stack.certs.files("router")).start()
    base = f"https://127.0.0.1:{http_port}"
    try:
        wait_until(lambda: router.call(f"{base}/v1/models")[1]["data"], 30, "replicas known")

        async def body() -> str:
            client = router.async_client("none", base)
            # Long enough to outlast the checks below: the router exits once it is done
            # (a new TLS connection takes longer to make than a plain one did).
            stream = await client.completions.create(
                model=router.model, prompt=PROMPT, max_tokens=DRAIN_TOKENS, temperature=0,
                stream=True, extra_body={"ignore_eos": True})
            text = [(await stream.__anext__()).choices[0].text]
            second.proc.send_signal(signal.SIGTERM)
            while (await asyncio.to_thread(router.call, f"{base}/health"))[0] == 200:
                await asyncio.sleep(0.05)
            with pytest.raises(openai.InternalServerError) as raised:
                await client.completions.create(model=router.model, prompt=PROMPT,
                                                max_tokens=2)
            assert raised.value.status_code == 503
            assert "draining" in raised.value.response.json()["error"]["message"]
            text += [c.choices[0].text async for c in stream if c.choices]
            await client.close()
            return "".join(text)

        text = asyncio.run(body())
        assert second.proc.wait(60) == 0
    finally:
        second.kill()
    with router.client() as client:
        expected = client.completions.create(model=router.model, prompt=PROMPT,
                                             max_tokens=DRAIN_TOKENS, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text
    assert text == expected


def test_a_replica_lost_mid_stream_is_resumed_elsewhere(router):
    """The HTTP stream goes on on the other replica (the router's resumption): the client's
    text equals an uninterrupted greedy run."""
    stack = router.stack
    with router.client() as client:
        expected = client.completions.create(model=router.model, prompt=PROMPT, max_tokens=300,
                                             temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text

        stream = client.completions.create(model=router.model, prompt=PROMPT, max_tokens=300,
                                           temperature=0, stream=True,
                                           stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})
        chunks = [next(stream) for _ in range(5)]
        victim = wait_until(lambda: _running_on(stack), 30, "the replica running it")
        port = stack.engines[victim].port
        stack.kill_engine(victim)
        chunks += list(stream)
    try:
        assert texts_of(chunks) == {0: expected}
        assert chunks[-1].usage.completion_tokens == 300
    finally:
        stack.start_engine(victim, port=port)
        stack.wait_routable(2)


def _running_on(stack: RouterStack) -> str | None:
    for engine_id, engine in stack.engines.items():
        with stack.channel(engine.target) as channel:
            stats = pb_grpc.GenerationStub(channel).EngineStats(pb.EngineStatsRequest(),
                                                                timeout=10)
        if stats.num_running:
            return engine_id
    time.sleep(0.01)
    return None


def test_logprob_tokens_without_a_local_tokenizer(router, tmp_path):
    """A router with no tokenizer of its own (--tokenizer names a folder that is not there, as
    when the model lives only on the engines' machines) asks a replica for each token's text:
    the same tokens and logprobs as the router that tokenizes locally."""
    http_port = free_port()
    second = RouterProcess(["--prefix-index", router.stack.index.target, "--http-port",
                            str(http_port), "--tokenizer", str(tmp_path / "not-here"),
                            "--log-level", "INFO"],
                           log_path=router.stack.log_dir / "router-no-tokenizer.log",
                           tls=router.stack.certs.files("router")).start()
    base = f"https://127.0.0.1:{http_port}"
    try:
        wait_until(lambda: router.call(f"{base}/v1/models")[1]["data"], 30, "replicas known")
        with router.client("none", base) as remote, router.client() as local:
            asked = {"model": router.model, "prompt": PROMPT, "max_tokens": 10,
                     "temperature": 0, "logprobs": 3}
            [theirs], [ours] = (remote.completions.create(**asked).choices,
                                local.completions.create(**asked).choices)
            chat = remote.chat.completions.create(model=router.model, messages=CHAT,
                                                  max_tokens=6, temperature=0, logprobs=True,
                                                  top_logprobs=2)
    finally:
        second.kill()
    log = (router.stack.log_dir / "router-no-tokenizer.log").read_text()
    assert "no local tokenizer" in log  # the fallback is what was exercised
    assert theirs.text == ours.text and theirs.logprobs.tokens == ours.logprobs.tokens
    assert "".join(theirs.logprobs.tokens) == theirs.text
    assert theirs.logprobs.top_logprobs == ours.logprobs.top_logprobs
    content = chat.choices[0].logprobs.content
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 for t in content)
