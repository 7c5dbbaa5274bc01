"""Register with a per-process nonce: a second live process with the same engine id is refused
(ALREADY_EXISTS, with the engine id and when the holder's lease runs out) instead of the two
fencing each other forever; the holder itself may re-register (a reconnect)."""

from __future__ import annotations

import asyncio
import re
import time

import grpc
import pytest

from prefix_index.api.client import PrefixIndexClient, PrefixIndexClientError
from prefix_index.api.ops import Acquire, Release
from tests.prefix_index.chains import commit_ops, make_chain

# Long enough that the holder's register and apply finish inside it on a loaded machine.
LAPSING_LEASE_S = 3.0


def test_a_second_process_with_the_same_engine_id_is_refused(index_server, engine_id, test_certs):
    async def body():
        first = test_certs.index_client(index_server.target, 5.0)
        second = test_certs.index_client(index_server.target, 5.0)  # another process: own channel
        epoch = await first.register(engine_id, "m", 16, 32, 30, nonce="process-a")
        chain = make_chain("mine", 3)
        await first.apply(commit_ops(chain, 0))

        with pytest.raises(PrefixIndexClientError) as err:
            await second.register(engine_id, "m", 16, 32, 30, nonce="process-b")
        assert err.value.code == grpc.StatusCode.ALREADY_EXISTS
        assert repr(engine_id) in err.value.details
        expires_in = float(re.search(r"expires in ([\d.]+)s", err.value.details).group(1))
        assert 20 < expires_in <= 30
        assert "process-a" not in err.value.details     # the holder's token is not handed out

        # The refused register changed nothing: the holder keeps its epoch and its blocks.
        [acq] = await first.apply([Acquire(chain)])
        assert acq.block_ids == [0, 1, 2]
        assert (await first.stats())[0].epoch == epoch

        # A client with no nonce makes no claim and cannot take over a claimed id either.
        legacy = test_certs.index_client(index_server.target, 5.0)
        with pytest.raises(PrefixIndexClientError) as err:
            await legacy.register(engine_id, "m", 16, 32, 30)
        assert err.value.code == grpc.StatusCode.ALREADY_EXISTS

        # The holder reconnecting (same nonce) gets a new epoch, as before.
        again = await first.register(engine_id, "m", 16, 32, 30, nonce="process-a")
        assert again > epoch
        [acq] = await first.apply([Acquire(chain)])
        assert acq.block_ids == []                      # re-sync starts from nothing
        for c in (first, second, legacy):
            await c.close()
    asyncio.run(body())


def test_the_id_is_free_once_the_holders_lease_runs_out(index_server, engine_id, test_certs):
    """A holder that registered no serving address cannot be asked: its lease must lapse."""
    async def body():
        first = test_certs.index_client(index_server.target, 5.0)
        second = test_certs.index_client(index_server.target, 5.0)
        await first.register(engine_id, "m", 16, 8, LAPSING_LEASE_S, nonce="old-container")
        chain = make_chain("old", 2)
        await first.apply(commit_ops(chain, 0) + [Release(chain)])
        with pytest.raises(PrefixIndexClientError) as err:
            await second.register(engine_id, "m", 16, 8, LAPSING_LEASE_S, nonce="new-container")
        assert err.value.code == grpc.StatusCode.ALREADY_EXISTS
        # The old process stops heartbeating; the newcomer gets in once its lease lapsed.
        epoch = await register_when_free(second, engine_id, "new-container")
        [acq] = await second.apply([Acquire(chain)])
        assert acq.block_ids == []
        # Now the old one is the intruder: its calls are fenced and it may not take over.
        with pytest.raises(PrefixIndexClientError) as err:
            await first.heartbeat()
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(PrefixIndexClientError) as err:
            await first.register(engine_id, "m", 16, 8, 30, nonce="old-container")
        assert err.value.code == grpc.StatusCode.ALREADY_EXISTS
        assert (await second.stats())[0].epoch == epoch
        await first.close()
        await second.close()
    asyncio.run(body())


async def register_when_free(client: PrefixIndexClient, engine_id: str, nonce: str,
                             timeout_s: float = 30.0) -> int:
    """Registers as soon as the index lets `nonce` in (a condition, not a wall-clock bound)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return await client.register(engine_id, "m", 16, 8, 30, nonce=nonce)
        except PrefixIndexClientError as error:
            if error.code != grpc.StatusCode.ALREADY_EXISTS or time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.1)


def test_ids_registered_without_a_nonce_keep_the_old_takeover(index_server, engine_id,
                                                              test_certs):
    """Clients from before the nonce: Register stays an unconditional takeover among them. On
    a TLS index the certificate is part of every claim (authorize.py folds it into the nonce),
    so a nonce-less registration is its certificate's: a process with a nonce cannot take it
    while its lease lives (on plain text an empty nonce claimed nothing)."""
    async def body():
        async with test_certs.index_client(index_server.target, 5.0) as a, \
                test_certs.index_client(index_server.target, 5.0) as b:
            first = await a.register(engine_id, "m", 16, 8, 30)
            second = await b.register(engine_id, "m", 16, 8, 30)
            assert second > first
            with pytest.raises(PrefixIndexClientError) as err:
                await a.heartbeat()
            assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
            with pytest.raises(PrefixIndexClientError) as err:
                await a.register(engine_id, "m", 16, 8, 30, nonce="claims-it")
            assert err.value.code == grpc.StatusCode.ALREADY_EXISTS
            assert (await b.stats())[0].epoch == second     # the holder keeps its lease
    asyncio.run(body())


def test_a_nonce_too_long_is_refused(index_server, engine_id, test_certs):
    async def body():
        async with test_certs.index_client(index_server.target, 5.0) as c:
            with pytest.raises(PrefixIndexClientError) as err:
                await c.register(engine_id, "m", 16, 8, 30, nonce="x" * 129)
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "nonce" in err.value.details and "128" in err.value.details
    asyncio.run(body())
