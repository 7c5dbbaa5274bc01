"""Overlapping explicit pins at the index are whole pins (issue 34 review): a pin is named by
the last hash of the chain it was asked for, a block stays pinned while any live pin covers
it, unpinning or the lapse of one pin leaves the blocks another pin covers pinned, and each
pin keeps its own expiry. Before, the index kept one pin flag and one expiry per block: the
undo of a refused longer pin unpinned a shorter pin's blocks, and a longer pin's TTL replaced
a shorter no-TTL pin's, which then lapsed."""

from __future__ import annotations

import asyncio
import time

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
from tests.prefix_index.chains import commit_ops, make_chain
from tests.prefix_index.conftest import HOT_THRESHOLD

POOL = 40


async def _pin_states(c) -> dict[bytes, PinState]:
    """What an empty Apply reports: the pin changes since the previous one (expiry included,
    applied at the start of every Apply)."""
    reply = await c.apply_batch([])
    return {change.hash: change.state for change in reply.pin_changes}


def test_undoing_a_longer_pin_keeps_the_shorter_pins_blocks(index_server, engine_id,
                                                              test_certs):
    """The engine's PinPrefix pins what is cached of a long prompt at once, computes the rest,
    and unpins that chain when the pin is refused after all (prefix_index users: the
    servicer's undo). An earlier pin of a shorter prefix of it must stay whole."""
    async def body():
        async with test_certs.index_client(index_server.target, 5.0) as c:
            await c.register(engine_id, "m", 16, POOL, 30)
            chain = make_chain("long", 8)
            await c.apply(commit_ops(chain[:5], 0) + [Release(chain[:5])])
            [short] = await c.apply([Pin(chain[:3])])
            assert short.ok and short.count == 3
            # The longer pin: its cached part (5 blocks) pinned first, then undone.
            [partial] = await c.apply([Pin(chain)])
            assert partial.ok and partial.count == 5
            [undo] = await c.apply([Unpin(chain)])
            assert undo.ok and undo.count == 2, "only the blocks no other pin covers"
            s = (await c.stats())[0]
            assert s.pinned == 3
            # The short pin's blocks were never reported unpinned; the long one's were.
            reply = await c.apply_batch([])
            assert not reply.pin_changes
            # The short pin is still a pin of its own: unpinning it frees its blocks.
            [gone] = await c.apply([Unpin(chain[:3])])
            assert gone.ok and gone.count == 3
            assert (await c.stats())[0].pinned == 0
    asyncio.run(body())


def test_a_longer_pins_ttl_leaves_a_shorter_untimed_pin(index_server, engine_id, test_certs):
    async def body():
        async with test_certs.index_client(index_server.target, 5.0) as c:
            await c.register(engine_id, "m", 16, POOL, 30)
            chain = make_chain("ttl", 6)
            await c.apply(commit_ops(chain, 0) + [Release(chain)])
            [untimed] = await c.apply([Pin(chain[:2])])  # until unpinned
            [timed] = await c.apply([Pin(chain, ttl_s=0.2)])
            assert untimed.ok and timed.ok and timed.count == 6
            await _pin_states(c)
            # The timed pin lapses (polled with a generous deadline; no wall-clock assertion).
            deadline = time.monotonic() + 30.0
            changes: dict[bytes, PinState] = {}
            while (await c.stats())[0].pinned != 2:
                assert time.monotonic() < deadline, "the timed pin never lapsed"
                changes.update(await _pin_states(c))
                await asyncio.sleep(0.05)
            changes.update(await _pin_states(c))
            assert changes == {h: PinState.NONE for h in chain[2:]}
            # The untimed pin's blocks stay pinned: not evictable, whatever is asked for.
            [evicted] = await c.apply([Evict(POOL)])
            assert {e.hash for e in evicted.evicted} == set(chain[2:])
            assert (await c.stats())[0].pinned == 2
    asyncio.run(body())


def test_pinning_again_keeps_the_later_expiry(index_server, engine_id, test_certs):
    """The same pin (same chain) again: the later expiry holds, never the earlier; an untimed
    pin stays untimed when renewed with a TTL."""
    async def body():
        async with test_certs.index_client(index_server.target, 5.0) as c:
            await c.register(engine_id, "m", 16, POOL, 30)
            chain = make_chain("again", 3)
            await c.apply(commit_ops(chain, 0) + [Release(chain)])
            await c.apply([Pin(chain)])
            [renewed] = await c.apply([Pin(chain, ttl_s=0.05)])
            assert renewed.ok and renewed.count == 3
            await asyncio.sleep(0.2)
            assert not await _pin_states(c)
            assert (await c.stats())[0].pinned == 3
    asyncio.run(body())


def test_pins_past_the_pool_size_are_refused(index_server, engine_id, test_certs):
    """Each pin is a record: their number is bounded (one per pool block), so names that
    cover nothing new cannot grow the index without end."""
    async def body():
        async with test_certs.index_client(index_server.target, 5.0) as c:
            pool = 4
            await c.register(engine_id, "m", 16, pool, 30)
            chain = make_chain("bound", 1)
            await c.apply(commit_ops(chain, 0) + [Release(chain)])
            results = await c.apply([Pin(chain + make_chain(f"name{i}", 1))
                                     for i in range(pool + 1)])
            assert [r.status for r in results[:pool]] == [OpStatus.OK] * pool
            assert results[pool].status == OpStatus.PIN_BUDGET_EXCEEDED
            assert "pins" in results[pool].detail
    asyncio.run(body())


def test_a_sub_millisecond_ttl_still_lapses(index_server, engine_id, test_certs):
    """A TTL under half a millisecond was rounded to 0 ms on its way to the script, which
    reads 0 as 'until unpinned': the shortest pins became the longest (the engine's mirror,
    which keeps the TTL as given, let them lapse; the index never did)."""
    async def body():
        async with test_certs.index_client(index_server.target, 5.0) as c:
            await c.register(engine_id, "m", 16, POOL, 30)
            chain = make_chain("tiny-ttl", 3)
            await c.apply(commit_ops(chain, 0) + [Release(chain)])
            [pinned] = await c.apply([Pin(chain, ttl_s=0.0004)])
            assert pinned.ok and pinned.count == 3
            await asyncio.sleep(0.05)  # past any expiry it can have (at least 1 ms)
            assert await _pin_states(c) == {h: PinState.NONE for h in chain}
            assert (await c.stats())[0].pinned == 0
    asyncio.run(body())


def test_freeing_an_automatic_pin_keeps_an_explicit_pin_of_that_name(index_server, engine_id,
                                                                       test_certs):
    """An explicit pin made before its chain's last block was held is named by a hash it does
    not cover. When that block is later pinned automatically (hot) and the engine frees it for
    a lone request (release_pins), the unpin asks for automatic pins only: the explicit pin of
    the same name stays whole. Before, the engine sent a plain Unpin named by the block's hash,
    which dropped that explicit pin with it (issue 34 review)."""
    async def body():
        async with test_certs.index_client(index_server.target, 5.0) as c:
            await c.register(engine_id, "m", 16, POOL, 30)
            chain = make_chain("collide", 3)
            await c.apply(commit_ops(chain[:2], 0) + [Release(chain[:2])])
            [explicit] = await c.apply([Pin(chain)])  # named chain[2], covers chain[:2]
            assert explicit.ok and explicit.count == 2
            await c.apply([Commit(chain[2], chain[1], 2), Release(chain[2:])])
            for _ in range(HOT_THRESHOLD):  # chain[2] turns hot: pinned automatically
                await c.apply([Acquire(chain), Release(chain)])
            s = (await c.stats())[0]
            assert (s.pinned, s.auto_pinned) == (3, 1)
            [freed] = await c.apply([Unpin(chain[2:], automatic_only=True)])
            assert freed.ok and freed.count == 1
            s = (await c.stats())[0]
            assert (s.pinned, s.auto_pinned) == (2, 0), "the explicit pin of that name stays"
            # A plain unpin of that name is the explicit pin's own: it drops it.
            [gone] = await c.apply([Unpin(chain[2:])])
            assert gone.ok and gone.count == 2
            assert (await c.stats())[0].pinned == 0
    asyncio.run(body())
