"""The router's per-replica counters on the real stack: what it counts as running on a replica
(in_flight, and the pagedgen_router_in_flight_requests gauge) and as queued there (prompt
tokens routed but not answered yet) go back to zero after client cancels, queued or
mid-stream, and after a replica's death with streams on it. A leak there skews every later
routing decision towards the other replicas, for good.

The router runs in this process (its counters can be read), in front of real engines that
register with a real index; the client calls it over loopback. tests/router/
test_relay_accounting.py drives the same accounting with fake calls, path by path."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

import grpc
import pytest

from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from router.config import RouterConfig
from router.core import Router
from router.replicas import Replica
from router.server import RouterServer
from tests.router.stack import RouterStack
from tests.router.test_routing import prompt

# Conditions, not timings: each is waited for this long and fails only if it never happens.
SETTLE_S = 30.0


@pytest.fixture(scope="module")
def engines(tiny_llama_dir, tmp_path_factory, test_certs) -> Iterator[RouterStack]:
    """Redis, the index and two engines; no router process (each test runs its own)."""
    with RouterStack(tiny_llama_dir, tmp_path_factory.mktemp("counters"), test_certs,
                     with_router=False) as running:
        yield running


async def eventually(condition, what: str, timeout_s: float = SETTLE_S, state=lambda: ""):
    """Polls `condition` without blocking the event loop (the router runs on it too); fails
    naming `what` and, when given, `state()` as it is then."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s}s {state()}")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def router_in_front_of(stack: RouterStack):
    """A router finding its replicas through the index, as pagedgen-router does, with the
    stack's poll and discovery intervals; it and a stub to it over loopback."""
    config = RouterConfig(stats_interval_s=0.05, discovery_interval_s=0.2)
    router = Router(config, [], stack.index.target, tls=stack.certs.material("router"))
    server = RouterServer(router, port=0, tls=stack.certs.material("router"))
    await server.start()
    try:
        async with stack.certs.aio_end_client_channel(f"127.0.0.1:{server.port}") as channel:
            stub = pb_grpc.GenerationStub(channel)
            await eventually(lambda: len(router.replicas.routable()) == len(stack.engines),
                             "every engine routable")
            yield router, stub
    finally:
        await server.stop(0)


class Counts:
    """Every replica the router has had (a replica removed keeps counting until its last
    request ends), and what it counts on each."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.seen: dict[int, Replica] = {}
        self.note()

    def note(self) -> None:
        for replica in self.router.replicas.replicas.values():
            self.seen.setdefault(id(replica), replica)

    def running(self) -> int:
        self.note()
        return sum(r.in_flight for r in self.seen.values())

    def queued(self) -> int:
        self.note()
        return sum(r.pending_prompt_tokens for r in self.seen.values())

    def prefilled(self) -> int:
        return sum(r.prefilled_prompt_tokens for r in self.seen.values())

    def left(self) -> dict[str, tuple[int, int, int, float | None]]:
        """Replica -> (in_flight, queued uncached tokens, queued prompt tokens, in-flight
        gauge) where anything is not zero."""
        self.note()
        registry = self.router.metrics.registry
        left = {}
        for replica in self.seen.values():
            gauge = registry.get_sample_value("pagedgen_router_in_flight_requests",
                                              {"replica": replica.name})
            counts = (replica.in_flight, replica.pending_prefill_tokens,
                      replica.pending_prompt_tokens, gauge)
            if counts[:3] != (0, 0, 0) or gauge not in (None, 0.0):
                state = "removed" if replica.retired else "member"
                left[f"{replica.name} ({state})"] = counts
        return left

    def all_zero(self) -> bool:
        return not self.left() and not self.router.live

    def state(self) -> str:
        return f"(left: {self.left()}, live requests: {list(self.router.live)})"


def stream_request(ids: list[int], max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids),
        sampling=pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))


async def streaming(stub, seeds: range, max_tokens: int, blocks: int = 12) -> list:
    """Streams for prompt(seed, blocks) of each seed, each past its first message."""
    calls = [stub.GenerateStream(stream_request(prompt(seed, blocks), max_tokens), timeout=120)
             for seed in seeds]
    for call in calls:
        first = await call.read()
        assert first is not grpc.aio.EOF and not first.finished
    return calls


async def cancel_while_queued(stub, counts: Counts, seed: int) -> bool:
    """A long prompt cancelled while the router counts it queued (routed, not answered yet);
    False when its first message won the race (the caller tries again)."""
    prefilled = counts.prefilled()
    ids = prompt(seed, blocks=100)  # 1,605 tokens: its first message takes a while
    call = stub.GenerateStream(stream_request(ids, 8), timeout=120)
    await eventually(lambda: counts.queued() or counts.prefilled() != prefilled,
                     "the request routed")
    if counts.prefilled() != prefilled:
        call.cancel()
        return False
    # Same turn of the loop as the check: the router's relay has not seen an answer.
    call.cancel()
    await eventually(lambda: not counts.running(), "the cancelled request ended")
    return counts.prefilled() == prefilled


def test_counters_are_back_at_zero_after_client_cancels(engines):
    engines.restart_dead_engines()  # run alone or after the death test

    async def body() -> None:
        async with router_in_front_of(engines) as (router, stub):
            counts = Counts(router)
            # Mid-stream: the router counts each as running, none as queued any more.
            calls = await streaming(stub, range(500, 504), max_tokens=1500)
            assert counts.running() == 4 and counts.queued() == 0, counts.left()
            for call in calls:
                call.cancel()
            await eventually(counts.all_zero, "nothing counted after the cancels",
                             state=counts.state)
            # Queued: routed, cancelled before the replica's first message.
            for attempt in range(10):
                if await cancel_while_queued(stub, counts, 510 + attempt):
                    break
            else:
                raise AssertionError("every request answered before its cancel: 10 tries")
            await eventually(counts.all_zero, "nothing counted after the queued cancel",
                             state=counts.state)
            # Still routable, and still counting: a request after all that runs normally.
            reply = await stub.Generate(stream_request(prompt(520), 4), timeout=60)
            assert len(reply.completions[0].token_ids) == 4
            assert counts.all_zero(), counts.left()

    asyncio.run(body())


def test_counters_are_back_at_zero_after_a_replica_dies_mid_stream(engines):
    engines.restart_dead_engines()  # run alone or after the death test
    # Long enough that no stream can end between its first message and the kill.
    max_tokens = 1000

    async def body() -> None:
        async with router_in_front_of(engines) as (router, stub):
            counts = Counts(router)
            calls = await streaming(stub, range(600, 604), max_tokens, blocks=2)
            assert counts.running() == 4, counts.left()
            busy = {r.engine_id: r.in_flight for r in router.replicas.replicas.values()}
            victim = max(busy, key=busy.get)
            engines.kill_engine(victim)  # SIGKILL, at once
            # Its streams go on elsewhere; one stream (wherever it runs) is cancelled meanwhile.
            calls[-1].cancel()
            served = []
            for call in calls[:-1]:
                last = None
                while (message := await call.read()) is not grpc.aio.EOF:
                    last = message
                assert last is not None and last.finished
                assert last.usage.completion_tokens == max_tokens
                metadata = dict(await call.trailing_metadata())
                served.append(metadata["pagedgen-replicas"].split(","))
            await eventually(counts.all_zero, f"nothing counted after {victim}'s death",
                             state=counts.state)
            # The victim ran two streams at least, one of them not the cancelled one: resumed.
            assert any(names[0] == victim and len(names) == 2 for names in served), served

    asyncio.run(body())
