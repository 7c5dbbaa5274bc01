"""Explicit pins made under a large pin budget survive a re-sync made under a small one
(issue 34). A shrinking budget never drops an explicit pin: each was made within the budget
of its time. A re-sync (after the index process restarted) re-states every pin, and the
budget it carries is the engine's budget now: the pins it re-states must not be checked
against that smaller budget and refused, or an index restart drops what a shrink may not.

Real redis-server, the real index server (mutual TLS) as a subprocess that is killed and
started again on its port, the real engine on a tiny model driven on the test thread.
"""

from __future__ import annotations

import asyncio

import pytest

from engine_service import SamplingParams
from engine_service.index.link import connect_prefix_index
from prefix_index.tools.launch import IndexProcess
from tests.service.index_fixtures import (
    BLOCK_SIZE,
    DEADLINE_S,
    INDEX_ARGS,
    Driver,
    call_pumping,
    index_matches_pool,
    index_stats,
    link_options,
    make_engine,
    prompt_ids,
    wait_until,
)

pytestmark = pytest.mark.timeout(240)

POOL = 64
CEILING = POOL // 2  # the budget of a quiet engine: 32
FLOOR = POOL // 10  # 6
PINNED_BLOCKS = 12  # more than the floor, within the ceiling
PINNED = prompt_ids(seed=3401, length=PINNED_BLOCKS * BLOCK_SIZE)
ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
# A request whose peak demand (prompt + max_tokens) leaves less than the floor: admitted, it
# brings the budget down to the floor, where a long window keeps it after it is gone.
BIG = SamplingParams(temperature=0.0, max_tokens=(POOL - 2) * BLOCK_SIZE, ignore_eos=True)


def test_explicit_pins_survive_a_resync_under_a_smaller_budget(tiny_llama_dir, redis,
                                                                 test_certs):
    index = IndexProcess(redis.url, INDEX_ARGS, tls=test_certs.files("index")).start()
    replacement: IndexProcess | None = None
    engine = make_engine(tiny_llama_dir, num_blocks=POOL, pin_budget_floor=0.1,
                         pin_budget_ceiling=0.5, pin_budget_window_s=3600.0)
    engine_id = "engine-budget-resync"
    link = connect_prefix_index(engine, index.target, engine_id, link_options(test_certs))
    driver = Driver(engine)

    def at_index() -> tuple[int, int, int]:
        s = index_stats(test_certs, index.target, engine_id)
        return (-1, -1, -1) if s is None else (s.pinned, s.auto_pinned, s.pin_budget)

    try:
        wait_until(lambda: not link.degraded, DEADLINE_S, "registration", engine=engine)
        driver.add({"pinned": PINNED + prompt_ids(3402, 3)}, ONE_TOKEN)
        driver.run_to_completion()
        chain = engine.hasher.chain(PINNED, None)
        assert call_pumping(
            engine, lambda: asyncio.run(link.pin_prefix(chain, 0.0, False))) == PINNED_BLOCKS
        wait_until(lambda: at_index() == (PINNED_BLOCKS, 0, CEILING), DEADLINE_S,
                   "the explicit pins under the quiet engine's budget", engine=engine)

        driver.add({"big": prompt_ids(3403, BLOCK_SIZE)}, BIG)
        driver.step()
        engine.abort_request("big")
        driver.step()
        assert engine.pin_budget.blocks == FLOOR
        wait_until(lambda: at_index() == (PINNED_BLOCKS, 0, FLOOR), DEADLINE_S,
                   "the smaller budget at the index, the explicit pins kept", engine=engine)

        index.kill()
        driver.add({"notice": prompt_ids(3404, 2 * BLOCK_SIZE + 1)}, ONE_TOKEN)
        wait_until(lambda: (driver.step(), link.degraded)[1], DEADLINE_S,
                   "degraded after the index restart", engine=engine)
        driver.run_to_completion()
        replacement = IndexProcess(redis.url, INDEX_ARGS, port=index.port,
                                   tls=test_certs.files("index")).start()
        wait_until(lambda: not link.degraded and link.stats().registrations >= 2, DEADLINE_S,
                   "re-registration", engine=engine)
        wait_until(lambda: index_matches_pool(test_certs, index.target, engine_id, engine),
                   DEADLINE_S, "the index re-synced with the pool")
        assert engine.pin_budget.blocks == FLOOR
        assert at_index() == (PINNED_BLOCKS, 0, FLOOR)
        assert engine.stats().num_pinned_blocks == PINNED_BLOCKS
        driver.add({"again": PINNED + prompt_ids(3405, 3)}, ONE_TOKEN)
        driver.run_to_completion()
        assert driver.finished["again"].num_cached_tokens == len(PINNED)
    finally:
        link.close()
        index.kill()
        if replacement is not None:
            replacement.kill()
    assert engine.check_block_invariants() == []
