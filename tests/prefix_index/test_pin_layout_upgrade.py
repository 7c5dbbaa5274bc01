"""An index upgraded over a live Redis (issue 34 review). The previous version kept explicit
pins per block: 'e' in `pin` and each block's own expiry in `pinexp`, with no pin records
(`pins`, `cover`). The whole-pin scripts read `pinexp` as pin names and unpin by records, so
that state's pins could never be unpinned nor lapse: the blocks stayed pinned for the rest of
the registration. Such a registration is refused instead (NOT_FOUND, register again): the
engine re-registers, which drops the old state, and re-states its pins whole."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import redis

from prefix_index.api.client import PrefixIndexClientError
from prefix_index.api.ops import Pin, Release, Unpin
from prefix_index.server.keys import engine_keys
from tests.prefix_index.chains import commit_ops, make_chain

POOL = 40


def _to_previous_layout(url: str, engine_id: str) -> None:
    """Rewrites the engine's pins as the previous version stored them: every pinned block
    keeps its 'e', its pin's expiry goes under the block's own hash, the records go."""
    meta, pin, pinexp, pins, cover = engine_keys(
        engine_id, ("meta", "pin", "pinexp", "pins", "cover"))
    with redis.Redis.from_url(url) as raw:
        expiries = {name: score for name, score in raw.zrange(pinexp, 0, -1, withscores=True)}
        records = raw.hgetall(pins)
        raw.delete(pinexp, pins, cover)
        for name, packed in records.items():
            for i in range(0, len(packed), 16):
                if name in expiries:
                    raw.zadd(pinexp, {packed[i:i + 16]: expiries[name]})
        # What the previous Register wrote: no layout mark.
        raw.hdel(meta, "pin_layout")
        assert set(raw.hvals(pin)) == {b"e"}


def test_a_registration_with_per_block_pins_is_told_to_register_again(
        redis_server, index_server, engine_id, test_certs):
    async def body():
        async with test_certs.index_client(index_server.target, 5.0) as c:
            await c.register(engine_id, "m", 16, POOL, 30)
            chain = make_chain("upgrade", 6)
            await c.apply(commit_ops(chain, 0) + [Release(chain)])
            [untimed] = await c.apply([Pin(chain[:3])])
            [timed] = await c.apply([Pin(chain[3:], ttl_s=0.05)])
            assert untimed.ok and timed.ok
            _to_previous_layout(redis_server.url, engine_id)
            time.sleep(0.1)  # the old per-block expiry is due
            # Read as whole pins, the unpin dropped nothing and the lapsed pin stayed pinned.
            with pytest.raises(PrefixIndexClientError) as err:
                await c.apply([Unpin(chain[:3])])
            assert err.value.code == grpc.StatusCode.NOT_FOUND
            assert "register again" in err.value.details
            with pytest.raises(PrefixIndexClientError) as err:
                await c.heartbeat()
            assert err.value.code == grpc.StatusCode.NOT_FOUND
            # Register drops the old state: nothing pinned, nothing held; pins work whole.
            await c.register(engine_id, "m", 16, POOL, 30)
            s = (await c.stats())[0]
            assert (s.blocks, s.pinned) == (0, 0)
            await c.apply(commit_ops(chain, 0) + [Release(chain)])
            [again] = await c.apply([Pin(chain[:3])])
            [gone] = await c.apply([Unpin(chain[:3])])
            assert again.count == 3 and gone.count == 3
    asyncio.run(body())
