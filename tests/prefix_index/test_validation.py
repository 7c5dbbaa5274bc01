"""Bad input gets INVALID_ARGUMENT / NOT_FOUND naming the field, and the server keeps serving."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pagedgen_api import prefix_index_pb2 as pb
from pagedgen_api import prefix_index_pb2_grpc as pb_grpc
from prefix_index.api.client import PrefixIndexClientError
from prefix_index.api.ops import Acquire, Commit, Evict, Forget, Pin, Release, Unpin
from tests.prefix_index.chains import commit_ops, make_chain
from trust.identity import ENGINE_ROLE, INDEX_ROLE

GOOD = make_chain("good", 1)[0]


async def _expect(call, code: grpc.StatusCode, *fragments: str) -> None:
    with pytest.raises(PrefixIndexClientError) as err:
        await call
    assert err.value.code == code, err.value
    for fragment in fragments:
        assert fragment in err.value.details, (fragment, err.value.details)


def test_bad_ops_are_refused_with_the_field_named(index_server, engine_id, test_certs):
    async def body():
        async with test_certs.index_client(index_server.target, 5.0) as c:
            await c.register(engine_id, "m", 16, 8, 30)
            bad = grpc.StatusCode.INVALID_ARGUMENT
            await _expect(c.apply([Acquire([GOOD, b"short"])]), bad,
                          "ops[0].acquire.chain[1]", "5 bytes", "16-byte")
            await _expect(c.apply([Acquire(make_chain("dup", 3) + [GOOD, GOOD])]), bad,
                          "ops[0].acquire.chain[4]", "repeats ops[0].acquire.chain[3]")
            await _expect(c.apply([Release([GOOD]), Commit(b"x" * 17, b"", 0)]), bad,
                          "ops[1].commit.hash", "17 bytes")
            await _expect(c.apply([Commit(GOOD, b"p", 0)]), bad, "ops[0].commit.parent")
            await _expect(c.apply([Commit(GOOD, b"", -1)]), bad, "ops[0].commit.block_id", "-1")
            await _expect(c.apply([Commit(GOOD, b"", 8)]), bad, "ops[0].commit.block_id", "8",
                          "0..7")
            await _expect(c.apply([Evict(-3)]), bad, "ops[0].evict.k", "-3")
            await _expect(c.apply([Evict(9)]), bad, "ops[0].evict.k", "9", "0..8")
            await _expect(c.apply([Pin([GOOD], ttl_s=-1)]), bad, "ops[0].pin.ttl_s")
            await _expect(c.apply([Pin([GOOD], ttl_s=float("nan"))]), bad, "ops[0].pin.ttl_s",
                          "nan")
            await _expect(c.apply([Pin([GOOD], ttl_s=1e300)]), bad, "ops[0].pin.ttl_s")
            # A pin is named by its chain's last hash: an empty chain names none.
            await _expect(c.apply([Evict(0), Pin([])]), bad, "ops[1].pin.chain", "empty")
            await _expect(c.apply([Unpin([])]), bad, "ops[0].unpin.chain", "empty")
            await _expect(c.apply([Pin(make_chain("long", 16385))]), bad, "ops[0].pin.chain",
                          "16385", "16384")
            await _expect(c.apply([Evict(0)] * 5000), bad, "ops", "5000", "4096")
            await _expect(c.apply([Acquire([GOOD] * 20000)]), bad, "ops[0].acquire.chain",
                          "20000")
            # A refused batch changed nothing: the commit before the bad one did not happen.
            await _expect(c.apply(commit_ops([GOOD], 0) + [Evict(99)]), bad, "ops[1].evict.k")
            [acq] = await c.apply([Acquire([GOOD])])
            assert acq.block_ids == []
            # ... and the server still serves this engine.
            [ok] = await c.apply(commit_ops([GOOD], 0))
            assert ok.ok
    asyncio.run(body())


def test_bad_registration_and_unknown_engines(index_server, engine_id, test_certs):
    async def body():
        async with test_certs.index_client(index_server.target, 5.0) as c:
            bad = grpc.StatusCode.INVALID_ARGUMENT
            await _expect(c.register("", "m", 16, 8), bad, "engine_id")
            await _expect(c.register("a{b}", "m", 16, 8), bad, "engine_id", "'a{b}'")
            await _expect(c.register(engine_id, "", 16, 8), bad, "model_identity")
            await _expect(c.register(engine_id, "m", 0, 8), bad, "block_size", "0")
            await _expect(c.register(engine_id, "m", 16, 0), bad, "num_blocks", "0")
            await _expect(c.register(engine_id, "m", 16, 8, -1), bad, "lease_s", "-1")
            await _expect(c.stats(engine_id), grpc.StatusCode.NOT_FOUND, engine_id)
            await _expect(c.lookup([b"abc"]), bad, "chain[0]", "3 bytes")

        # A client that never registered: the server answers NOT_FOUND for its engine id.
        async with test_certs.aio_channel(index_server.target, ENGINE_ROLE, INDEX_ROLE) as channel:
            stub = pb_grpc.PrefixIndexStub(channel)
            for call, request in (
                (stub.Apply, pb.ApplyRequest(engine_id=engine_id, epoch=1)),
                (stub.Heartbeat, pb.HeartbeatRequest(engine_id=engine_id, epoch=1)),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await call(request, timeout=5)
                assert err.value.code() == grpc.StatusCode.NOT_FOUND
                assert engine_id in err.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Apply(pb.ApplyRequest(engine_id=engine_id, epoch=0), timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "epoch" in err.value.details()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Apply(pb.ApplyRequest(engine_id=engine_id, epoch=1, ops=[pb.Op()]),
                                 timeout=5)
            assert "ops[0]: no op set" in err.value.details()

        async with test_certs.index_client(index_server.target, 5.0) as c:  # still serving
            assert await c.register(engine_id, "m", 16, 8) > 0
    asyncio.run(body())


def test_new_fields_are_checked(index_server, engine_id, test_certs):
    """forget, acquire kind and seq: refused with the field, the value and what is allowed."""
    async def body():
        async with test_certs.index_client(index_server.target, 5.0) as c:
            await c.register(engine_id, "m", 16, 8, 30)
            bad = grpc.StatusCode.INVALID_ARGUMENT
            await _expect(c.apply([Forget(b"x" * 3, 0)]), bad, "ops[0].forget.hash", "3 bytes")
            await _expect(c.apply([Forget(GOOD, -2)]), bad, "ops[0].forget.block_id", "-2")
            await _expect(c.apply([Forget(GOOD, 8)]), bad, "ops[0].forget.block_id", "8",
                          "0..7")
            await _expect(c.apply([Evict(0)], seq=1 << 53), bad, "seq", str(1 << 53))
        async with test_certs.aio_channel(index_server.target, ENGINE_ROLE, INDEX_ROLE) as channel:
            stub = pb_grpc.PrefixIndexStub(channel)
            op = pb.Op(acquire=pb.AcquireOp(chain=[GOOD], kind=7))
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Apply(pb.ApplyRequest(engine_id=engine_id, epoch=c.epoch, ops=[op]),
                                 timeout=5)
            assert err.value.code() == bad
            assert "ops[0].acquire.kind: 7" in err.value.details()
            assert "0 (ADMISSION)" in err.value.details()
    asyncio.run(body())
