"""A pin whose TTL runs out while the engine is idle (no step) lapses at the engine as at the
index, and a re-sync does not bring it back.

The mirror lapses pins at the start of a step; an idle engine takes none, so a short pin that
has run out is still in its records when Redis loses the engine's state (a restart, a lapsed
lease) and the link re-registers. The re-sync used to re-state it with a fresh millisecond
(max(0.001, expiry - now)) and pin it again locally: the index lapsed it at its next heartbeat,
which reports no pin changes, while the idle engine kept counting it (seen in
test_pins_random_engine.py, seed 2026 step 21: the engine 6 pinned, the index 4, for good).

Real redis-server, the real index server over mutual TLS, the real engine on the tiny model;
the test thread is the engine's thread."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis as redis_client

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

pytestmark = pytest.mark.timeout(120)

ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
SHORT_TTL_S = 0.05


@pytest.fixture
def index(redis, test_certs):
    process = IndexProcess(redis.url, INDEX_ARGS, tls=test_certs.files("index")).start()
    yield process
    process.kill()


def pin_two_blocks_briefly(engine, link, seed: int) -> None:
    """Once the link registered: a prompt of 3 blocks run, its first 2 pinned for SHORT_TTL_S
    through the link (the test thread is the engine's)."""
    wait_until(lambda: not link.degraded, DEADLINE_S, "registered", engine=engine)
    ids = prompt_ids(seed, 3 * BLOCK_SIZE)
    driver = Driver(engine)
    driver.add({"r": ids + [7]}, ONE_TOKEN)
    driver.run_to_completion()
    chain = engine.hasher.chain(ids, None)
    assert call_pumping(engine, lambda: asyncio.run(
        link.pin_prefix(chain[:2], SHORT_TTL_S, False))) == 2


def test_a_resync_does_not_revive_a_lapsed_pin(tiny_llama_dir, redis, index, test_certs):
    engine = make_engine(tiny_llama_dir, num_blocks=48)
    engine_id = "engine-resync-lapsed-pin"
    link = connect_prefix_index(engine, index.target, engine_id,
                                link_options(test_certs, lease_s=2.0))
    assert link is not None
    try:
        pin_two_blocks_briefly(engine, link, seed=5)
        assert engine.stats().num_pinned_in_budget == 2
        # Idle (no step) past the pin's TTL, then Redis loses everything: the link re-registers.
        end = time.monotonic() + 4 * SHORT_TTL_S
        while time.monotonic() < end:
            engine.run_commands()
            time.sleep(0.01)
        registrations = link.stats().registrations
        with redis_client.Redis.from_url(redis.url) as raw:
            raw.flushall()
        wait_until(lambda: not link.degraded and link.stats().registrations > registrations,
                   DEADLINE_S, "re-registered and re-synced", engine=engine)
        engine.run_commands()
        # Still no step: the lapsed pin stayed lapsed, here and at the index.
        assert engine.stats().num_pinned_in_budget == 0

        def nothing_pinned() -> bool:
            stats = index_stats(test_certs, index.target, engine_id)
            return (stats is not None and stats.pinned == 0
                    and engine.stats().num_pinned_in_budget == 0
                    and index_matches_pool(test_certs, index.target, engine_id, engine))

        wait_until(nothing_pinned, DEADLINE_S, "the engine and the index agree: nothing pinned",
                   engine=engine)
    finally:
        link.close()
    assert engine.check_block_invariants() == []


def test_an_idle_engine_lapses_a_short_pin_as_the_index_does(tiny_llama_dir, redis, index,
                                                              test_certs):
    """The index lapses the pin at its next heartbeat and reports it in no reply an idle engine
    gets; the engine, taking no step, lapses it between steps (its pass over its commands),
    and the two agree past that heartbeat (the engine used to count it until its next step)."""
    engine = make_engine(tiny_llama_dir, num_blocks=48)
    engine_id = "engine-idle-lapsed-pin"
    lease_s = 1.0
    link = connect_prefix_index(engine, index.target, engine_id,
                                link_options(test_certs, lease_s=lease_s))
    assert link is not None
    try:
        pin_two_blocks_briefly(engine, link, seed=6)
        steps = engine.num_steps

        def index_lapsed() -> bool:  # at a heartbeat of the link's (every lease / 3)
            stats = index_stats(test_certs, index.target, engine_id)
            return stats is not None and stats.pinned == 0

        # Still no step: the engine lapsed it too (it used to count 2 until its next step).
        wait_until(index_lapsed, DEADLINE_S, "the index lapsed the pin", engine=engine)
        assert engine.stats().num_pinned_in_budget == 0
        assert index_matches_pool(test_certs, index.target, engine_id, engine)
        assert engine.num_steps == steps
    finally:
        link.close()
    assert engine.check_block_invariants() == []
