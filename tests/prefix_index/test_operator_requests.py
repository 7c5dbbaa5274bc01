"""What an operator calling the index by hand (grpcurl, the stubs) found answered wrongly: a
serving address on a port nobody can dial, an epoch the index never issued called "stale",
an unbounded Lookup filter, and a refusal's grammar. Real index and Redis (the session's)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pagedgen_api import prefix_index_pb2 as pb
from pagedgen_api import prefix_index_pb2_grpc as pb_grpc
from prefix_index.api.client import PrefixIndexClientError
from prefix_index.api.ops import Evict
from tests.prefix_index.chains import make_chain
from trust.identity import ENGINE_ROLE, INDEX_ROLE, ROUTER_ROLE


async def _refused(call) -> PrefixIndexClientError:
    with pytest.raises(PrefixIndexClientError) as err:
        await call
    return err.value


@pytest.mark.parametrize("address", ["engine-host:0", "engine-host:65536", "[::1]:70000",
                                     "10.0.0.1:99999"])
def test_a_serving_address_on_a_port_nobody_can_dial_is_refused(index_server, engine_id,
                                                                  test_certs, address):
    """The router dials what engines register: port 0 or past 65535 reaches nothing (it was
    listed as registered, and routed to)."""
    async def body():
        async with test_certs.index_client(index_server.target, 5.0) as client:
            error = await _refused(client.register(engine_id, "m", 16, 8, 30,
                                                   serving_address=address))
            assert error.code == grpc.StatusCode.INVALID_ARGUMENT, error
            for fragment in ("serving_address", repr(address), "1..65535"):
                assert fragment in error.details, (fragment, error.details)
            with pytest.raises(PrefixIndexClientError) as gone:
                await client.stats(engine_id)  # nothing was registered
            assert gone.value.code == grpc.StatusCode.NOT_FOUND
    asyncio.run(body())


@pytest.mark.parametrize("address", ["engine-host:1", "engine-host:65535", "[::1]:50051"])
def test_every_dialable_port_is_accepted(index_server, engine_id, test_certs, address):
    async def body():
        async with test_certs.index_client(index_server.target, 5.0) as client:
            await client.register(engine_id, "m", 16, 8, 30, serving_address=address)
            [stats] = await client.stats(engine_id)
            assert stats.serving_address == address
    asyncio.run(body())


def test_an_epoch_above_the_current_one_is_not_called_stale(index_server, engine_id,
                                                            test_certs):
    """Epochs only rise: one above the current was never returned by this Redis (or it lost
    the registration), and the engine did not re-register; an older one is stale, as before."""
    async def body():
        async with test_certs.index_client(index_server.target, 5.0) as client:
            epoch = await client.register(engine_id, "m", 16, 8, 30)
        async with test_certs.aio_channel(index_server.target, ENGINE_ROLE, INDEX_ROLE) as ch:
            stub = pb_grpc.PrefixIndexStub(ch)
            for future in (epoch + 1, (1 << 64) - 1):
                for call, request in (
                        (stub.Heartbeat, pb.HeartbeatRequest(engine_id=engine_id, epoch=future)),
                        (stub.Apply, pb.ApplyRequest(engine_id=engine_id, epoch=future,
                                                     ops=[pb.Op(evict=pb.EvictOp(k=0))]))):
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await call(request, timeout=5)
                    details = err.value.details()
                    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION, details
                    assert f"epoch {future} is newer than the current epoch {epoch}" in details
                    assert "stale" not in details and "re-registered" not in details, details
                    assert "register again" in details
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Heartbeat(pb.HeartbeatRequest(engine_id=engine_id, epoch=epoch - 1),
                                     timeout=5)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert f"epoch {epoch - 1} is stale; the current epoch is {epoch}" in \
                err.value.details()
            # The registration itself was untouched by the refusals.
            reply = await stub.Heartbeat(pb.HeartbeatRequest(engine_id=engine_id, epoch=epoch),
                                         timeout=5)
            assert reply.lease_s == 30
    asyncio.run(body())


def test_lookup_bounds_its_model_filter_as_register_does(index_server, engine_id, test_certs):
    """Register takes at most 1024 characters of model identity; Lookup's filter took any
    length (up to the message limit) and compared it against every engine."""
    async def body():
        chain = make_chain("filter", 1)
        async with test_certs.index_client(index_server.target, 5.0, ROUTER_ROLE) as router:
            error = await _refused(router.lookup(chain, "m" * 1025))
            assert error.code == grpc.StatusCode.INVALID_ARGUMENT, error
            for fragment in ("model_identity", "1025 characters", "1-1024"):
                assert fragment in error.details, (fragment, error.details)
            assert await router.lookup(chain, "m" * 1024) == []
            assert await router.lookup(chain, "") == []
    asyncio.run(body())


def test_a_refusal_by_role_reads_as_english(index_server, test_certs):
    async def body():
        async with test_certs.index_client(index_server.target, 5.0, ENGINE_ROLE) as engine:
            error = await _refused(engine.stats(""))
            assert error.code == grpc.StatusCode.PERMISSION_DENIED
            assert "Stats: an engine certificate may not call it; it is for routers" in \
                error.details, error.details
        async with test_certs.index_client(index_server.target, 5.0, ROUTER_ROLE) as router:
            error = await _refused(router.register("r", "m", 16, 8, 30))
            assert "Register: a router certificate may not call it" in error.details
            router.attach("r", 1)
            error = await _refused(router.apply([Evict(0)]))
            assert "Apply: a router certificate may not call it" in error.details
    asyncio.run(body())
