"""Apply sequence numbers: a retried Apply is applied once; a gap (writes Redis lost, e.g. a
restore from a snapshot) or a replay is refused with ABORTED, telling the engine to register
again and re-sync."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import redis

from prefix_index.api.client import PrefixIndexClient, PrefixIndexClientError
from prefix_index.api.ops import Acquire, Evict, OpStatus, Pin, PinState, Release
from prefix_index.server.keys import engine_keys
from tests.prefix_index.chains import commit_ops, make_chain
from tests.support.tls import SessionCerts


async def _registered(certs: SessionCerts, target: str, engine_id: str) -> PrefixIndexClient:
    client = certs.index_client(target, timeout_s=5.0)
    await client.register(engine_id, "m", 16, 32, 30, nonce="seq-test")
    return client


async def _refcount(c: PrefixIndexClient, chain: list[bytes]) -> int:
    """Releases the chain until refused: how many holders it had (it ends at refcount 0)."""
    released = 0
    while (await c.apply([Release(chain)]))[0].ok:
        released += 1
    return released


def test_a_duplicated_apply_is_applied_once(index_server, engine_id, test_certs):
    async def body():
        c = await _registered(test_certs, index_server.target, engine_id)
        chain = make_chain("dup", 3)
        await c.apply_batch(commit_ops(chain, 0) + [Pin(chain[:1])], seq=1)
        first = await c.apply_batch([Acquire(chain)], seq=2)
        assert not first.replayed and first.results[0].block_ids == [0, 1, 2]
        # The reply was lost (a timeout): the engine sends the very same Apply again.
        again = await c.apply_batch([Acquire(chain)], seq=2)
        assert again.replayed
        assert again.results[0].block_ids == [0, 1, 2]
        assert again.pin_changes == first.pin_changes
        assert (await c.stats())[0].hits == 3            # counted once, not twice
        # Numbering goes on from there; the acquire happened once: refcount 1 + 1.
        await c.apply_batch([Evict(0)], seq=3)
        assert await _refcount(c, chain) == 2
        await c.close()
    asyncio.run(body())


def test_the_same_seq_with_other_ops_is_refused(index_server, engine_id, test_certs):
    async def body():
        c = await _registered(test_certs, index_server.target, engine_id)
        chain = make_chain("other", 2)
        await c.apply_batch(commit_ops(chain, 0), seq=1)
        with pytest.raises(PrefixIndexClientError) as err:
            await c.apply_batch([Release(chain)], seq=1)
        assert err.value.code == grpc.StatusCode.ABORTED
        assert "seq 1" in err.value.details and "register again" in err.value.details
        [acq] = (await c.apply_batch([Acquire(chain)], seq=2)).results   # nothing applied
        assert acq.block_ids == [0, 1]
        assert await _refcount(c, chain) == 2
        await c.close()
    asyncio.run(body())


def test_a_gap_or_a_replay_is_refused_and_nothing_applied(index_server, engine_id, test_certs):
    async def body():
        c = await _registered(test_certs, index_server.target, engine_id)
        chain = make_chain("gap", 2)
        await c.apply_batch(commit_ops(chain, 0), seq=1)
        await c.apply_batch([Release(chain)], seq=2)
        with pytest.raises(PrefixIndexClientError) as err:
            await c.apply_batch([Acquire(chain)], seq=4)        # seq 3 never arrived
        assert err.value.code == grpc.StatusCode.ABORTED
        assert "apply seq 4 skips ahead of the last applied seq 2" in err.value.details
        with pytest.raises(PrefixIndexClientError) as err:
            await c.apply_batch([Acquire(chain)], seq=1)        # an old write comes back
        assert err.value.code == grpc.StatusCode.ABORTED
        assert "older than the last applied seq 2" in err.value.details
        s = (await c.stats())[0]
        assert (s.queries, s.evictable) == (0, 2)               # neither acquire happened
        # A refused Apply does not use up its number; after Register numbering restarts.
        with pytest.raises(PrefixIndexClientError) as err:
            await c.apply_batch([Evict(99)], seq=3)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert (await c.apply_batch([Evict(1)], seq=3)).results[0].count == 1
        await c.register(engine_id, "m", 16, 32, 30, nonce="seq-test")
        assert (await c.apply_batch(commit_ops(chain, 5), seq=1)).results[0].ok
        await c.close()
    asyncio.run(body())


def test_lost_writes_after_a_restore_are_detected(redis_server, index_server, engine_id,
                                                  test_certs):
    """Redis restored from a snapshot taken before the last Apply: the epoch is still valid,
    but the state is older than the engine's. The next Apply's number shows the gap."""
    async def body():
        c = await _registered(test_certs, index_server.target, engine_id)
        chain = make_chain("restore", 3)
        await c.apply_batch(commit_ops(chain[:1], 0), seq=1)
        with redis.Redis.from_url(redis_server.url) as raw:
            snapshot = {k: (raw.dump(k), raw.pttl(k)) for k in engine_keys(engine_id)}
            await c.apply_batch(commit_ops(chain, 0)[1:], seq=2)   # then Redis loses this
            for key, (data, pttl) in snapshot.items():
                raw.delete(key)
                if data is not None:
                    raw.restore(key, max(pttl, 0), data)
        with pytest.raises(PrefixIndexClientError) as err:
            await c.apply_batch([Acquire(chain)], seq=3)
        assert err.value.code == grpc.StatusCode.ABORTED
        assert "skips ahead of the last applied seq 1: writes were lost" in err.value.details
        # Retrying the lost write itself (same seq, same ops) is exactly right: it applies.
        retry = await c.apply_batch(commit_ops(chain, 0)[1:], seq=2)
        assert not retry.replayed and all(r.status == OpStatus.OK for r in retry.results)
        await c.close()
    asyncio.run(body())


def test_pin_changes_reach_the_engine_once(index_server, engine_id, test_certs):
    async def body():
        c = await _registered(test_certs, index_server.target, engine_id)
        chain = make_chain("pins", 2)
        first = await c.apply_batch(commit_ops(chain, 4) + [Pin(chain)], seq=1)
        assert [(p.hash, p.block_id, p.state) for p in first.pin_changes] == sorted(
            [(chain[0], 4, PinState.EXPLICIT), (chain[1], 5, PinState.EXPLICIT)])
        assert (await c.apply_batch([Evict(0)], seq=2)).pin_changes == []
        await c.close()
    asyncio.run(body())
