"""The router under hostile use: an Abort racing a replica's failure, huge prompts that must not
stall its event loop, hung replicas, a drain, replicas replaced by ones serving another model
identity."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time

import grpc
import pytest

import router.prompt
from engine_service.tools.launch import EngineProcess
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from router.config import RouterConfig
from router.core import Router
from router.server import RouterServer
from tests.router.stack import engine_args, generate, wait_until
from tests.router.test_failover import busy_engine
from tests.router.test_routing import PREFIX_BLOCKS, prompt


def test_a_huge_text_prompt_is_refused_unread_and_others_are_served(stack, monkeypatch):
    """A text far over every replica's limit is refused by the engine; the router does not
    tokenize it (that alone takes seconds), and answers other calls meanwhile."""
    huge = ("The quick brown fox jumps over the lazy dog. " * 80000)[:3_500_000]
    read: list[int] = []
    real_encode = router.prompt.encode_text

    def encode_text(tokenizer, text):
        read.append(len(text))
        return real_encode(tokenizer, text)

    monkeypatch.setattr(router.prompt, "encode_text", encode_text)

    async def body() -> None:
        async with router_here(stack, RouterConfig()) as (server, stub):
            await eventually(lambda: server.router.prompts.source == "local",
                             "the router tokenizing locally")
            reply = await stub.Generate(pb.GenerateRequest(text="Hello router", sampling=(
                pb.SamplingParams(max_tokens=1))), timeout=30)
            assert reply.completions and read == [len("Hello router")]  # read here, normally
            huge_call = asyncio.ensure_future(
                stub.Generate(pb.GenerateRequest(text=huge), timeout=60))
            while not huge_call.done():
                # Other calls meanwhile, each answered (30 s: a bound on liveness, not speed).
                await stub.ModelInfo(pb.ModelInfoRequest(), timeout=30)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await huge_call
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert read == [len("Hello router")], "the router read the huge prompt"

    asyncio.run(body())


def test_tokenizing_a_prompt_leaves_the_router_answering(stack, monkeypatch):
    """The router tokenizes off its event loop: while one prompt is in the tokenizer (held
    there by this test until it says so), other calls and requests are answered."""
    marker = "Hold this prompt in the tokenizer"
    entered, release, returned = threading.Event(), threading.Event(), threading.Event()
    real_encode = router.prompt.encode_text

    def encode_text(tokenizer, text):
        if text == marker:
            entered.set()
            release.wait(30)  # on the event loop this would freeze the test too: then fails
            returned.set()
        return real_encode(tokenizer, text)

    monkeypatch.setattr(router.prompt, "encode_text", encode_text)

    async def body() -> None:
        async with router_here(stack, RouterConfig()) as (server, stub):
            await eventually(lambda: server.router.prompts.source == "local",
                             "the router tokenizing locally")
            held = asyncio.ensure_future(stub.Generate(pb.GenerateRequest(
                text=marker, sampling=pb.SamplingParams(max_tokens=2, ignore_eos=True)),
                timeout=120))
            assert await asyncio.to_thread(entered.wait, 30), "the prompt never reached it"
            info = await stub.ModelInfo(pb.ModelInfoRequest(), timeout=30)
            other = await stub.Generate(pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=[5, 6, 7]),
                sampling=pb.SamplingParams(max_tokens=2, ignore_eos=True)), timeout=30)
            assert not returned.is_set() and not held.done(), "answered only after tokenizing"
            assert info.block_size and len(other.completions[0].token_ids) == 2
            release.set()
            reply = await held
            assert len(reply.completions[0].token_ids) == 2

    try:
        asyncio.run(body())
    finally:
        release.set()


def test_abort_while_the_replica_hangs_ends_the_stream(stack, router_stub):
    """The replica stops answering (SIGSTOP) mid-stream and the client aborts: the Abort must
    not be lost in the failover (the stream resumed elsewhere and ran to max_tokens)."""
    request = pb.GenerateRequest(
        request_id="abort-during-hang", token_ids=pb.TokenIds(ids=prompt(60)),
        sampling=pb.SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    stream = router_stub.GenerateStream(request, timeout=120)
    tokens = [t for c in next(stream).choices for t in c.token_ids]
    victim = wait_until(lambda: busy_engine(stack), what="the replica running the stream")
    process = stack.engines[victim].proc
    process.send_signal(signal.SIGSTOP)
    try:
        reply = router_stub.Abort(pb.AbortRequest(request_id="abort-during-hang"), timeout=20)
        assert reply.found
        last = None
        for message in stream:
            tokens += [t for c in message.choices for t in c.token_ids]
            last = message
    finally:
        process.send_signal(signal.SIGCONT)
    assert last is not None and last.finished
    assert last.choices[-1].finish_reason == pb.FINISH_REASON_ABORT
    assert len(tokens) < 400
    assert last.usage.completion_tokens == len(tokens)
    assert not router_stub.Abort(pb.AbortRequest(request_id="abort-during-hang"),
                                 timeout=10).found
    stack.wait_routable(2)
    reply, _ = generate(router_stub, prompt(61), max_tokens=3)
    assert len(reply.completions[0].token_ids) == 3


def test_redis_restarted_empty_fails_no_request(stack, router_stub):
    """Redis comes back empty (no persistence): every registration is gone until the engines
    notice and register again. The replicas themselves never stopped serving, so the router
    must not drop them meanwhile (every request would fail with 'no engine replica')."""
    stop = threading.Event()
    failures: list[str] = []
    served = []

    def load() -> None:
        i = 0
        while not stop.is_set():
            try:
                served.append(generate(router_stub, prompt(80 + i % 4)[:40], max_tokens=2))
            except grpc.RpcError as error:
                failures.append(f"{error.code().name}: {error.details()}")
            i += 1

    before = {engine_id: registrations(stack, engine)
              for engine_id, engine in stack.engines.items()}
    worker = threading.Thread(target=load)
    worker.start()
    try:
        wait_until(lambda: served or failures, what="the load running")
        stack.redis.restart()
        # The engines find the index has lost them and register again; the load goes on.
        wait_until(lambda: all(registrations(stack, engine) > before[engine_id]
                               for engine_id, engine in stack.engines.items()),
                   timeout_s=60, what="every engine registered again")
        stack.wait_routable(2)
        after = len(served)
        wait_until(lambda: len(served) >= after + 3 or failures,
                   what="requests served after the engines registered again")
    finally:
        stop.set()
        worker.join()
    assert failures == []


def registrations(stack, engine: EngineProcess) -> int:
    """How many times the engine registered with the index, as long as its link is up (-1
    while it is not)."""
    with stack.channel(engine.target) as channel:
        stats = pb_grpc.GenerationStub(channel).EngineStats(pb.EngineStatsRequest(), timeout=10)
    details = stats.index_details
    return int(details["registrations"]) if details.get("state") == "ok" else -1


async def eventually(condition, what: str, timeout_s: float = 60.0):
    """Polls `condition` without blocking the event loop (a router_here router runs on it)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s}s")
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def router_here(stack, config: RouterConfig):
    """A router in this process in front of the stack's engines (its state and metrics can be
    read), and a stub to it over loopback."""
    router = Router(config, [e.target for e in stack.engines.values()], stack.index.target,
                    tls=stack.certs.material("router"))
    server = RouterServer(router, port=0, tls=stack.certs.material("router"))
    await server.start()
    try:
        async with stack.certs.aio_end_client_channel(f"127.0.0.1:{server.port}") as channel:
            yield server, pb_grpc.GenerationStub(channel)
    finally:
        await server.stop(0)


def decisions(router: Router) -> float:
    return sum(sample.value for metric in router.metrics.registry.collect()
               if metric.name == "pagedgen_router_decisions"
               for sample in metric.samples if sample.name.endswith("_total"))


def test_pin_prefix_is_no_routing_decision_and_is_refused_while_draining(stack):
    pin = pb.PinPrefixRequest(token_ids=pb.TokenIds(ids=prompt(90)))

    async def body() -> None:
        async with router_here(stack, RouterConfig()) as (server, stub):
            pinned = await stub.PinPrefix(pin, timeout=10)
            assert pinned.num_blocks == PREFIX_BLOCKS
            assert decisions(server.router) == 0
            await stub.Generate(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7]),
                                                   sampling=pb.SamplingParams(max_tokens=1)),
                                timeout=30)
            assert decisions(server.router) == 1
            unpin = pb.PinPrefixRequest(token_ids=pin.token_ids, unpin=True)
            assert (await stub.PinPrefix(unpin, timeout=10)).num_blocks == PREFIX_BLOCKS
            server.servicer.draining = True  # what SIGTERM does first
            for call in (stub.PinPrefix(pin, timeout=10), stub.Generate(
                    pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6])), timeout=10)):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "draining" in refused.value.details()
            assert decisions(server.router) == 1

    asyncio.run(body())


class RecordingStub:
    """A replica's stub that notes when each EngineStats call starts and ends."""

    def __init__(self, stub, name: str, events: list[tuple[str, str]]) -> None:
        self._stub, self._name, self._events = stub, name, events

    def __getattr__(self, method: str):
        return getattr(self._stub, method)

    async def EngineStats(self, request, timeout=None):  # noqa: N802 - the gRPC method's name
        self._events.append(("start", self._name))
        try:
            return await self._stub.EngineStats(request, timeout=timeout)
        finally:
            self._events.append(("end", self._name))


def test_engine_stats_asks_the_replicas_at_once(stack):
    """Every replica hung (SIGSTOP): the router's EngineStats asks them all before any answer
    (or times out), so it costs its timeout once, not once per replica."""
    # No stats polls after start-up: every EngineStats call seen is the one under test.
    config = RouterConfig(rpc_timeout_s=1.0, stats_interval_s=3600)
    processes = [engine.proc for engine in stack.engines.values()]
    events: list[tuple[str, str]] = []

    async def body() -> None:
        async with router_here(stack, config) as (server, stub):
            replicas = list(server.router.replicas.replicas.values())
            assert len(replicas) == len(processes)
            for replica in replicas:
                replica.stub = RecordingStub(replica.stub, replica.name, events)
            for process in processes:
                process.send_signal(signal.SIGSTOP)
            try:
                stats = await stub.EngineStats(pb.EngineStatsRequest(), timeout=30)
            finally:
                for process in processes:
                    process.send_signal(signal.SIGCONT)
            assert stats.index_details["replicas"] == str(len(processes))

    asyncio.run(body())
    starts = [name for kind, name in events[:len(processes)] if kind == "start"]
    assert sorted(starts) == sorted(stack.engines), events  # all asked before any answer
    assert len(events) == 2 * len(processes), events
    stack.wait_routable(2)


def test_replicas_replaced_by_another_model_identity_are_routed(stack, router_stub):
    """Every replica restarted with another dtype (another model identity: other block hashes,
    other tokens' meaning): the router must hash as they do now and route to them, not refuse
    everything forever because the first replica it ever saw served float32."""
    for engine_id in list(stack.engines):
        stack.kill_engine(engine_id)
    stack.wait_routable(0)
    dtype = "bfloat16"
    args = engine_args(stack.index.target, "engine-0")
    args[args.index("--dtype") + 1] = dtype
    engine = EngineProcess(stack.model_dir, args, log_path=stack.log_dir / "engine-0-new.log",
                           tls=stack.certs.files("engine"))
    engine.start()
    stack.engines["engine-0"] = engine
    stack.wait_routable(1)
    info = router_stub.ModelInfo(pb.ModelInfoRequest(), timeout=10)
    assert info.dtype == dtype
    ids = prompt(70)
    first, [holder] = generate(router_stub, ids, max_tokens=2)
    assert holder == "engine-0"
    details = router_stub.EngineStats(pb.EngineStatsRequest(), timeout=10).index_details
    assert details["replica.engine-0"].endswith(" up")
