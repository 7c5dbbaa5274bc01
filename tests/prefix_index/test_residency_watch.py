"""WatchResidency: a watcher's copy (router/residency.py) equals what Redis holds for every
engine after thousands of seeded random ops, re-registrations included, for a watcher that
started before them and one whose snapshot raced them; and a watch that loses the index or
Redis takes a new snapshot by itself and is exact again."""

from __future__ import annotations

import asyncio
import random
import time
import uuid

import grpc
import pytest
import redis

from prefix_index.api.client import PrefixIndexClient, PrefixIndexClientError
from prefix_index.api.ops import Acquire, Op, Release
from prefix_index.server.keys import engine_keys
from prefix_index.server.residency import SNAPSHOT_CHUNK
from prefix_index.tools.launch import IndexProcess
from prefix_index.tools.redis_process import RedisProcess
from router.index_view import IndexView
from router.residency import ResidencyMirror
from tests.prefix_index.chains import commit_ops, make_chain
from tests.prefix_index.conftest import HISTORY_PER_BLOCK, HOT_THRESHOLD, INDEX_ARGS
from tests.prefix_index.reference_model import ReferenceIndex
from tests.prefix_index.test_model_based import NUM_BLOCKS, _random_op, _random_tree
from tests.support.tls import SessionCerts
from trust.identity import ROUTER_ROLE

NUM_OPS = 1500
NUM_ENGINES = 3


def _truth(redis_url: str, engine_ids: list[str]) -> dict[str, tuple[int, set[bytes]]]:
    """engine id -> (epoch, resident hashes), read from Redis itself."""
    out = {}
    with redis.Redis.from_url(redis_url) as raw:
        for engine_id in engine_ids:
            meta, bid = engine_keys(engine_id, ("meta", "bid"))
            epoch = raw.hget(meta, "epoch")
            if epoch is not None:
                out[engine_id] = (int(epoch), set(raw.hkeys(bid)))
    return out


def _copy(mirror: ResidencyMirror, engine_ids: list[str]) -> dict[str, tuple[int, set[bytes]]]:
    return {e: (mirror.engines[e].epoch, set(mirror.engines[e].hashes))
            for e in engine_ids if e in mirror.engines}


async def _caught_up(mirror: ResidencyMirror, redis_url: str, engine_ids: list[str],
                     context: object, timeout_s: float = 10.0) -> None:
    """The copy converges to Redis (a change reaches a watcher a moment after it is made)."""
    deadline = time.monotonic() + timeout_s
    while True:
        truth = _truth(redis_url, engine_ids)
        if mirror.synced and _copy(mirror, engine_ids) == truth:
            return
        if time.monotonic() > deadline:
            copy = _copy(mirror, engine_ids)
            diff = {e: (len(truth.get(e, (0, set()))[1]), len(copy.get(e, (0, set()))[1]))
                    for e in engine_ids}
            raise AssertionError(f"{context}: the copy never matched Redis (synced "
                                 f"{mirror.synced}; held blocks truth vs copy: {diff})")
        await asyncio.sleep(0.01)


async def _follow(client: PrefixIndexClient, mirror: ResidencyMirror) -> None:
    async for change in client.watch_residency():
        mirror.apply(change)


@pytest.mark.parametrize("seed", [11, 2025])
def test_watchers_copies_match_redis_through_random_ops(redis_server, index_server, seed,
                                                        test_certs):
    print(f"seed {seed}")  # replay: pytest -k 'test_watchers_copies and <seed>'

    async def body():
        rng = random.Random(seed)
        chains = _random_tree(rng)
        engine_ids = [f"watched-{uuid.uuid4().hex[:8]}" for _ in range(NUM_ENGINES)]
        engines = [test_certs.index_client(index_server.target, 10.0) for _ in engine_ids]
        models: list[ReferenceIndex] = []
        seqs = [0] * NUM_ENGINES

        async def register(i: int) -> None:
            await engines[i].register(engine_ids[i], "m", 16, NUM_BLOCKS, 60)
            # (The index keeps the hit history across a Register; the model starts afresh.
            # It only steers which ops are sent: the check reads Redis, not the model.)
            model = ReferenceIndex(NUM_BLOCKS, engines[i].pin_budget, HOT_THRESHOLD,
                                   HISTORY_PER_BLOCK * NUM_BLOCKS)
            if i < len(models):
                models[i] = model
            else:
                models.append(model)
            seqs[i] = 0

        async def step() -> None:
            i = rng.randrange(NUM_ENGINES)
            if rng.random() < 0.01:
                await register(i)
                return
            batch: list[Op] = []
            for _ in range(rng.randint(1, 8)):
                op = _random_op(rng, chains, models[i])
                models[i].apply(op)
                batch.append(op)
            seqs[i] += 1
            await engines[i].apply_batch(batch, seq=seqs[i])

        first, late = ResidencyMirror(), ResidencyMirror()
        watchers = [test_certs.index_client(index_server.target, 10.0) for _ in range(2)]
        tasks = [asyncio.ensure_future(_follow(watchers[0], first))]
        try:
            for i in range(NUM_ENGINES):
                await register(i)
            done = 0
            while done < NUM_OPS:
                if done == NUM_OPS // 3:  # its snapshot races the ops that follow
                    tasks.append(asyncio.ensure_future(_follow(watchers[1], late)))
                await step()
                done += 1
                if rng.random() < 0.03:
                    await _caught_up(first, index_server.redis_url, engine_ids, (seed, done))
            await _caught_up(first, index_server.redis_url, engine_ids, (seed, "end"))
            await _caught_up(late, index_server.redis_url, engine_ids, (seed, "late, end"))
            assert first.changes > 100, "the changes were not exercised"
            # And the copy answers as Lookup does.
            for chain in chains:
                asked = {m.engine_id: m.matched_blocks
                         for m in await watchers[0].lookup(chain)
                         if m.engine_id in engine_ids}
                for mirror in (first, late):
                    answer = mirror.longest_prefixes(chain)
                    assert {e: n for e, n in answer.items() if e in engine_ids} == asked, (
                        seed, chain)
            assert all(t.done() is False for t in tasks), [t.exception() for t in tasks]
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for client in engines + watchers:
                await client.close()
    asyncio.run(body())


def test_a_large_pool_arrives_in_chunks(redis_server, index_server, engine_id, test_certs):
    """A snapshot over SNAPSHOT_CHUNK blocks is split (one message would pass gRPC's 4 MiB
    limit at 100k blocks) and still arrives whole."""
    async def body():
        num_blocks = SNAPSHOT_CHUNK + 300
        chain = make_chain("large", num_blocks)
        async with test_certs.index_client(index_server.target, 30.0) as c:
            await c.register(engine_id, "m", 16, num_blocks, 60)
            ops = commit_ops(chain, 0)
            for start in range(0, num_blocks, 4000):  # (at most 4096 ops per Apply)
                await c.apply(ops[start:start + 4000])
            mirror = ResidencyMirror()
            events = 0
            async for change in c.watch_residency():
                mirror.apply(change)
                events += change is not None and change.engine_id == engine_id
                if change is None:
                    break
            assert events == 2
            assert mirror.engines[engine_id].hashes == set(chain)
            assert mirror.longest_prefixes(chain)[engine_id] == num_blocks
    asyncio.run(body())


def test_the_router_watch_takes_a_new_snapshot_after_the_index_or_redis_restarts(engine_id,
                                                                                 test_certs):
    with RedisProcess() as redis_process:
        index = IndexProcess(redis_process.url, INDEX_ARGS, tls=test_certs.files("index"))
        index.start()
        try:
            asyncio.run(_restarts(test_certs, redis_process, index, engine_id))
        finally:
            index.terminate()


async def _restarts(certs: SessionCerts, redis_process: RedisProcess, index: IndexProcess,
                    engine_id: str) -> None:
    view = IndexView(index.target, 2.0, certs.material(ROUTER_ROLE))
    watch = asyncio.ensure_future(view.watch())
    engine = certs.index_client(index.target, 2.0)
    try:
        await engine.register(engine_id, "m", 16, 64, 60)
        before = make_chain("before", 5)
        await engine.apply(commit_ops(before, 0) + [Release(before)])
        await _caught_up(view.mirror, redis_process.url, [engine_id], "first snapshot")

        # The index restarts: the stream fails, the copy stops answering, and a new watch
        # brings it back, with the changes made while it was away.
        index.kill()
        await _until(lambda: not view.mirror.synced, "the copy unsynced after the index died")
        index.start()
        await engine.close()
        engine = certs.index_client(index.target, 2.0)
        engine.attach(engine_id, (await engine.stats(engine_id))[0].epoch)
        during = make_chain("while-away", 4)
        await engine.apply(commit_ops(during, 5) + [Release(during)])
        await _caught_up(view.mirror, redis_process.url, [engine_id], "after the index restart",
                         timeout_s=20)
        failures = view.watch_failures
        assert failures >= 1

        # Redis restarts empty: the index's subscription breaks, the watch ends, and the new
        # snapshot no longer has the engine until it registers again.
        redis_process.restart()
        await _until(lambda: view.watch_failures > failures, "the watch ended with Redis")
        await _register_until_up(engine, engine_id)
        after = make_chain("after", 3)
        await engine.apply(commit_ops(after, 0) + [Acquire(after)])
        await _caught_up(view.mirror, redis_process.url, [engine_id], "after the Redis restart",
                         timeout_s=20)
        assert view.mirror.engines[engine_id].hashes == set(after)
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
        await engine.close()
        await view.close()


async def _register_until_up(engine: PrefixIndexClient, engine_id: str) -> None:
    """Register as an engine does after Redis restarted: UNAVAILABLE (the index still held
    connections to the old server, or had not seen it back yet) means try again."""
    deadline = time.monotonic() + 15.0
    while True:
        try:
            await engine.register(engine_id, "m", 16, 64, 60)
            return
        except PrefixIndexClientError as error:
            if error.code != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def _until(predicate, what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s}s")
        await asyncio.sleep(0.02)
