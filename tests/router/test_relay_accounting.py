"""The router's count of what it queued on a replica (router/proxy.py _relay): every path gives
back what it took, and a prompt stops counting as queued at its first message. A fake upstream
call drives it (no processes)."""
from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace

import grpc
import pytest

from pagedgen_api import generation_pb2 as pb
from router.core import Route
from router.metrics import RouterMetrics
from router.policies import Decision
from router.proxy import Failure, RoutedRequest
from router.replicas import Replica, ReportedLoad

BLOCK = 16


class FakeCall:
    def __init__(self, script):
        self.script = list(script)  # messages, or an exception to raise
        self.cancelled = False

    def cancel(self):
        self.cancelled = True

    def __aiter__(self):
        return self

    async def __anext__(self):
        await asyncio.sleep(0)
        if not self.script:
            raise StopAsyncIteration
        item = self.script.pop(0)
        if isinstance(item, BaseException):
            raise item
        if item == "hang":
            await asyncio.sleep(3600)
        return item


class RpcError(grpc.aio.AioRpcError):
    def __init__(self, code):
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details="x")


def setup(script, matched=32):
    replica = Replica.__new__(Replica)
    replica.address, replica.engine_id = "127.0.0.1:1", "e0"
    replica.in_flight = replica.pending_prefill_tokens = replica.pending_prompt_tokens = 0
    replica.num_finished = replica.reported_after_finished = 0
    replica.prefilled_prompt_tokens = replica.reported_after_prefilled = 0
    replica.reported = ReportedLoad()
    replica.healthy, replica.retired, replica.last_error = True, False, ""
    call = FakeCall(script)
    replica.stub = SimpleNamespace(GenerateStream=lambda upstream, timeout, metadata=(): call)
    router = SimpleNamespace(metrics=RouterMetrics(),
                             replicas=SimpleNamespace(hasher=SimpleNamespace(block_size=BLOCK)),
                             config=SimpleNamespace(rpc_timeout_s=2.0, max_unsent_tokens=0))
    context = SimpleNamespace(time_remaining=lambda: None)
    routed = RoutedRequest(router, pb.GenerateRequest(request_id="r"), context)
    route = Route(Decision(replica, "kv-aware", matched, False), 34 * BLOCK)
    return routed, replica, route


def msg(n_tokens=1):
    return pb.GenerateStreamResponse(
        request_id="r", choices=[pb.Completion(index=0, token_ids=[1] * n_tokens)])


def counts(r):
    return r.in_flight, r.pending_prefill_tokens // BLOCK, r.pending_prompt_tokens // BLOCK


@pytest.mark.parametrize("script,first_item", [
    ([msg(), msg()], "msg"),
    ([RpcError(grpc.StatusCode.UNAVAILABLE)], "failure"),
    ([msg(), RpcError(grpc.StatusCode.INTERNAL)], "msg"),
])
def test_relay_counts_a_prompt_until_its_first_message_and_never_after(script, first_item):
    async def run():
        routed, replica, route = setup(script)
        relay = routed._relay(replica, route, pb.GenerateRequest(request_id="r"))
        async with contextlib.aclosing(relay) as items:
            first = await items.__anext__()
            if isinstance(first, Failure):  # failed before any message: still queued until then
                assert first_item == "failure" and counts(replica) == (1, 2, 34)
            else:
                assert first_item == "msg"
                assert counts(replica) == (1, 0, 0)  # prefilled: nothing queued of it
        assert counts(replica) == (0, 0, 0)  # every path gives back what it took
        # Prompts that streamed, for reports asked before: only one that got a message.
        assert replica.prefilled_prompt_tokens == (34 * BLOCK if first_item == "msg" else 0)
    asyncio.run(run())


def test_relay_counts_a_waiting_prompt_and_a_cancelled_one_gives_it_back():
    async def run():
        routed, replica, route = setup(["hang"])
        relay = routed._relay(replica, route, pb.GenerateRequest(request_id="r"))
        task = asyncio.ensure_future(relay.__anext__())
        await asyncio.sleep(0.01)
        assert counts(replica) == (1, 2, 34)  # queued: 2 uncached blocks of a 34-block prompt
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await relay.aclose()
        assert counts(replica) == (0, 0, 0)
    asyncio.run(run())


def _counts_after_first_message_and_after_the_end(script, matched: int = 32):
    async def run():
        routed, replica, route = setup(script, matched=matched)
        relay = routed._relay(replica, route, pb.GenerateRequest(request_id="r"))
        async with contextlib.aclosing(relay) as items:
            await items.__anext__()
            during = counts(replica)
        return during, counts(replica)
    return asyncio.run(run())


def test_a_token_less_first_message_still_ends_the_queued_count():
    """(what the engine sends after a chunk of a long prompt: documents the behaviour)"""
    script = [pb.GenerateStreamResponse(request_id="r"), msg()]
    assert _counts_after_first_message_and_after_the_end(script) == ((1, 0, 0), (0, 0, 0))


def test_a_wholly_cached_prompt_stops_counting_at_its_first_message():
    """Predicted wholly cached (0 uncached tokens): its whole prompt is still what the engine
    reports while it waits, and no longer once it streams."""
    assert (_counts_after_first_message_and_after_the_end([msg(), "hang"], matched=34)
            == ((1, 0, 0), (0, 0, 0)))
