"""The prefix index's quotas (issue 32), on the real index over mutual TLS and a real Redis:
junk registrations, Apply floods, squatted residency watchers, oversized pools and leases are
refused (RESOURCE_EXHAUSTED / INVALID_ARGUMENT, the message naming the quota), while a
legitimate engine still registers and writes and a router (the router's own IndexView) still
discovers engines and keeps its residency copy synced."""

from __future__ import annotations

import asyncio
import itertools
import shutil
import time
import uuid
from pathlib import Path

import grpc
import pytest
import redis

from pagedgen_api import prefix_index_pb2 as pb
from pagedgen_api import prefix_index_pb2_grpc as pb_grpc
from prefix_index.api.retry_after import retry_after_s
from prefix_index.tools.launch import IndexProcess
from prefix_index.tools.redis_process import RedisProcess
from router.config import RouterConfig
from router.index_view import IndexView
from tests.trust.conftest import files, make_certs
from trust.credentials import TlsMaterial, channel_options

MODEL = "tiny-model@1"
MAX_OPS = 256
_databases = itertools.count(8)  # each index of this module on a Redis database of its own


def quota_index(redis_server, certs, *flags: str) -> IndexProcess:
    """An index on a fresh Redis database (nothing another test registered counts)."""
    url = redis_server.url.rsplit("/", 1)[0] + f"/{next(_databases)}"
    return IndexProcess(url, ["--log-level", "WARNING", "--grace-s", "1",
                              "--max-ops", str(MAX_OPS), *flags], tls=files(certs, "index"))


def stub(index: IndexProcess, tls: TlsMaterial) -> pb_grpc.PrefixIndexStub:
    # A local subchannel pool: a connection of its own, not one shared with other stubs.
    options = [*channel_options("index"), ("grpc.use_local_subchannel_pool", 1)]
    channel = grpc.secure_channel(index.target, tls.channel_credentials(), options=options)
    return pb_grpc.PrefixIndexStub(channel)


def register(s, engine_id: str, num_blocks: int = 64, lease_s: float = 30,
             address: str = "") -> int:
    return s.Register(pb.RegisterRequest(engine_id=engine_id, model_identity=MODEL, block_size=16,
                                         num_blocks=num_blocks, lease_s=lease_s,
                                         nonce="n-" + engine_id, serving_address=address),
                      timeout=10).epoch


def refusal(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


def commits(n: int, start: int = 0) -> list[pb.Op]:
    return [pb.Op(commit=pb.CommitOp(hash=(start + i).to_bytes(16, "little"),
                                     parent=(start + i - 1).to_bytes(16, "little") if i else b"",
                                     block_id=start + i))
            for i in range(n)]


def second_router_certificate(certs: Path, out: Path) -> TlsMaterial:
    """Another router's certificate from the same CA (another identity of the same role)."""
    out.mkdir()
    for name in ("ca.pem", "ca-key.pem"):
        shutil.copy(certs / name, out / name)
    make_certs(out, "--router")
    return files(out, "router").load()


def test_junk_registrations_are_refused_past_the_quotas(redis_server, certs):
    with quota_index(redis_server, certs, "--max-engines", "12",
                     "--max-engines-per-identity", "10") as index:
        junk = stub(index, files(certs, "engine").load())  # a certificate naming no engine id
        accepted, refused = 0, []
        for _ in range(2000):
            try:
                register(junk, f"junk-{uuid.uuid4().hex[:12]}")
                accepted += 1
            except grpc.RpcError as error:
                refused.append(error)
        assert accepted == 10
        assert {e.code() for e in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert "--max-engines-per-identity 10" in refused[0].details()

        # Other identities still register, heartbeat and write, up to the total.
        engine_a = stub(index, files(certs, "engine-engine-a").load())
        epoch = register(engine_a, "engine-a")
        engine_a.Heartbeat(pb.HeartbeatRequest(engine_id="engine-a", epoch=epoch), timeout=10)
        engine_a.Apply(pb.ApplyRequest(engine_id="engine-a", epoch=epoch, ops=commits(4)),
                       timeout=10)
        register(stub(index, files(certs, "engine-engine-b").load()), "engine-b")
        full = refusal(lambda: register(stub(index, files(certs, "engine-engine-c").load()),
                                        "engine-c"))
        assert full.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-engines 12" in full.details()
        # Registering again under a live id adds no engine: allowed at the quota.
        assert register(engine_a, "engine-a") > epoch

        # The router's discovery, with its own deadline, reads every engine at the quota.
        router_tls = files(certs, "router").load()

        async def discover() -> tuple[dict[str, str] | None, list]:
            view = IndexView(index.target, RouterConfig().lookup_timeout_s, router_tls)
            try:
                return await view.engines(), await view.client.stats("")
            finally:
                await view.close()

        addresses, stats = asyncio.run(discover())
        assert addresses is not None, "the router's discovery failed at the engine quota"
        assert len(stats) == 12 and "engine-a" in {s.engine_id for s in stats}


def test_a_lapsed_lease_frees_its_slot(redis_server, certs):
    with quota_index(redis_server, certs, "--max-engines", "1") as index:
        junk = stub(index, files(certs, "engine").load())
        register(junk, "short-lived", lease_s=0.5)
        engine_a = stub(index, files(certs, "engine-engine-a").load())
        assert refusal(lambda: register(engine_a, "engine-a")).code() == \
            grpc.StatusCode.RESOURCE_EXHAUSTED
        deadline = time.monotonic() + 30
        while True:
            try:
                register(engine_a, "engine-a")
                break
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert time.monotonic() < deadline, "the lapsed lease's slot never freed"
                time.sleep(0.2)


def test_pool_and_lease_bounds_at_register(redis_server, certs):
    with quota_index(redis_server, certs, "--max-num-blocks", "4096",
                     "--max-lease-s", "120") as index:
        engine_a = stub(index, files(certs, "engine-engine-a").load())
        too_big = refusal(lambda: register(engine_a, "engine-a", num_blocks=4097))
        assert too_big.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "num_blocks: 4097" in too_big.details() and "1..4096" in too_big.details()
        too_long = refusal(lambda: register(engine_a, "engine-a", lease_s=86400))
        assert too_long.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "lease_s: 86400" in too_long.details() and "120" in too_long.details()
        assert register(engine_a, "engine-a", num_blocks=4096, lease_s=120) > 0


def test_a_full_resync_passes_a_flood_is_refused_and_the_engine_recovers(redis_server, certs):
    num_blocks = 1024
    with quota_index(redis_server, certs, "--max-num-blocks", str(num_blocks),
                     "--apply-ops-per-s", "200") as index:
        engine_a = stub(index, files(certs, "engine-engine-a").load())

        def apply(epoch: int, ops: list[pb.Op]) -> pb.ApplyResponse:
            return engine_a.Apply(pb.ApplyRequest(engine_id="engine-a", epoch=epoch, ops=ops),
                                  timeout=10)

        for _ in range(2):  # a re-sync after each registration passes whole
            epoch = register(engine_a, "engine-a", num_blocks=num_blocks)
            # As an engine re-syncs its largest pool: a commit per block, a pin per block
            # (pins past the budget are refused per op, and count as ops all the same).
            resync = commits(num_blocks)
            resync += [pb.Op(pin=pb.PinOp(chain=[op.commit.hash])) for op in resync]
            for start in range(0, len(resync), MAX_OPS):
                reply = apply(epoch, resync[start:start + MAX_OPS])
                assert all(r.status == pb.OP_STATUS_OK for op, r in
                           zip(resync[start:start + MAX_OPS], reply.results, strict=True)
                           if op.HasField("commit"))

        lookup = pb.AcquireOp(chain=[b"\x07" * 16], kind=pb.ACQUIRE_KIND_FORK)
        lookups = [pb.Op(acquire=lookup)] * MAX_OPS
        flood: list[grpc.RpcError] = []
        for _ in range(20):
            try:
                apply(epoch, lookups)
            except grpc.RpcError as error:
                flood.append(error)
                break
        assert flood, "20 Applies of 256 ops right after a re-sync were all accepted"
        assert flood[0].code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--apply-ops-per-s 200" in flood[0].details()
        # ... and says when the same Apply passes, for the engine's link to wait that long.
        named = retry_after_s(flood[0].trailing_metadata())
        assert named is not None and 0 < named <= MAX_OPS / 200 + 0.001

        deadline = time.monotonic() + 60
        while True:  # the bucket refills at 200 ops/s: the same write passes in time
            try:
                reply = apply(epoch, lookups)
                break
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert time.monotonic() < deadline, "the Apply rate never recovered"
                time.sleep(0.25)
        stats = stub(index, files(certs, "router").load()).Stats(
            pb.StatsRequest(engine_id="engine-a"), timeout=10)
        assert len(reply.results) == MAX_OPS
        assert stats.engines[0].blocks == num_blocks  # the re-sync is whole


def test_squatted_watchers_leave_a_real_router_its_watch(redis_server, certs, tmp_path):
    with quota_index(redis_server, certs, "--max-watchers-per-connection", "2",
                     "--max-watchers-per-identity", "3") as index:
        squatter_tls = files(certs, "router").load()
        held: list = []

        def watch(s) -> grpc.RpcError | None:
            """Opens a watch on `s` and holds it; its refusal when refused."""
            call = s.WatchResidency(pb.WatchResidencyRequest())
            try:
                next(call)  # the first snapshot event (or the refusal)
            except grpc.RpcError as error:
                return error
            held.append(call)
            return None

        try:
            squatter = stub(index, squatter_tls)
            assert watch(squatter) is None and watch(squatter) is None
            per_connection = watch(squatter)
            assert per_connection.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-watchers-per-connection 2" in per_connection.details()
            assert watch(stub(index, squatter_tls)) is None
            refused = [watch(stub(index, squatter_tls)) for _ in range(10)]
            assert all(e is not None and e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                       for e in refused)
            assert "--max-watchers-per-identity 3" in refused[0].details()

            # A real router (another certificate) still watches and stays kv-aware.
            router_tls = second_router_certificate(certs, tmp_path / "router-2")
            engine_a = stub(index, files(certs, "engine-engine-a").load())
            asyncio.run(_router_sees_a_commit(index, router_tls, engine_a))
        finally:
            for call in held:
                call.cancel()


async def _router_sees_a_commit(index: IndexProcess, router_tls: TlsMaterial,
                                engine_a: pb_grpc.PrefixIndexStub) -> None:
    view = IndexView(index.target, RouterConfig().lookup_timeout_s, router_tls)
    watching = asyncio.create_task(view.watch())
    try:
        assert await view.engines() is not None  # discovery reached it: view.up
        epoch = register(engine_a, "engine-a")
        block = b"\x42" * 16
        engine_a.Apply(pb.ApplyRequest(engine_id="engine-a", epoch=epoch, ops=[
            pb.Op(commit=pb.CommitOp(hash=block, block_id=0))]), timeout=10)
        deadline = time.monotonic() + 30
        while view.held_prefixes_now([block], MODEL) != {"engine-a": 1}:
            assert view.watch_failures == 0, "the router's residency watch was refused"
            assert time.monotonic() < deadline, "the router's copy never showed the commit"
            await asyncio.sleep(0.05)
    finally:
        watching.cancel()
        await view.close()


def test_a_full_redis_is_resource_exhausted_and_the_index_recovers(certs):
    """Redis at its maxmemory with noeviction refuses writes ("OOM command not allowed"): the
    index says RESOURCE_EXHAUSTED, and serves again once memory is there."""
    with RedisProcess(extra_args=["--maxmemory-policy", "noeviction"]) as redis_process:
        admin = redis.Redis.from_url(redis_process.url)
        with IndexProcess(redis_process.url, ["--log-level", "ERROR", "--grace-s", "1"],
                          tls=files(certs, "index")) as index:
            engine_a = stub(index, files(certs, "engine-engine-a").load())
            epoch = register(engine_a, "engine-a", num_blocks=4096)
            used = int(admin.info("memory")["used_memory"])
            admin.config_set("maxmemory", used + 64 * 1024)
            full = None
            for start in range(0, 4096, MAX_OPS):
                try:
                    engine_a.Apply(pb.ApplyRequest(engine_id="engine-a", epoch=epoch,
                                                   ops=commits(MAX_OPS, start)), timeout=10)
                except grpc.RpcError as error:
                    full = error
                    break
            assert full is not None, "4096 commits fit in 64 KiB more of Redis"
            assert full.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, full.details()
            assert "redis is full" in full.details() and "maxmemory" in full.details()
            admin.config_set("maxmemory", 0)
            # The refused write changed nothing (one script); it passes whole now.
            reply = engine_a.Apply(pb.ApplyRequest(engine_id="engine-a", epoch=epoch,
                                                   ops=commits(MAX_OPS, start)), timeout=10)
            assert all(r.status == pb.OP_STATUS_OK for r in reply.results)
        admin.close()


def test_the_routers_discovery_works_at_the_default_engine_quota(redis_server, certs):
    """1,024 engines (the default --max-engines) registered: Stats("") over all of them is
    answered within the router's discovery deadline (a first call that misses it still
    finishes, and the next is served from it)."""
    with quota_index(redis_server, certs, "--max-engines-per-identity", "1024") as index:
        junk = stub(index, files(certs, "engine").load())
        for i in range(1024):
            register(junk, f"many-{i}", lease_s=600, address=f"127.0.0.1:{20000 + i}")
        over = refusal(lambda: register(junk, "one-more"))
        assert over.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-engines 1024" in over.details()
        router_tls = files(certs, "router").load()

        async def discover() -> dict[str, str]:
            view = IndexView(index.target, RouterConfig().lookup_timeout_s, router_tls)
            try:
                for _ in range(20):  # the router's discovery loop asks again each interval
                    addresses = await view.engines()
                    if addresses is not None:
                        return addresses
                    await asyncio.sleep(0.2)
                raise AssertionError(f"discovery failed 20 times: {view.last_error}")
            finally:
                await view.close()

        addresses = asyncio.run(discover())
        assert len(addresses) == 1024 and addresses["127.0.0.1:20000"] == "many-0"
