"""Thousands of seeded random ops against the service and against the plain in-memory model
(tests/prefix_index/reference_model.py): every answer must be identical, pin changes and the
hit history included. Applies carry sequence numbers; some are sent twice (a retry after a
lost reply), which must answer the stored result and change nothing."""

from __future__ import annotations

import asyncio
import random

import pytest
import redis

from prefix_index.api.ops import (
    Acquire,
    AcquireKind,
    Commit,
    Evict,
    Forget,
    Op,
    OpResult,
    OpStatus,
    Pin,
    Release,
    Unpin,
)
from prefix_index.server.keys import engine_keys
from tests.prefix_index.chains import block_hash
from tests.prefix_index.conftest import HISTORY_PER_BLOCK, HOT_THRESHOLD
from tests.prefix_index.reference_model import ReferenceIndex

NUM_BLOCKS = 24
NUM_OPS = 3000
TREE_NODES = 60


def _random_tree(rng: random.Random) -> list[list[bytes]]:
    """Chains that share prefixes: node i hangs off a random earlier node (or starts a chain)."""
    chains: list[list[bytes]] = []
    for i in range(TREE_NODES):
        parent = chains[rng.randrange(i)] if i and rng.random() < 0.8 else []
        label = f"node-{i}"
        chains.append(parent + [block_hash(parent[-1] if parent else b"", label)])
    return chains


def _random_op(rng: random.Random, chains: list[list[bytes]], model: ReferenceIndex) -> Op:
    chain = rng.choice(chains)
    roll = rng.random()
    if roll < 0.28:
        # Mostly the next block of a chain with a block id that is free; sometimes a reused
        # id, an existing hash or a missing parent.
        held = [h for h in chain if h in model.blocks]
        pos = len(held) if rng.random() < 0.85 else rng.randrange(len(chain))
        pos = min(pos, len(chain) - 1)
        free_ids = [b for b in range(NUM_BLOCKS) if model.owner_of(b) is None]
        block_id = (rng.choice(free_ids) if free_ids and rng.random() < 0.9
                    else rng.randrange(NUM_BLOCKS))
        return Commit(chain[pos], chain[pos - 1] if pos else b"", block_id)
    if roll < 0.48:
        kind = AcquireKind.ADMISSION if rng.random() < 0.8 else rng.choice(
            [AcquireKind.FORK, AcquireKind.RESYNC])
        return Acquire(chain[: rng.randint(1, len(chain))], kind)
    if roll < 0.68:
        held = [h for h in chain if h in model.blocks and model.blocks[h].refcount > 0]
        if held and rng.random() < 0.9:
            return Release(held[::-1] if rng.random() < 0.5 else held)
        return Release(chain[: rng.randint(1, len(chain))])
    if roll < 0.80:
        return Evict(rng.randint(0, 4))
    if roll < 0.86:
        # The engine evicted a block on its own: mostly the right (hash, block) pair, any
        # refcount or pin; sometimes a wrong block id or a hash the index does not hold.
        held = list(model.blocks)
        if held and rng.random() < 0.8:
            h = rng.choice(held)
            block_id = model.blocks[h].block_id
            return Forget(h, block_id if rng.random() < 0.85 else (block_id + 1) % NUM_BLOCKS)
        return Forget(rng.choice(chain), rng.randrange(NUM_BLOCKS))
    if roll < 0.92:
        # TTLs far past the test: the expiry bookkeeping runs, nothing expires mid-test.
        return Pin(chain[: rng.randint(1, len(chain))], ttl_s=rng.choice([0.0, 3600.0]))
    # Unpins often enough that the pin budget keeps freeing up for automatic pins.
    # Some free automatic pins only (an engine's release_pins), from the roll already drawn.
    return Unpin(chain[: rng.randint(1, len(chain))], automatic_only=roll > 0.98)


def _comparable(r: OpResult) -> tuple:
    return (r.status, r.block_ids, [(e.hash, e.block_id) for e in r.evicted], r.count)


def _check_raw_state(redis_url: str, engine_id: str, model: ReferenceIndex) -> None:
    """What Redis holds, field by field, equals the model; no refcount is ever negative."""
    (_meta, bid, own, ref, par, kids, _last, pin, pinexp, hot, free, lru, hage, _pinchg,
     vref, pins, cover) = engine_keys(engine_id)
    with redis.Redis.from_url(redis_url) as raw:
        refs = {h: int(v) for h, v in raw.hgetall(ref).items()}
        assert all(v >= 0 for v in refs.values())
        assert refs == {h: b.refcount for h, b in model.blocks.items()}
        assert {h: int(v) for h, v in raw.hgetall(bid).items()} == {
            h: b.block_id for h, b in model.blocks.items()}
        assert {int(b): h for b, h in raw.hgetall(own).items()} == {
            b.block_id: h for h, b in model.blocks.items()}
        assert raw.hgetall(par) == {h: b.parent for h, b in model.blocks.items()}
        assert {h: v.decode() for h, v in raw.hgetall(pin).items()} == {
            h: b.pin for h, b in model.blocks.items() if b.pin}
        # Whole pins: each by name with the hashes it covers, the cover counts, the timed ones.
        assert raw.hgetall(pins) == {name: b"".join(p.hashes) for name, p in model.pins.items()}
        covered = {h for p in model.pins.values() for h in p.hashes}
        assert {h: int(v) for h, v in raw.hgetall(cover).items()} == {
            h: model.covers(h) for h in covered}
        assert set(raw.zrange(pinexp, 0, -1)) == {
            name for name, p in model.pins.items() if p.expires_at != float("inf")}
        children = {}
        for b in model.blocks.values():
            if b.parent:
                children[b.parent] = children.get(b.parent, 0) + 1
        assert {h: int(v) for h, v in raw.hgetall(kids).items()} == children
        evictable = {h for h, b in model.blocks.items() if b.refcount == 0 and not b.pin}
        assert set(raw.zrange(free, 0, -1)) == evictable
        assert set(raw.zrange(lru, 0, -1)) == {h for h in evictable if h not in children}
        # The hit history: same hashes, same use counts, same trim order.
        uses = {h: int(v.split()[1]) for h, v in raw.hgetall(hot).items()}
        assert uses == {h: e.uses for h, e in model.history.items()}
        assert raw.zrange(hage, 0, -1) == sorted(model.history,
                                                   key=lambda h: model.history[h].tick)
        # Lookup's view is written for held blocks only (their write times kept beside).
        assert set(raw.hkeys(vref)) == set(model.blocks)


@pytest.mark.parametrize("seed", [20240611, 7, 1234])
def test_service_matches_the_reference_model(redis_server, index_server, engine_id, seed,
                                             test_certs):
    async def body():
        rng = random.Random(seed)
        chains = _random_tree(rng)
        async with test_certs.index_client(index_server.target, 10.0) as c:
            await c.register(engine_id, "m", 16, NUM_BLOCKS, 60)
            model = ReferenceIndex(NUM_BLOCKS, c.pin_budget, HOT_THRESHOLD,
                                   HISTORY_PER_BLOCK * NUM_BLOCKS)
            done, seq, statuses = 0, 0, set()
            pin_changes = forgets = retries = 0
            while done < NUM_OPS:
                batch: list[Op] = []
                expected: list[OpResult] = []
                for _ in range(rng.randint(1, 8)):
                    # Generated from the model's state after the batch's earlier ops.
                    op = _random_op(rng, chains, model)
                    batch.append(op)
                    expected.append(model.apply(op))
                changes = model.take_pin_changes()  # what the batch as a whole reports
                seq += 1
                got = await c.apply_batch(batch, seq=seq)
                for i, (g, e) in enumerate(zip(got.results, expected, strict=True)):
                    assert _comparable(g) == _comparable(e), (seed, done + i, batch[i], g, e)
                    statuses.add(g.status)
                assert got.pin_changes == changes, (seed, done)
                assert not got.replayed
                pin_changes += len(changes)
                forgets += sum(isinstance(op, Forget) and r.ok
                               for op, r in zip(batch, expected, strict=True))
                if rng.random() < 0.05:     # the reply was lost; the engine sends it again
                    again = await c.apply_batch(batch, seq=seq)
                    assert again.replayed and again.pin_changes == changes
                    assert [_comparable(r) for r in again.results] == [
                        _comparable(r) for r in got.results]
                    retries += 1
                done += len(batch)
                if rng.random() < 0.05:
                    s = (await c.stats())[0]
                    service = {k: getattr(s, k) for k in model.counters()}
                    assert service == model.counters(), (seed, done)
                if rng.random() < 0.05:
                    chain = rng.choice(chains)
                    mine = [m.matched_blocks for m in await c.lookup(chain)
                            if m.engine_id == engine_id]
                    held = len(model.held_prefix(chain))
                    assert mine == ([held] if held else []), (seed, done)
                if rng.random() < 0.02:
                    _check_raw_state(redis_server.url, engine_id, model)
            # The run must have exercised every outcome and every new path, or it proves
            # little.
            assert statuses == set(OpStatus), (seed, statuses)
            assert pin_changes > 20 and forgets > 20 and retries > 5, (
                seed, pin_changes, forgets, retries)
            assert model.trimmed > 0, "the hit history never reached its cap"
            s = (await c.stats())[0]
            assert {k: getattr(s, k) for k in model.counters()} == model.counters(), seed
            _check_raw_state(redis_server.url, engine_id, model)
    asyncio.run(body())
