"""A crashed engine restarted under its id is registered at once; a live twin is still refused.

The index asks the lease holder's serving address for ModelInfo: the holder's own instance id
there means a live twin (refused); another instance, a refused connection or another service
means the holder is gone (the newcomer takes the lease over, the holder's blocks leave the index
at once); no answer in time, or a holder that registered no address or instance id, leaves it to
the lease. The holders here are real gRPC servers answering ModelInfo over loopback, each
standing in for one engine process; tests/router/test_crash_restart.py does the same with real
engines killed by SIGKILL.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import pytest

from pagedgen_api import generation_pb2 as gen_pb
from pagedgen_api import generation_pb2_grpc as gen_grpc
from prefix_index.api.client import PrefixIndexClient, PrefixIndexClientError
from prefix_index.api.ops import Acquire
from prefix_index.tools.redis_process import free_port
from tests.prefix_index.chains import commit_ops, make_chain
from tests.support.tls import SessionCerts
from trust.identity import ENGINE_ROLE, INDEX_ROLE


def engine_credentials(certs: SessionCerts) -> grpc.ServerCredentials:
    return certs.material(ENGINE_ROLE).server_credentials(require_client_cert=True)


class OneProcess(gen_grpc.GenerationServicer):
    """What an engine process answers ModelInfo with: its engine id and instance id."""

    def __init__(self, engine_id: str, instance_id: str) -> None:
        self.engine_id = engine_id
        self.instance_id = instance_id

    async def ModelInfo(self, request, context) -> gen_pb.ModelInfoResponse:
        return gen_pb.ModelInfoResponse(engine_id=self.engine_id, instance_id=self.instance_id)


@asynccontextmanager
async def process_at(certs: SessionCerts, port: int, engine_id: str, instance_id: str
                     ) -> AsyncIterator[str]:
    """An engine process's Generation port: mutual TLS on an engine certificate, as the index's
    probe (on the index's certificate) expects."""
    server = grpc.aio.server()
    gen_grpc.add_GenerationServicer_to_server(OneProcess(engine_id, instance_id), server)
    bound = server.add_secure_port(f"127.0.0.1:{port}", engine_credentials(certs))
    assert bound == port
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)  # no goodbye: as the kernel closes a SIGKILLed process's ports


async def register(client: PrefixIndexClient, engine_id: str, nonce: str, address: str,
                   instance_id: str) -> int:
    return await client.register(engine_id, "m", 16, 32, 30, nonce=nonce,
                                 serving_address=address, instance_id=instance_id,
                                 timeout_s=10.0)


async def refused(client: PrefixIndexClient, engine_id: str, nonce: str, address: str,
                  instance_id: str) -> str:
    with pytest.raises(PrefixIndexClientError) as err:
        await register(client, engine_id, nonce, address, instance_id)
    assert err.value.code == grpc.StatusCode.ALREADY_EXISTS, err.value
    return err.value.details


async def held_by(client: PrefixIndexClient, engine_id: str, chain: list[bytes]) -> int:
    """How many leading blocks of `chain` Lookup credits to engine_id."""
    matches = {m.engine_id: m.matched_blocks for m in await client.lookup(chain)}
    return matches.get(engine_id, 0)


def test_a_process_restarted_at_the_holders_address_takes_over_at_once(index_server, engine_id,
                                                                       test_certs):
    async def body():
        port = free_port("127.0.0.1")
        old, new, router = (test_certs.index_client(index_server.target, 5.0) for _ in range(3))
        chain = make_chain("crash", 3)
        async with process_at(test_certs, port, engine_id, "instance-old") as address:
            epoch = await register(old, engine_id, "nonce-old", address, "instance-old")
            await old.apply(commit_ops(chain, 0))
            assert await held_by(router, engine_id, chain) == 3
        # SIGKILL: the old process is gone without a word; its lease has ~30 s left. The
        # restarted process serves at the same address (a container restart keeps it).
        async with process_at(test_certs, port, engine_id, "instance-new"):
            new_epoch = await register(new, engine_id, "nonce-new", address, "instance-new")
            assert new_epoch > epoch
            # The dead process's blocks left the index with its lease.
            assert await held_by(router, engine_id, chain) == 0
            [acq] = await new.apply([Acquire(chain)])
            assert acq.block_ids == []
            # The old process, were it somehow alive, is fenced, and may not take the id back:
            # the new holder answers at the address.
            with pytest.raises(PrefixIndexClientError) as err:
                await old.heartbeat()
            assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
            details = await refused(old, engine_id, "nonce-old", address, "instance-old")
            assert "instance-new still answers" in details
            assert (await new.stats(engine_id))[0].epoch == new_epoch
        for client in (old, new, router):
            await client.close()
    asyncio.run(body())


def test_a_live_twin_is_refused_and_changes_nothing(index_server, engine_id, test_certs):
    async def body():
        holder, twin = (test_certs.index_client(index_server.target, 5.0) for _ in range(2))
        chain = make_chain("twin", 2)
        async with process_at(test_certs, free_port(), engine_id, "instance-a") as address, \
                process_at(test_certs, free_port(), engine_id, "instance-b") as twin_address:
            epoch = await register(holder, engine_id, "nonce-a", address, "instance-a")
            await holder.apply(commit_ops(chain, 0))
            details = await refused(twin, engine_id, "nonce-b", twin_address, "instance-b")
            assert repr(engine_id) in details and "instance-a still answers" in details
            assert "nonce-a" not in details  # the holder's token is not handed out
            [acq] = await holder.apply([Acquire(chain)])
            assert acq.block_ids == [0, 1]
            assert (await holder.stats(engine_id))[0].epoch == epoch
        for client in (holder, twin):
            await client.close()
    asyncio.run(body())


def test_a_holder_with_nothing_at_its_address_is_replaced(index_server, engine_id, test_certs):
    """The restarted process serves elsewhere (a new pod IP); nothing listens at the old one."""
    async def body():
        old, new = (test_certs.index_client(index_server.target, 5.0) for _ in range(2))
        async with process_at(test_certs, free_port(), engine_id, "instance-old") as address:
            epoch = await register(old, engine_id, "nonce-old", address, "instance-old")
        async with process_at(test_certs, free_port(), engine_id, "instance-new") as moved:
            assert await register(new, engine_id, "nonce-new", moved, "instance-new") > epoch
        for client in (old, new):
            await client.close()
    asyncio.run(body())


def test_a_holder_that_does_not_answer_keeps_its_lease(index_server, engine_id, test_certs):
    """A stalled process (SIGSTOP, a hung host) accepts connections and answers nothing: not
    proof of death, so the lease decides."""
    async def body():
        hung = socket.socket()
        hung.bind(("127.0.0.1", 0))
        hung.listen(8)  # the kernel accepts; nobody speaks HTTP/2
        address = f"127.0.0.1:{hung.getsockname()[1]}"
        old, new = (test_certs.index_client(index_server.target, 5.0) for _ in range(2))
        try:
            await register(old, engine_id, "nonce-old", address, "instance-old")
            details = await refused(new, engine_id, "nonce-new", "127.0.0.1:1", "instance-new")
            assert "did not answer ModelInfo" in details
        finally:
            hung.close()
            for client in (old, new):
                await client.close()
    asyncio.run(body())


def test_a_holder_that_registered_no_instance_id_keeps_its_lease(index_server, engine_id,
                                                                 test_certs):
    async def body():
        old, new = (test_certs.index_client(index_server.target, 5.0) for _ in range(2))
        dead = f"127.0.0.1:{free_port('127.0.0.1')}"  # nothing listens there
        await register(old, engine_id, "nonce-old", dead, "")
        await refused(new, engine_id, "nonce-new", dead, "instance-new")
        for client in (old, new):
            await client.close()
    asyncio.run(body())


def test_two_newcomers_racing_for_a_dead_holders_id_one_wins(index_server, engine_id, test_certs):
    async def body():
        clients = [test_certs.index_client(index_server.target, 5.0) for _ in range(3)]
        dead = f"127.0.0.1:{free_port('127.0.0.1')}"
        await register(clients[0], engine_id, "nonce-dead", dead, "instance-dead")
        async with process_at(test_certs, free_port(), engine_id, "instance-1") as first, \
                process_at(test_certs, free_port(), engine_id, "instance-2") as second:
            results = await asyncio.gather(
                register(clients[1], engine_id, "nonce-1", first, "instance-1"),
                register(clients[2], engine_id, "nonce-2", second, "instance-2"),
                return_exceptions=True)
            won = [r for r in results if isinstance(r, int)]
            lost = [r for r in results if isinstance(r, PrefixIndexClientError)]
            assert len(won) == 1 and len(lost) == 1, results
            assert lost[0].code == grpc.StatusCode.ALREADY_EXISTS
        for client in clients:
            await client.close()
    asyncio.run(body())


def test_an_instance_id_too_long_is_refused(index_server, engine_id, test_certs):
    async def body():
        async with test_certs.index_client(index_server.target, 5.0) as client:
            with pytest.raises(PrefixIndexClientError) as err:
                await register(client, engine_id, "n", "127.0.0.1:1", "x" * 129)
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "instance_id" in err.value.details and "128" in err.value.details
    asyncio.run(body())


class CountedProcess(OneProcess):
    """Counts ModelInfo calls and answers each only once released."""

    def __init__(self, engine_id: str, instance_id: str) -> None:
        super().__init__(engine_id, instance_id)
        self.calls = 0
        self.called = asyncio.Event()
        self.release = asyncio.Event()

    async def ModelInfo(self, request, context) -> gen_pb.ModelInfoResponse:
        self.calls += 1
        self.called.set()
        await self.release.wait()
        return await super().ModelInfo(request, context)


def test_registers_racing_under_one_id_share_one_probe_of_the_holder(test_certs):
    """Ten probes of one holder at once (Registers repeated under one id while the first is
    being decided) dial it once and all get its answer; a waiter that leaves does not cancel
    the probe the others wait for."""
    from prefix_index.server.holder_probe import HolderProber, HolderState

    async def body():
        holder = CountedProcess("engine-x", "instance-old")
        server = grpc.aio.server()
        gen_grpc.add_GenerationServicer_to_server(holder, server)
        port = server.add_secure_port("127.0.0.1:0", engine_credentials(test_certs))
        await server.start()
        address = f"127.0.0.1:{port}"
        try:
            prober = HolderProber(timeout_s=60.0, tls=test_certs.material(INDEX_ROLE))
            probes = [asyncio.create_task(prober.probe(address, "instance-old"))
                      for _ in range(10)]
            await asyncio.wait_for(holder.called.wait(), 60)
            probes[0].cancel()  # its Register's caller went away
            await asyncio.sleep(0)
            holder.release.set()
            results = await asyncio.gather(*probes[1:])
            assert holder.calls == 1
            assert {r.state for r in results} == {HolderState.ALIVE}
            assert probes[0].cancelled()
            # Once answered, the next Register probes afresh.
            assert (await prober.probe(address, "instance-old")).state is HolderState.ALIVE
            assert holder.calls == 2
        finally:
            await server.stop(None)

    asyncio.run(body())
