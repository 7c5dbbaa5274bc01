"""Pins survive an outage: the index at its shipped defaults (automatic pinning on, the default
hot threshold, window and pin budget) and the link at its shipped 30 s lease. A prefix earns an
automatic pin by being requested as often as the default threshold asks, another is pinned
explicitly (PinPrefix); then Redis restarts empty, or the index process restarts on its Redis.
After the engine re-registers and re-syncs, the index holds both pins again, the engine never
counted those blocks free nor evicted them (cold traffic flushes the pool during the outage and
after it), and the repeat requests find every pinned block cached.

Real redis-server, the real index server as a subprocess, the real engine on a tiny model over
loopback; the test thread is the engine's thread and waits on conditions, never on sleeps.
Automatic pins come back after Redis lost everything because the re-sync re-states them
(PinOp.automatic); the last test checks the index's rules for that op directly.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from engine_service import SamplingParams
from engine_service.core.engine import LLMEngine
from engine_service.index.link import PrefixIndexLink, connect_prefix_index
from prefix_index.api.client import PrefixIndexClientError
from prefix_index.api.ops import Commit, Pin, PinState, Release
from prefix_index.server.config import PinPolicy
from prefix_index.tools.launch import IndexProcess
from tests.service.index_fixtures import (
    BLOCK_SIZE,
    DEADLINE_S,
    INDEX_ARGS,
    NUM_BLOCKS,
    Driver,
    call_pumping,
    index_matches_pool,
    index_stats,
    link_options,
    make_engine,
    prompt_ids,
    wait_until,
)
from tests.support.tls import SessionCerts

pytestmark = pytest.mark.timeout(180)

HOT_THRESHOLD = PinPolicy().hot_threshold  # the shipped default: admissions in one window
HOT = prompt_ids(seed=61, length=4 * BLOCK_SIZE)  # earns automatic pins on its 4 blocks
PINNED = prompt_ids(seed=62, length=3 * BLOCK_SIZE)  # pinned explicitly: 3 blocks
NUM_PINNED = 4 + 3
ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
COLD = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
# Cold prompts of 30 full blocks; 10 of them are more than the whole pool, so the LRU (local
# while degraded, the index's once re-synced) goes through every block that is not pinned.
COLD_BLOCKS = 30
COLD_PROMPTS = NUM_BLOCKS // COLD_BLOCKS + 2


def run_one(driver: Driver, request_id: str, ids: list[int],
            params: SamplingParams = ONE_TOKEN) -> int:
    """Runs one request to completion; its cached prompt tokens."""
    driver.add({request_id: ids}, params)
    driver.run_to_completion()
    return driver.finished[request_id].num_cached_tokens


def flood(driver: Driver, name: str, seed: int) -> None:
    """Cold traffic that needs more blocks than the pool has."""
    for i in range(COLD_PROMPTS):
        run_one(driver, f"{name}{i}", prompt_ids(seed + i, COLD_BLOCKS * BLOCK_SIZE + 3), COLD)


def pinned_at_index(certs: SessionCerts, target: str, engine_id: str) -> tuple[int, int]:
    """(pinned, of them automatic) in the index's view of the engine; (-1, -1) if none."""
    stats = index_stats(certs, target, engine_id)
    return (-1, -1) if stats is None else (stats.pinned, stats.auto_pinned)


def assert_pins_held_locally(engine: LLMEngine, chains: list[list[bytes]]) -> None:
    """Every pinned block still cached, idle, and neither free nor evictable in the engine."""
    evictable = set(engine.pool.policy.evictable_hashes())
    cached = dict(engine.pool.cached_items())
    for chain in chains:
        for block_hash in chain:
            assert block_hash in cached, "a pinned block was evicted"
            assert block_hash not in evictable, "a pinned block counts as free"
    stats = engine.stats()
    assert stats.num_pinned_blocks == NUM_PINNED
    assert stats.num_pins_released == 0
    assert stats.num_free_blocks == NUM_BLOCKS - NUM_PINNED  # idle: all the rest is free


def make_pins(certs: SessionCerts, engine: LLMEngine, link: PrefixIndexLink, driver: Driver,
              target: str, engine_id: str) -> tuple[list[bytes], list[bytes]]:
    """HOT requested HOT_THRESHOLD times (the index pins it), PINNED pinned by PinPrefix;
    their block-hash chains."""
    hot_chain = engine.hasher.chain(HOT, None)
    pinned_chain = engine.hasher.chain(PINNED, None)
    for visit in range(HOT_THRESHOLD):
        cached = run_one(driver, f"hot{visit}", HOT + prompt_ids(700 + visit, 5))
        assert cached == (0 if visit == 0 else len(HOT))
    run_one(driver, "pinned", PINNED + prompt_ids(800, 5))
    wait_until(lambda: engine.stats().num_pinned_blocks == 4, DEADLINE_S,
               "the index's automatic pins of the hot prefix reach the engine", engine=engine)
    assert call_pumping(
        engine, lambda: asyncio.run(link.pin_prefix(pinned_chain, 0.0, False))) == 3
    assert pinned_at_index(certs, target, engine_id) == (NUM_PINNED, 4)
    return hot_chain, pinned_chain


@pytest.mark.parametrize("outage", ["redis-restart", "index-restart"])
def test_pins_survive_an_outage_and_resync(tiny_llama_dir, redis, index, outage, test_certs):
    engine = make_engine(tiny_llama_dir)
    engine_id = f"engine-pins-{outage}"
    # The shipped link options, on the session's engine certificate.
    link = connect_prefix_index(engine, index.target, engine_id, link_options(test_certs))
    assert link is not None and link.options.lease_s == 30.0
    replacement: IndexProcess | None = None
    try:
        wait_until(lambda: not link.degraded, DEADLINE_S, "first registration", engine=engine)
        first_epoch = link.epoch
        driver = Driver(engine)
        chains = make_pins(test_certs, engine, link, driver, index.target, engine_id)
        wait_until(lambda: index_matches_pool(test_certs, index.target, engine_id, engine),
                   DEADLINE_S,
                   "the index mirrors the pool before the outage")

        if outage == "redis-restart":
            redis.kill()  # no persistence: it comes back empty, as a crashed cache would
        else:
            index.kill()
        # The link notices on its next call: a request's Apply, while the engine serves on.
        driver.add({"notice": prompt_ids(900, 2 * BLOCK_SIZE + 1)}, COLD)
        wait_until(lambda: (driver.step(), link.degraded)[1], DEADLINE_S,
                   f"degraded after the {outage}", engine=engine)
        driver.run_to_completion()
        # Degraded: the local LRU evicts everything it may, never a pinned block.
        flood(driver, "outage", seed=1000)
        assert link.degraded
        assert engine.pool.policy.counters.local_evictions > 0
        assert_pins_held_locally(engine, list(chains))

        if outage == "redis-restart":
            redis.start()
        else:
            replacement = IndexProcess(redis.url, INDEX_ARGS, port=index.port,
                                       tls=test_certs.files("index")).start()
        wait_until(lambda: not link.degraded and link.stats().registrations >= 2, DEADLINE_S,
                   f"re-registration after the {outage}", engine=engine)
        assert link.epoch > first_epoch
        wait_until(lambda: index_matches_pool(test_certs, index.target, engine_id, engine),
                   DEADLINE_S,
                   "the index re-synced with the pool")
        # The re-sync gave the index both pins back: the automatic ones and the explicit one.
        wait_until(lambda: pinned_at_index(test_certs, index.target, engine_id) == (NUM_PINNED, 4),
                   DEADLINE_S, f"the pins back at the index after the {outage}", engine=engine)
        assert_pins_held_locally(engine, list(chains))

        # Once re-synced the index chooses the victims: still never a pinned block.
        flood(driver, "after", seed=2000)
        wait_until(lambda: index_matches_pool(test_certs, index.target, engine_id, engine),
                   DEADLINE_S,
                   "the index mirrors the pool after the flood")
        assert index_stats(test_certs, index.target, engine_id).evictions > 0
        assert pinned_at_index(test_certs, index.target, engine_id) == (NUM_PINNED, 4)
        assert_pins_held_locally(engine, list(chains))
        assert run_one(driver, "hot-again", HOT + prompt_ids(701, 6)) == len(HOT)
        assert run_one(driver, "pinned-again", PINNED + prompt_ids(801, 6)) == len(PINNED)
        assert link.stats().registrations == 2
    finally:
        link.close()
        if replacement is not None:
            replacement.kill()
    assert engine.check_block_invariants() == []


def test_restated_automatic_pins_follow_the_index_rules(redis, index, test_certs):
    """PinOp.automatic as the index takes it: a held hash with no hit history is pinned
    automatically and its history starts at the threshold; within the pin budget, displacing
    no other pin; never with a TTL; nothing at an index with automatic pinning off
    (--hot-threshold 0, the one non-default setting here)."""
    chain = [bytes([i]) * 16 for i in range(1, 5)]
    committed = [Commit(h, chain[i - 1] if i else b"", i) for i, h in enumerate(chain)]
    committed.append(Release(list(chain)))
    budget_of_20 = PinPolicy().budget(20)  # 2

    async def restate(target: str, engine_id: str) -> list:
        async with test_certs.index_client(target, timeout_s=5.0) as client:
            await client.register(engine_id, "model", BLOCK_SIZE, 20)
            await client.apply(committed)
            [explicit] = await client.apply([Pin(chain[:1])])
            assert explicit.count == 1
            reply = await client.apply_batch([Pin([h], automatic=True) for h in chain[1:]])
            with pytest.raises(PrefixIndexClientError) as refused:
                await client.apply([Pin(chain[1:2], ttl_s=60.0, automatic=True)])
            assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
            [stats] = await client.stats()
            return [reply, stats]

    reply, stats = asyncio.run(restate(index.target, "engine-restate"))
    assert [r.count for r in reply.results] == [1, 0, 0]  # the budget: 1 explicit + 1 more
    assert [(c.hash, c.state) for c in reply.pin_changes] == [(chain[1], PinState.AUTOMATIC)]
    assert (stats.pinned, stats.auto_pinned, stats.pin_budget) == (2, 1, budget_of_20)
    assert stats.history == 3  # every re-stated hash is hot again, pinned or not

    off = IndexProcess(redis.url, INDEX_ARGS + ["--hot-threshold", "0"],
                       tls=test_certs.files("index")).start()
    try:
        reply, stats = asyncio.run(restate(off.target, "engine-restate-off"))
    finally:
        off.kill()
    assert [r.count for r in reply.results] == [0, 0, 0]
    assert reply.pin_changes == [] and (stats.pinned, stats.auto_pinned) == (1, 0)
