"""Pins whose TTL runs out while the engine takes no step (hostile review of 8ef7b8b).

- The in-process serving loop (AsyncEngine: EngineServer without a core process) slept with no
  timeout while idle, so its stats counted a lapsed pin for as long as it stayed idle.
- A pin was refused for the room of a pin that had lapsed since the last step.
- A re-sync taken with no pass over the commands since a pin's expiry re-stated it.
- An automatic pin the index reported on a block an explicit pin with a TTL also held kept
  that TTL: the explicit pin's lapse dropped a block the index still pinned.

The engine is the real one on the tiny model; the link is built without its thread (no index
needed: the policy's own calls are what is checked)."""

from __future__ import annotations

import asyncio
import time

from engine_service import SamplingParams
from engine_service.index.link import connect_prefix_index
from engine_service.serving.async_engine import AsyncEngine
from engine_service.serving.local_pins import pin_locally
from prefix_index.api.ops import Pin, PinChange, PinState
from tests.service.index_fixtures import BLOCK_SIZE, Driver, make_engine, prompt_ids

ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
SHORT_TTL_S = 0.2


def cached_engine(tiny_llama_dir, *prompts: list[int], linked_as: str | None = None):
    """An engine that has run `prompts` (their blocks cached); `linked_as`: with the index's
    policy under that engine id (a link that never connects)."""
    engine = make_engine(tiny_llama_dir, num_blocks=48)
    if linked_as is not None:
        connect_prefix_index(engine, "127.0.0.1:1", linked_as, start=False)
    driver = Driver(engine)
    driver.add({f"r{i}": ids + [7] for i, ids in enumerate(prompts)}, ONE_TOKEN)
    driver.run_to_completion()
    return engine, [engine.hasher.chain(ids, None) for ids in prompts]


def test_an_idle_in_process_engine_stops_counting_a_lapsed_pin(tiny_llama_dir):
    engine, (chain,) = cached_engine(tiny_llama_dir, prompt_ids(5, 3 * BLOCK_SIZE))

    async def counts() -> tuple[int, int]:
        served = AsyncEngine(engine)
        served.start()
        try:
            assert await served.call(lambda e: pin_locally(e, chain, SHORT_TTL_S, False)) == 3
            await asyncio.sleep(3 * SHORT_TTL_S)  # idle, past the TTL
            idle = served.snapshot.num_pinned_in_budget
            return idle, await served.call(lambda e: e.pool.policy.num_pinned)
        finally:
            await served.stop()

    assert asyncio.run(counts()) == (0, 0)


def test_a_pin_has_the_room_of_one_that_lapsed_since_the_last_step(tiny_llama_dir):
    """Budget 3 blocks: the first pin (3 blocks) lapses with no step and no pass over the
    commands since (the offline LLM's pin_prefix: its own thread, between two generates); the
    second (3 other blocks) has its room."""
    engine, (first, second) = cached_engine(tiny_llama_dir, prompt_ids(5, 3 * BLOCK_SIZE),
                                            prompt_ids(6, 3 * BLOCK_SIZE))
    engine.pool.policy.pin_budget = 3
    assert pin_locally(engine, first, SHORT_TTL_S, False) == 3
    time.sleep(2 * SHORT_TTL_S)
    assert pin_locally(engine, second, 0.0, False) == 3
    assert engine.check_block_invariants() == []


def test_a_resync_leaves_out_a_pin_that_lapsed_since_the_last_pass(tiny_llama_dir):
    engine, (chain,) = cached_engine(tiny_llama_dir, prompt_ids(5, 3 * BLOCK_SIZE),
                                     linked_as="engine-resync-lapsed")
    policy = engine.pool.policy
    assert policy.pin_locally(chain[:2], 0.05) == 2
    assert policy.pin_locally(chain, 0.0) == 3  # a pin for good beside it
    time.sleep(0.1)  # no run_commands, no step: the re-sync is the first to look
    pins = [p.op for p in policy.resync_ops().ops if isinstance(p.op, Pin)]
    assert [len(op.chain) for op in pins] == [3], pins
    assert policy.num_pinned == 3
    assert engine.check_block_invariants() == []


def test_an_automatic_pin_outlives_the_explicit_pin_with_a_ttl_on_its_block(tiny_llama_dir):
    engine, (chain,) = cached_engine(tiny_llama_dir, prompt_ids(5, 3 * BLOCK_SIZE),
                                     linked_as="engine-auto-over-ttl")
    policy = engine.pool.policy
    assert policy.pin_locally(chain[:1], 0.05) == 1
    block = next(b.block_id for b in engine.pool.blocks if b.block_hash == chain[0])
    policy.on_pin_changes([PinChange(chain[0], block, PinState.AUTOMATIC)])
    time.sleep(0.1)
    engine.run_commands()  # the explicit pin lapses; the index's automatic one stays
    assert policy.is_pinned(chain[0])
    assert policy.num_pinned == 1
    assert engine.check_block_invariants() == []
