"""The router's credit for chains it just routed (router/pending.py) and the home bonus, over
replicas with set loads and an index answer given by the test (no processes: what is tested is
the router's own bookkeeping; the real index and engines are in test_routing.py)."""

from __future__ import annotations

import asyncio
import random
import time

from engine_service.core.block_hash import BlockHasher
from pagedgen_api import generation_pb2 as pb
from router.config import RouterConfig
from router.core import Router
from router.pending import PendingPrefixes
from router.policies import Policies, RouteInput, rendezvous_order
from router.replicas import Replica, ReportedLoad

BLOCK = 16


class AnsweringIndex:
    """Stands in for router/index_view.py: up, and holding nothing unless told."""

    up = True
    target = "test"

    def __init__(self) -> None:
        self.matches: dict[str, int] = {}

    def held_prefixes_now(self, chain, identity) -> dict[str, int]:
        return dict(self.matches)

    async def longest_prefixes(self, chain, identity) -> dict[str, int]:
        return dict(self.matches)

    async def close(self) -> None:
        pass


def make_router(engine_ids: list[str]) -> tuple[Router, list[Replica]]:
    router = Router(RouterConfig(), ["127.0.0.1:1"], None)
    router.index = AnsweringIndex()
    replicas = []
    for i, engine_id in enumerate(engine_ids):
        replica = Replica(f"127.0.0.1:{7000 + i}", engine_id)
        replica.healthy, replica.info = True, pb.ModelInfoResponse()
        replicas.append(replica)
    router.replicas.replicas = {r.address: r for r in replicas}
    router.replicas.hasher = BlockHasher.for_identity("m", BLOCK)
    return router, replicas


def tokens(seed: int, n: int = 34 * BLOCK) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def test_a_routed_chain_is_credited_but_not_counted_as_cached():
    async def body():
        router, _ = make_router(["e0", "e1"])
        ids = tokens(1)
        first = await router.route(ids, "", set())
        second = await router.route(ids[: 33 * BLOCK] + [5] * BLOCK, "", set())
        assert second.decision.replica is first.decision.replica
        assert second.decision.matched_blocks == 33  # steers the choice ...
        assert second.index_matched_blocks == 0  # ... but the index has not seen it cached
    asyncio.run(body())


def test_a_replica_that_failed_the_request_keeps_no_credit_for_it():
    async def body():
        router, _ = make_router(["e0", "e1"])
        ids = tokens(2)
        first = await router.route(ids, "", set())
        router.forget_pending(first)  # what the proxy does when it fails before any output
        retry = await router.route(ids, "", {first.decision.replica.address})
        assert retry.decision.replica is not first.decision.replica
        after = await router.route(ids[: 33 * BLOCK] + [5] * BLOCK, "", set())
        assert after.decision.replica is retry.decision.replica
        assert after.decision.matched_blocks == 33
    asyncio.run(body())


def test_an_engine_restarted_at_the_same_address_inherits_no_credit():
    async def body():
        router, _ = make_router(["e0", "e1"])
        ids = tokens(3)
        routed = (await router.route(ids, "", set())).decision.replica
        routed.engine_id = "e0-restarted" if routed.engine_id == "e0" else "e1-restarted"
        again = await router.route(ids, "", set())
        credited = again.decision.matched_blocks if again.decision.replica is routed else 0
        assert credited == 0
    asyncio.run(body())


class AnsweringEngine:
    """A replica's stub that answers polls, as the process `instance_id`."""

    def __init__(self, engine_id: str, instance_id: str) -> None:
        self.engine_id, self.instance_id = engine_id, instance_id

    async def ModelInfo(self, request, timeout):  # noqa: N802 (the gRPC method's name)
        return pb.ModelInfoResponse(engine_id=self.engine_id, model_identity="m",
                                    block_size=BLOCK, num_blocks=128,
                                    instance_id=self.instance_id)

    async def EngineStats(self, request, timeout):  # noqa: N802
        return pb.EngineStatsResponse(num_blocks=128, num_free_blocks=128)


def test_only_an_engine_restarted_under_the_same_id_loses_credit_and_recent_prefixes():
    """A replica polled while up, or back after an outage as the same process, keeps the
    chains routed there and the prefixes counted in its pool; one that answers as a new
    process (a restart empties the pool) keeps neither, and the other replica keeps its own."""
    async def body():
        router, replicas = make_router(["e0", "e1"])
        e0, e1 = replicas
        e0.info = pb.ModelInfoResponse(engine_id="e0", model_identity="m", block_size=BLOCK,
                                       instance_id="first")
        e0.stub = AnsweringEngine("e0", "first")
        router.index.matches = {"e0": 34}  # e0 holds the first prompt, e1 the second
        assert (await router.route(tokens(1), "", set())).decision.replica is e0
        router.index.matches = {"e1": 34}
        assert (await router.route(tokens(2), "", set())).decision.replica is e1
        now = time.monotonic()

        def kept() -> tuple[bool, bool]:
            return ((e0.address, "e0") in router.pending,
                    e0.name in router.recent_prefixes.blocks_of_others(None, now))

        await router.replicas.poll(e0)  # up all along
        assert kept() == (True, True)
        e0.mark_down("DEADLINE_EXCEEDED: a slow poll")
        await router.replicas.poll(e0)  # back, the same process
        assert e0.healthy and kept() == (True, True)
        e0.mark_down("UNAVAILABLE: connection refused")
        e0.stub = AnsweringEngine("e0", "second")
        await router.replicas.poll(e0)  # back, a new process
        assert e0.healthy and kept() == (False, False)
        assert (e1.address, "e1") in router.pending
        assert e1.name in router.recent_prefixes.blocks_of_others(None, now)
        router.index.matches = {}  # the index no longer says e0 holds it either
        assert (await router.route(tokens(1), "", set())).decision.matched_blocks == 0
    asyncio.run(body())


def test_an_unknown_process_under_a_known_name_loses_the_recent_prefixes_too():
    """The other ways a new process shows up: an engine that sends no instance_id (older ones)
    back after an outage; the engine id at an address changed by discovery; and the same id
    at a new address (a new replica object, first heard from)."""
    async def body():
        router, (e0, e1) = make_router(["e0", "e1"])
        now = time.monotonic()

        def held() -> set[str]:
            return set(router.recent_prefixes.blocks_of_others(None, now))

        for replica in (e0, e1):
            router.recent_prefixes.add(replica.name, bytes([len(replica.name)]) * 8, 34, now)
        e0.stub = AnsweringEngine("e0", "")  # an older engine: no instance_id
        e0.info = await e0.stub.ModelInfo(None, 1.0)
        await router.replicas.poll(e0)
        assert held() == {"e0", "e1"}  # up all along: nothing asked, nothing dropped
        e0.mark_down("UNAVAILABLE: connection refused")
        await router.replicas.poll(e0)
        assert held() == {"e1"}  # back, and it cannot say whether it is the same process

        router.recent_prefixes.add("e9", b"n" * 8, 34, now)
        e1.stub = AnsweringEngine("e9", "x")
        await router.replicas.set_members({e0.address: "e0", e1.address: "e9"})
        assert e1.name == "e9" and not e1.routable  # not routed to before it says who it is
        assert "asking its ModelInfo" in e1.last_error  # (what the router's status shows)
        await router.replicas.poll(e1)
        # e9's stale prefixes go; e1's stay under a name no replica has now (they age out,
        # and a replica that takes the name later drops them when first heard from).
        assert e1.routable and held() == {"e1"}

        router.recent_prefixes.add("e0", b"m" * 8, 34, now)
        await router.replicas.set_members({"127.0.0.1:7100": "e0", e1.address: "e9"})
        moved = router.replicas.replicas["127.0.0.1:7100"]
        moved.stub = AnsweringEngine("e0", "z")
        await router.replicas.poll(moved)
        assert moved.routable and "e0" not in held()
    asyncio.run(body())


def test_no_credit_is_kept_for_a_replica_without_an_engine_id_and_old_credit_goes():
    async def body():
        router, replicas = make_router(["", "e1"])
        for n in range(200):
            await router.route(tokens(n), "", set())
        assert all(key[1] for key in router.pending)  # never keyed by an empty engine id
    asyncio.run(body())
    pending = PendingPrefixes(ttl_s=5.0)
    for n in range(100):  # a replica that is never asked about: add() alone keeps it bounded
        pending.add([bytes([n % 256, n // 256]) * 8], now=float(n))
    assert len(pending) == 5


def test_the_home_bonus_never_beats_a_replica_holding_more_of_the_prefix():
    replicas = []
    for i in range(2):
        r = Replica.__new__(Replica)  # no channel: policies read only names and loads
        r.address, r.engine_id = f"127.0.0.1:{5000 + i}", f"engine-{i}"
        r.in_flight, r.pending_prefill_tokens, r.pending_prompt_tokens = 0, 0, 0
        r.prefilled_prompt_tokens = r.reported_after_prefilled = 0
        r.reported = ReportedLoad()
        r.num_finished = r.reported_after_finished = 0
        replicas.append(r)
    for n in range(50):
        key = bytes([n]) * 16
        home = rendezvous_order(key, replicas)[0]
        holder = next(r for r in replicas if r is not home)
        route = RouteInput(34 * BLOCK, key, {holder.engine_id: 7})  # 7 blocks held elsewhere
        decision = Policies(RouterConfig()).choose("kv-aware", replicas, route, BLOCK)
        assert decision.replica is holder, n


def test_routes_count_in_the_replicas_shares_but_a_pin_route_does_not():
    """Router.route records each routed request's replica (the hot-replica cost's input) and
    hands the shares to the policy; a route with record=False (PinPrefix) is not traffic."""
    async def body():
        router, replicas = make_router(["e0", "e1", "e2"])
        router.config.hot_replica_weight = 2.0  # (off by default)
        router.index.matches = {"e1": 34}  # e1 holds the prompt: every request goes there
        ids = tokens(7)
        for _ in range(10):
            assert (await router.route(ids, "", set())).decision.replica is replicas[1]
        await router.route(ids, "", set(), record=False)
        shares = router.recent.shares(time.monotonic())
        assert shares == {replicas[1].name: 1.0} and len(router.recent) == 10
        # A prompt nobody holds, whose rendezvous home is e1 (it goes there with the weight
        # 0), goes past the replica that took all of them.
        router.index.matches = {}
        assert (await router.route(tokens(14), "", set())).decision.replica is not replicas[1]
    asyncio.run(body())
