"""Overlapping explicit pins survive a re-sync whole (issue 34 review). The engine's mirror
keeps each pin as the index does (named by its chain's last hash, with its own expiry) and a
re-sync states them again under their names: afterwards unpinning the longer pin leaves the
shorter one's blocks pinned, and unpinning the shorter one frees them. Before, the re-sync
re-stated one pin per block, so an unpin after it dropped only the chain's last block.

Real redis-server (restarted empty: the index forgets everything), the real index server, the
real engine on the tiny model; the test thread is the engine's thread."""

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
    index_stats,
    link_options,
    make_engine,
    prompt_ids,
    wait_until,
)

pytestmark = pytest.mark.timeout(180)

PROMPT = prompt_ids(seed=71, length=4 * BLOCK_SIZE)
ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def test_overlapping_pins_are_restated_whole(tiny_llama_dir, redis, index, test_certs):
    engine = make_engine(tiny_llama_dir)
    engine_id = "engine-resync-overlap"
    link = connect_prefix_index(engine, index.target, engine_id, link_options(test_certs))
    assert link is not None

    def pin(chain: list[bytes], ttl_s: float = 0.0, unpin: bool = False) -> int:
        return call_pumping(engine, lambda: asyncio.run(link.pin_prefix(chain, ttl_s, unpin)))

    def pinned_at_index() -> int:
        stats = index_stats(test_certs, index.target, engine_id)
        return -1 if stats is None else stats.pinned

    try:
        wait_until(lambda: not link.degraded, DEADLINE_S, "first registration", engine=engine)
        driver = Driver(engine)
        driver.add({"prompt": PROMPT + prompt_ids(72, 5)}, ONE_TOKEN)
        driver.run_to_completion()
        chain = engine.hasher.chain(PROMPT, None)
        assert pin(chain[:2]) == 2  # until unpinned
        assert pin(chain, ttl_s=3600.0) == 4
        assert pinned_at_index() == 4

        redis.kill()  # no persistence: it comes back empty
        driver.add({"notice": prompt_ids(73, 2 * BLOCK_SIZE + 1)}, ONE_TOKEN)
        wait_until(lambda: (driver.step(), link.degraded)[1], DEADLINE_S, "degraded",
                   engine=engine)
        driver.run_to_completion()
        redis.start()
        wait_until(lambda: not link.degraded and link.stats().registrations >= 2, DEADLINE_S,
                   "re-registered", engine=engine)
        wait_until(lambda: pinned_at_index() == 4, DEADLINE_S, "both pins re-stated",
                   engine=engine)

        # The longer pin's own blocks go; the shorter pin's stay, here and at the index.
        assert pin(chain, unpin=True) == 2
        wait_until(lambda: pinned_at_index() == 2, DEADLINE_S, "the longer pin gone",
                   engine=engine)
        assert engine.stats().num_pinned_in_budget == 2
        assert pin(chain[:2], unpin=True) == 2
        wait_until(lambda: pinned_at_index() == 0, DEADLINE_S, "the shorter pin gone",
                   engine=engine)
        assert engine.stats().num_pinned_in_budget == 0
    finally:
        link.close()
    assert engine.check_block_invariants() == []
