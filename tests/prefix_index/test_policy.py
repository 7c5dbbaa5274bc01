"""The index policy through the real gRPC server and a real Redis: LRU, leaf-first eviction,
pins, refcounts, commit refusals, epoch fencing, lease expiry, hot pinning within its budget."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import redis

from prefix_index.api.client import PrefixIndexClient, PrefixIndexClientError
from prefix_index.api.ops import (
    Acquire,
    Commit,
    Evict,
    OpStatus,
    Pin,
    PinState,
    Release,
    Unpin,
)
from prefix_index.tools.launch import IndexProcess
from tests.prefix_index.chains import commit_ops, make_chain
from tests.prefix_index.conftest import HOT_THRESHOLD, ONE_CERTIFICATE
from tests.support.tls import SessionCerts


def run(coro):
    return asyncio.run(coro)


async def _registered(certs: SessionCerts, target: str, engine_id: str, num_blocks: int = 64,
                      lease_s: float = 30.0) -> PrefixIndexClient:
    client = certs.index_client(target, timeout_s=5.0)
    await client.register(engine_id, "test-model", 16, num_blocks, lease_s)
    return client


def test_lru_order_among_released_blocks(index_server, engine_id, test_certs):
    async def body():
        async with await _registered(test_certs, index_server.target, engine_id) as c:
            a, b, d = make_chain("a", 1), make_chain("b", 1), make_chain("d", 1)
            await c.apply(commit_ops(a, 0) + commit_ops(b, 1) + commit_ops(d, 2))
            # Release order b, d, a; then touch b again (acquire + release): LRU = d, a, b.
            await c.apply([Release(b), Release(d), Release(a), Acquire(b), Release(b)])
            [r] = await c.apply([Evict(3)])
            assert [e.block_id for e in r.evicted] == [2, 0, 1]
            assert [e.hash for e in r.evicted] == [d[0], a[0], b[0]]
    run(body())


def test_eviction_is_leaf_first_within_a_chain(index_server, engine_id, test_certs):
    async def body():
        async with await _registered(test_certs, index_server.target, engine_id) as c:
            chain = make_chain("doc", 4)
            await c.apply(commit_ops(chain, 10))
            # Release root first so it is the least recently used; still the leaf goes first.
            await c.apply([Release(chain)])
            [one] = await c.apply([Evict(1)])
            assert [e.block_id for e in one.evicted] == [13]
            [rest] = await c.apply([Evict(10)])
            assert [e.block_id for e in rest.evicted] == [12, 11, 10]
            # A branch keeps its parent: the shared root survives while a child is held.
            trunk = make_chain("trunk", 2)
            branch = trunk[:1] + make_chain("branch", 1)
            await c.apply(commit_ops(trunk, 0) + [Commit(branch[1], trunk[0], 5)])
            await c.apply([Release(trunk), Release(branch[1:])])
            [r] = await c.apply([Evict(2)])
            assert sorted(e.block_id for e in r.evicted) == [1, 5]
            assert (await c.stats())[0].blocks == 1
    run(body())


def test_blocks_in_use_or_pinned_are_never_evicted(index_server, engine_id, test_certs):
    async def body():
        async with await _registered(test_certs, index_server.target, engine_id) as c:
            used, pinned, free = make_chain("u", 2), make_chain("p", 2), make_chain("f", 2)
            await c.apply(commit_ops(used, 0) + commit_ops(pinned, 2) + commit_ops(free, 4))
            [pin] = await c.apply([Pin(pinned)])
            assert pin.status == OpStatus.OK and pin.count == 2
            await c.apply([Release(pinned), Release(free)])  # `used` keeps refcount 1
            [r] = await c.apply([Evict(6)])
            assert sorted(e.block_id for e in r.evicted) == [4, 5]
            [again] = await c.apply([Evict(6)])
            assert again.evicted == []
            [unpin, ev] = await c.apply([Unpin(pinned), Evict(6)])
            assert unpin.count == 2
            assert [e.block_id for e in ev.evicted] == [3, 2]
            s = (await c.stats())[0]
            assert (s.blocks, s.evictable, s.pinned, s.evictions) == (2, 0, 0, 4)
    run(body())


def test_refcounts_never_go_negative(index_server, engine_id, test_certs):
    async def body():
        async with await _registered(test_certs, index_server.target, engine_id) as c:
            chain = make_chain("r", 2)
            await c.apply(commit_ops(chain, 0))
            [acq] = await c.apply([Acquire(chain)])
            assert acq.block_ids == [0, 1]                     # refcount 2 each
            ok1, ok2, bad = await c.apply([Release(chain), Release(chain), Release(chain)])
            assert (ok1.status, ok2.status) == (OpStatus.OK, OpStatus.OK)
            assert bad.status == OpStatus.REFCOUNT_ZERO and bad.count == 0
            assert chain[0].hex() in bad.detail
            # The refused release changed nothing: one acquire needs exactly one release.
            await c.apply([Acquire(chain)])
            r1, r2 = await c.apply([Release(chain), Release(chain[1:])])
            assert r1.status == OpStatus.OK and r1.count == 2
            assert r2.status == OpStatus.REFCOUNT_ZERO
            [missing] = await c.apply([Release(make_chain("never", 1))])
            assert missing.status == OpStatus.NOT_HELD
    run(body())


def test_commit_refusals(index_server, engine_id, test_certs):
    async def body():
        async with await _registered(test_certs, index_server.target, engine_id) as c:
            x, y = make_chain("x", 2), make_chain("y", 1)
            await c.apply(commit_ops(x, 0))
            in_use, exists, same, orphan = await c.apply([
                Commit(y[0], b"", 1),               # block 1 still maps to x[1]
                Commit(x[0], b"", 7),               # x[0] is held in block 0
                Commit(x[0], b"", 0),               # retry of the same commit
                Commit(y[0], make_chain("z", 1)[0], 9),  # parent never committed
            ])
            assert in_use.status == OpStatus.BLOCK_IN_USE
            assert exists.status == OpStatus.HASH_EXISTS and exists.block_ids == [0]
            assert same.status == OpStatus.ALREADY_COMMITTED
            assert orphan.status == OpStatus.NOT_HELD
            # Once x's blocks are evicted, block 1 may hold another hash.
            await c.apply([Release(x)])
            [ev, ok] = await c.apply([Evict(2), Commit(y[0], b"", 1)])
            assert len(ev.evicted) == 2 and ok.status == OpStatus.OK
    run(body())


def test_stale_epoch_is_fenced(index_server, engine_id, test_certs):
    async def body():
        old = await _registered(test_certs, index_server.target, engine_id)
        chain = make_chain("fence", 3)
        await old.apply(commit_ops(chain, 0))
        # The engine restarts: a new registration drops what the old epoch held.
        new = await _registered(test_certs, index_server.target, engine_id)
        assert new.epoch > old.epoch
        for call in (old.apply([Acquire(chain)]), old.heartbeat()):
            with pytest.raises(PrefixIndexClientError) as err:
                await call
            assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert str(old.epoch) in err.value.details
        [acq] = await new.apply([Acquire(chain)])
        assert acq.block_ids == []                              # never told it holds them
        await old.close()
        await new.close()
    run(body())


async def eventually(condition, what: str, timeout_s: float = 30.0) -> None:
    """Polls the coroutine function `condition`; fails only if it never holds."""
    deadline = time.monotonic() + timeout_s
    while not await condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s}s"
        await asyncio.sleep(0.1)


# Leases and TTLs of seconds: a loaded machine can hold a test a good part of a second
# between two calls; what must lapse is waited for, not slept over.
LEASE_S = 3.0


def test_lease_expiry_drops_the_engine(index_server, engine_id, test_certs):
    async def body():
        c = await _registered(test_certs, index_server.target, engine_id, lease_s=LEASE_S)
        chain = make_chain("lease", 2)
        await c.apply(commit_ops(chain, 0))
        alive_until = time.monotonic() + 1.5 * LEASE_S
        while time.monotonic() < alive_until:   # heartbeats keep it alive past its lease
            await asyncio.sleep(LEASE_S / 10)
            assert await c.heartbeat() == pytest.approx(LEASE_S)
        [acq] = await c.apply([Acquire(chain)])
        assert acq.block_ids == [0, 1]

        async def gone() -> bool:               # then silence: the lease runs out
            return all(m.engine_id != engine_id for m in await c.lookup(chain))

        await eventually(gone, "the engine dropped once its lease ran out")
        with pytest.raises(PrefixIndexClientError) as err:
            await c.apply([Acquire(chain)])
        assert err.value.code == grpc.StatusCode.NOT_FOUND
        await c.register(engine_id, "test-model", 16, 64, LEASE_S)
        [acq] = await c.apply([Acquire(chain)])
        assert acq.block_ids == []
        await c.close()
    run(body())


def test_hot_blocks_pin_themselves_within_the_budget(index_server, engine_id, test_certs):
    async def body():
        # Pool 16 at a 0.25 budget: at most 4 pinned blocks.
        async with await _registered(test_certs, index_server.target, engine_id,
                                     num_blocks=16) as c:
            assert c.pin_budget == 4
            hot = make_chain("hot", 3)
            await c.apply(commit_ops(hot, 0) + [Release(hot)])
            for _ in range(HOT_THRESHOLD - 1):
                await c.apply([Acquire(hot), Release(hot)])
            assert (await c.stats())[0].pinned == 0             # one hit short
            await c.apply([Acquire(hot), Release(hot)])
            s = (await c.stats())[0]
            assert (s.pinned, s.auto_pinned, s.evictable) == (3, 3, 0)
            [ev] = await c.apply([Evict(16)])
            assert ev.evicted == []                             # hot blocks stay
            # Another hot chain: only one pin left in the budget, so only its first block.
            warm = make_chain("warm", 3)
            await c.apply(commit_ops(warm, 3) + [Release(warm)])
            for _ in range(HOT_THRESHOLD + 2):
                await c.apply([Acquire(warm), Release(warm)])
            s = (await c.stats())[0]
            assert (s.pinned, s.auto_pinned) == (4, 4)
            [ev] = await c.apply([Evict(16)])
            assert [e.block_id for e in ev.evicted] == [5, 4]
            # Explicit pins count against the same budget, and take it from automatic pins:
            # the least recently used goes (hot's, used before warm's).
            cold = make_chain("cold", 1)
            await c.apply(commit_ops(cold, 8))
            await c.apply_batch([])  # (the pin changes so far)
            reply = await c.apply_batch([Pin(cold)])
            assert reply.results[0].status == OpStatus.OK
            changes = {(ch.hash, ch.state) for ch in reply.pin_changes}
            assert (cold[0], PinState.EXPLICIT) in changes and len(changes) == 2
            [(displaced, _)] = changes - {(cold[0], PinState.EXPLICIT)}
            assert displaced in hot
            s = (await c.stats())[0]
            assert (s.pinned, s.auto_pinned) == (4, 3)
            # Only explicit pins left: a further explicit pin is refused, and changes nothing.
            more = make_chain("more", 3)
            await c.apply(commit_ops(more, 9))
            [ok] = await c.apply([Pin(more)])
            assert ok.status == OpStatus.OK and ok.count == 3
            last = make_chain("last", 1)
            await c.apply(commit_ops(last, 12))
            [refused] = await c.apply([Pin(last)])
            assert refused.status == OpStatus.PIN_BUDGET_EXCEEDED
            s = (await c.stats())[0]
            assert (s.pinned, s.auto_pinned) == (4, 0)
            [unpinned, pinned] = await c.apply([Unpin(more), Pin(last)])
            assert unpinned.count == 3 and pinned.status == OpStatus.OK
    run(body())


def test_pin_ttl_expires(index_server, engine_id, test_certs):
    async def body():
        async with await _registered(test_certs, index_server.target, engine_id) as c:
            chain = make_chain("ttl", 2)
            await c.apply(commit_ops(chain, 0) + [Release(chain), Pin(chain, ttl_s=LEASE_S)])
            [ev] = await c.apply([Evict(2)])
            assert ev.evicted == []
            evicted = []

            async def pin_lapsed() -> bool:     # an Evict changes nothing while it holds
                [ev] = await c.apply([Evict(2)])
                evicted.extend(e.block_id for e in ev.evicted)
                return bool(evicted)

            await eventually(pin_lapsed, "the pin's TTL ran out")
            assert evicted == [1, 0]
    run(body())


def test_lookup_finds_the_longest_prefix_per_engine(index_server, engine_id, test_certs):
    async def body():
        chain = make_chain(f"shared-{engine_id}", 4)
        a = await _registered(test_certs, index_server.target, engine_id + "-a")
        b = await _registered(test_certs, index_server.target, engine_id + "-b")
        await a.apply(commit_ops(chain[:2], 0))
        await b.apply(commit_ops(chain, 0))
        before = (await a.stats())[0]
        matches = {m.engine_id: m.matched_blocks for m in await a.lookup(chain)}
        assert matches[engine_id + "-a"] == 2 and matches[engine_id + "-b"] == 4
        ranked = [m.engine_id for m in await a.lookup(chain) if m.engine_id.startswith(engine_id)]
        assert ranked == [engine_id + "-b", engine_id + "-a"]
        assert await a.lookup(chain, model_identity="other-model") == []
        after = (await a.stats())[0]
        assert (after.queries, after.hits) == (before.queries, before.hits)  # read-only
        await a.close()
        await b.close()
    run(body())


def test_cooled_blocks_are_unpinned(redis_server, engine_id, test_certs):
    """A short window: a block pinned while hot is unpinned by the sweeper once it cools
    (its estimate halves 1.5 windows after its hits: seconds after the check that it is
    pinned)."""
    args = ["--hot-threshold", "2", "--hot-window-s", "2", "--sweep-interval-s", "0.1",
            "--pin-budget-fraction", "0.5", "--log-level", "WARNING"]

    async def body(target):
        async with await _registered(test_certs, target, engine_id, num_blocks=8) as c:
            chain = make_chain("cool", 1)
            await c.apply(commit_ops(chain, 0) + [Release(chain)])
            await c.apply([Acquire(chain), Release(chain), Acquire(chain), Release(chain)])
            assert (await c.stats())[0].auto_pinned == 1

            async def cooled() -> bool:
                return not (await c.stats())[0].auto_pinned

            await eventually(cooled, "the block unpinned as it cooled")
            s = (await c.stats())[0]
            assert (s.auto_pinned, s.evictable) == (0, 1)

    with IndexProcess(redis_server.url, [*args, *ONE_CERTIFICATE],
                      tls=test_certs.files("index")) as index:
        run(body(index.target))


def test_scripts_reload_after_noscript(redis_server, index_server, engine_id, test_certs):
    """SCRIPT FLUSH (as after a Redis restart or failover): EVALSHA gets NOSCRIPT, the server
    loads the script again and the call succeeds."""

    async def body():
        async with await _registered(test_certs, index_server.target, engine_id) as c:
            chain = make_chain("noscript", 2)
            await c.apply(commit_ops(chain, 0))
            with redis.Redis.from_url(redis_server.url) as raw:
                raw.script_flush()
                assert raw.script_exists("0" * 40) == [False]
            [acq] = await c.apply([Acquire(chain)])
            assert acq.block_ids == [0, 1]
            assert await c.heartbeat() == pytest.approx(30.0)
    run(body())


def test_long_chains_past_the_script_slice_size(index_server, engine_id, test_certs):
    """Chains longer than the scripts' argument slices (2000) behave like short ones."""
    async def body():
        async with await _registered(test_certs, index_server.target, engine_id,
                                     num_blocks=5000) as c:
            chain = make_chain("long", 4500)
            commits = commit_ops(chain, 0)              # at most 4096 ops per Apply
            results = await c.apply(commits[:3000]) + await c.apply(commits[3000:])
            assert all(r.ok for r in results)
            [acq] = await c.apply([Acquire(chain + make_chain("tail", 3))])
            assert acq.block_ids == list(range(4500))
            [rel] = await c.apply([Release(chain[::-1])])
            [rel2] = await c.apply([Release(chain[::-1])])
            assert (rel.count, rel2.count) == (4500, 4500)
            [ev] = await c.apply([Evict(2500)])
            assert [e.block_id for e in ev.evicted] == list(range(4499, 1999, -1))
            s = (await c.stats())[0]
            assert (s.blocks, s.evictable, s.queries, s.hits) == (2000, 2000, 4503, 4500)
    run(body())
