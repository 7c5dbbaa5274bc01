"""A lone request that needs the room pins hold gets it by whole pins (issue 34 review): the
engine's mirror of the index gives up its least recently made pin first, each as one Unpin
naming it, so the index and the engine agree on what stays pinned. Before, it unpinned
arbitrary idle blocks (and told the index block by block), which whole pins at the index
would not have matched.

Real redis-server, the real index server, the real engine on the tiny model (a 40-block pool);
the test thread is the engine's thread."""

from __future__ import annotations

import asyncio

import pytest

from engine_service import SamplingParams
from engine_service.index.link import connect_prefix_index
from tests.service.index_fixtures import (
    BLOCK_SIZE,
    DEADLINE_S,
    Driver,
    call_pumping,
    index_matches_pool,
    index_stats,
    link_options,
    make_engine,
    prompt_ids,
    wait_until,
)

pytestmark = pytest.mark.timeout(180)

POOL = 40
ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def test_a_lone_request_releases_whole_pins_oldest_first(tiny_llama_dir, redis, index,
                                                         test_certs):
    engine = make_engine(tiny_llama_dir, num_blocks=POOL)
    engine_id = "engine-release-whole-pins"
    link = connect_prefix_index(engine, index.target, engine_id, link_options(test_certs))
    assert link is not None

    def pin(chain: list[bytes], ttl_s: float = 0.0) -> int:
        return call_pumping(engine, lambda: asyncio.run(link.pin_prefix(chain, ttl_s, False)))

    def pinned_at_index() -> int:
        stats = index_stats(test_certs, index.target, engine_id)
        return -1 if stats is None else stats.pinned

    try:
        wait_until(lambda: not link.degraded, DEADLINE_S, "registered", engine=engine)
        driver = Driver(engine)
        first, second = prompt_ids(81, 4 * BLOCK_SIZE), prompt_ids(82, 4 * BLOCK_SIZE)
        for name, ids in (("first", first), ("second", second)):
            driver.add({name: ids + prompt_ids(83, 3)}, ONE_TOKEN)
            driver.run_to_completion()
        first_chain = engine.hasher.chain(first, None)
        second_chain = engine.hasher.chain(second, None)
        # The oldest pin, a newer one over its first 2 blocks, and the newest of 4 others.
        assert pin(first_chain) == 4
        assert pin(first_chain[:2]) == 2
        assert pin(second_chain, ttl_s=3600.0) == 4
        assert engine.stats().num_pinned_in_budget == 8
        wait_until(lambda: pinned_at_index() == 8, DEADLINE_S, "8 pinned at the index",
                   engine=engine)

        # 40 blocks, 8 pinned: a prompt of 34 blocks (+1 partial) cannot fit beside them.
        driver.add({"lone": prompt_ids(84, 34 * BLOCK_SIZE + 1)}, ONE_TOKEN)
        driver.run_to_completion()
        # It needed 3 more: the oldest pin went whole but freed only 2 (the 2-block pin made
        # later covers its first blocks), so the next oldest went too: 4 freed. The newest
        # pin stays, the same in the engine and at the index.
        assert engine.stats().num_pins_released == 4
        assert engine.stats().num_pinned_in_budget == 4
        assert all(engine.pool.policy.is_pinned(h) for h in second_chain)
        wait_until(lambda: pinned_at_index() == 4, DEADLINE_S,
                   "the index unpinned what the engine released", engine=engine)
        wait_until(lambda: index_matches_pool(test_certs, index.target, engine_id, engine),
                   DEADLINE_S, "the index mirrors the pool")
    finally:
        link.close()
    assert engine.check_block_invariants() == []
