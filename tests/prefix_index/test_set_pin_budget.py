"""The engine's pin budget (SetPinBudgetOp, issue 34): it replaces Register's, the automatic
pins and the explicit pins' check follow it, shrinking it unpins automatic pins (least hot
first, a chain's leaf before its root) down to it and never an explicit pin, and an engine
that never sends one keeps Register's budget."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from prefix_index.api.client import PrefixIndexClientError
from prefix_index.api.ops import Acquire, OpStatus, Pin, PinState, Release, SetPinBudget
from tests.prefix_index.chains import commit_ops, make_chain
from tests.prefix_index.conftest import HOT_THRESHOLD, PIN_BUDGET_FRACTION

POOL = 40  # Register's budget at the test fraction (0.25): 10 blocks


async def _heat(c, chain: list[bytes], times: int):
    """`times` admissions of a held chain; the last reply."""
    reply = None
    for _ in range(times):
        reply = await c.apply_batch([Acquire(chain), Release(chain)])
    return reply


def test_the_engine_budget_replaces_registers_and_auto_pins_follow_it(
        index_server, engine_id, test_certs):
    async def body():
        async with test_certs.index_client(index_server.target, 5.0) as c:
            await c.register(engine_id, "m", 16, POOL, 30)
            assert c.pin_budget == int(PIN_BUDGET_FRACTION * POOL) == 10
            hot = make_chain("hot", 16)  # longer than Register's budget
            await c.apply(commit_ops(hot, 0) + [Release(hot)])
            await _heat(c, hot, HOT_THRESHOLD)
            s = (await c.stats())[0]
            assert (s.pin_budget, s.auto_pinned) == (10, 10)  # Register's budget caps it

            [grown] = await c.apply([SetPinBudget(20)])
            assert grown.ok and grown.count == 0
            await _heat(c, hot, 1)  # the next admission pins the rest of the chain
            s = (await c.stats())[0]
            assert (s.pin_budget, s.auto_pinned, s.pinned) == (20, 16, 16)

            # Shrinking: the six hash uses counted least lately go first. Every hash of the
            # chain was used as often; the leaf side has the older history ticks.
            reply = await c.apply_batch([SetPinBudget(6)])
            assert reply.results[0].count == 10
            unpinned = {p.hash for p in reply.pin_changes if p.state == PinState.NONE}
            assert unpinned == set(hot[6:])
            s = (await c.stats())[0]
            assert (s.pin_budget, s.auto_pinned) == (6, 6)
            # The unpinned leaves are evictable again; the pinned root is not.
            assert s.evictable == 10
    asyncio.run(body())


def test_shrinking_keeps_explicit_pins_and_drops_the_least_hot_automatic_ones(
        index_server, engine_id, test_certs):
    async def body():
        async with test_certs.index_client(index_server.target, 5.0) as c:
            await c.register(engine_id, "m", 16, POOL, 30)
            warm, hotter, ordered = (make_chain("warm", 3), make_chain("hotter", 3),
                                     make_chain("ordered", 4))
            await c.apply(commit_ops(warm, 0) + commit_ops(hotter, 3) + commit_ops(ordered, 6)
                          + [Release(warm), Release(hotter), Release(ordered)])
            [pinned] = await c.apply([Pin(ordered)])  # explicit, no TTL
            assert pinned.ok and pinned.count == 4
            await _heat(c, warm, HOT_THRESHOLD)
            await _heat(c, hotter, HOT_THRESHOLD + 3)
            s = (await c.stats())[0]
            assert (s.pinned, s.auto_pinned) == (10, 6)

            reply = await c.apply_batch([SetPinBudget(7)])
            assert reply.results[0].count == 3
            assert {p.hash: p.state for p in reply.pin_changes} == {
                h: PinState.NONE for h in warm}

            # Below the explicit pins alone: every automatic pin goes, the explicit ones stay,
            # and no new pin is made while they pass the budget.
            reply = await c.apply_batch([SetPinBudget(2)])
            assert reply.results[0].count == 3
            s = (await c.stats())[0]
            assert (s.pin_budget, s.pinned, s.auto_pinned) == (2, 4, 0)
            [refused] = await c.apply([Pin(warm)])
            assert refused.status == OpStatus.PIN_BUDGET_EXCEEDED
            reply = await _heat(c, warm, 2)
            assert not reply.pin_changes
            assert (await c.stats())[0].auto_pinned == 0
    asyncio.run(body())


def test_a_budget_past_the_pool_is_refused_and_changes_nothing(
        index_server, engine_id, test_certs):
    async def body():
        async with test_certs.index_client(index_server.target, 5.0) as c:
            await c.register(engine_id, "m", 16, POOL, 30)
            with pytest.raises(PrefixIndexClientError) as refused:
                await c.apply([SetPinBudget(POOL + 1)])
            assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "set_pin_budget.blocks: 41" in refused.value.details
            assert "0..40" in refused.value.details
            assert (await c.stats())[0].pin_budget == 10
            [whole] = await c.apply([SetPinBudget(POOL)])
            assert whole.ok and (await c.stats())[0].pin_budget == POOL
            # Register starts from the index's own budget again.
            await c.register(engine_id, "m", 16, POOL, 30)
            assert (await c.stats())[0].pin_budget == 10
    asyncio.run(body())
