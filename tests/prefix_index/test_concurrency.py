"""Concurrent clients on one engine lose no updates: every change is one atomic script."""

from __future__ import annotations

import asyncio

from prefix_index.api.ops import Acquire, Evict, OpStatus, Release
from tests.prefix_index.chains import commit_ops, make_chain

CLIENTS = 8
ROUNDS = 40


def test_concurrent_clients_lose_no_updates(index_server, engine_id, test_certs):
    async def body():
        owner = test_certs.index_client(index_server.target, 10.0)
        await owner.register(engine_id, "m", 16, CLIENTS * 4 + 8, 30)
        workers = []
        for _ in range(CLIENTS):
            w = test_certs.index_client(index_server.target, 10.0)   # own channel each
            w.attach(engine_id, owner.epoch)
            workers.append(w)
        shared = make_chain("shared", 3)
        await owner.apply(commit_ops(shared, 0))                # refcount 1 each

        # Refcount +1 from every worker, many times, all at once.
        async def acquire_many(w):
            for _ in range(ROUNDS):
                [r] = await w.apply([Acquire(shared)])
                assert r.block_ids == [0, 1, 2]
        await asyncio.gather(*(acquire_many(w) for w in workers))

        # Distinct commits from every worker at once: all land.
        own_chains = [make_chain(f"own-{i}", 4) for i in range(CLIENTS)]
        results = await asyncio.gather(*(
            w.apply(commit_ops(own_chains[i], 3 + 4 * i)) for i, w in enumerate(workers)))
        assert all(r.status == OpStatus.OK for batch in results for r in batch)
        assert (await owner.stats())[0].blocks == 3 + 4 * CLIENTS

        # Exactly 1 + CLIENTS * ROUNDS releases succeed, released concurrently.
        expected = 1 + CLIENTS * ROUNDS

        async def release_all(w):
            ok = 0
            while True:
                [r] = await w.apply([Release(shared[::-1])])
                if r.status != OpStatus.OK:
                    assert r.status == OpStatus.REFCOUNT_ZERO and r.count == 0
                    return ok
                ok += 1
        released = await asyncio.gather(*(release_all(w) for w in workers))
        assert sum(released) == expected

        # Concurrent evictors never get the same victim twice.
        await asyncio.gather(*(w.apply([Release(own_chains[i])]) for i, w in enumerate(workers)))
        victims = await asyncio.gather(*(w.apply([Evict(3)]) for w in workers))
        ids = [e.block_id for [r] in victims for e in r.evicted]
        assert len(ids) == len(set(ids)) == 3 * CLIENTS
        s = (await owner.stats())[0]
        assert s.blocks == 3 + 4 * CLIENTS - len(ids) and s.evictions == len(ids)
        for w in (owner, *workers):
            await w.close()
    asyncio.run(body())
