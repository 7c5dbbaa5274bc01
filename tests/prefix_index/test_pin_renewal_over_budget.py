"""At the index, pinning a held prefix again (a longer TTL) adds no pin, so a budget that
shrank below the explicit pins does not refuse it (issue 34 review): the shrink kept them,
and one that could not be renewed would lapse because of it. A pin adding blocks is still
refused past the budget. The engine side is tests/engine/test_pin_refresh_over_budget.py."""

from __future__ import annotations

import asyncio

from prefix_index.api.ops import OpStatus, Pin, Release, SetPinBudget
from tests.prefix_index.chains import commit_ops, make_chain

POOL = 40


def test_a_pin_is_renewed_below_a_shrunk_budget(index_server, engine_id, test_certs):
    async def body():
        async with test_certs.index_client(index_server.target, 5.0) as c:
            await c.register(engine_id, "m", 16, POOL, 30)
            pinned, other = make_chain("renewed", 6), make_chain("other", 2)
            await c.apply(commit_ops(pinned, 0) + commit_ops(other, 6)
                          + [Release(pinned), Release(other)])
            [grown] = await c.apply([SetPinBudget(20)])
            assert grown.ok
            [first] = await c.apply([Pin(pinned, ttl_s=60.0)])
            assert first.ok and first.count == 6
            [shrunk] = await c.apply([SetPinBudget(4)])
            assert shrunk.ok and shrunk.count == 0  # explicit pins stay
            [renewed] = await c.apply([Pin(pinned, ttl_s=600.0)])
            assert renewed.status == OpStatus.OK, renewed.detail
            assert renewed.count == 6
            [more] = await c.apply([Pin(other)])
            assert more.status == OpStatus.PIN_BUDGET_EXCEEDED
            s = (await c.stats())[0]
            assert (s.pinned, s.auto_pinned, s.pin_budget) == (6, 0, 4)
    asyncio.run(body())
