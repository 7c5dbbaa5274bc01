"""Engines register where they serve Generation; the index's Stats is the router's replica
list. A malformed address is refused, naming the field."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from prefix_index.api.client import PrefixIndexClientError

LEASE_S = 3.0  # seconds: a loaded machine can hold the test a good part of one between calls


def test_the_serving_address_is_listed_until_the_lease_lapses(index_server, engine_id, test_certs):
    async def body():
        client = test_certs.index_client(index_server.target, 5.0)
        await client.register(engine_id, "m", 16, 32, LEASE_S, nonce="a",
                              serving_address="engine-host.local:50051")
        [mine] = await client.stats(engine_id)
        assert mine.serving_address == "engine-host.local:50051"
        everyone = {s.engine_id: s.serving_address for s in await client.stats("")}
        assert everyone[engine_id] == "engine-host.local:50051"
        # Re-registering (a restart on another port) replaces it.
        await client.register(engine_id, "m", 16, 32, LEASE_S, nonce="a",
                              serving_address="[::1]:6000")
        assert (await client.stats(engine_id))[0].serving_address == "[::1]:6000"
        # No heartbeat: the lease lapses, the replica is gone (waited for, not slept over).
        deadline = time.monotonic() + LEASE_S + 30
        while engine_id in {s.engine_id for s in await client.stats("")}:
            assert time.monotonic() < deadline, "still listed long after its lease lapsed"
            await asyncio.sleep(0.1)
        await client.close()

    asyncio.run(body())


@pytest.mark.parametrize("address", ["no-port", "host:port", "a b:1", "h:" + "1" * 6,
                                     "x" * 300 + ":1"])
def test_a_malformed_address_is_refused(index_server, engine_id, address, test_certs):
    async def body():
        client = test_certs.index_client(index_server.target, 5.0)
        with pytest.raises(PrefixIndexClientError) as err:
            await client.register(engine_id, "m", 16, 32, 1, serving_address=address)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "serving_address" in err.value.details
        await client.close()

    asyncio.run(body())


def test_stats_of_every_engine_with_hundreds_registered(index_server, engine_id, test_certs):
    """What a router's discovery asks every second; it once opened one Redis connection per
    engine at once and failed with 'Too many connections' past the pool's limit."""
    async def body():
        client = test_certs.index_client(index_server.target, 10.0)
        for i in range(300):
            await client.register(f"{engine_id}-{i}", "m", 16, 8, 30, nonce="many",
                                  serving_address=f"replica-{i}:50051")
        listed = {s.engine_id: s.serving_address for s in await client.stats("")}
        assert all(listed[f"{engine_id}-{i}"] == f"replica-{i}:50051" for i in range(300))
        await client.close()

    asyncio.run(body())
