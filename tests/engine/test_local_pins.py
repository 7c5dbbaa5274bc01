"""Pins on an engine without the prefix index (issue 34), through the offline API: a pinned
prefix is computed when it is not cached, then stays cached however full the pool gets, within
the pin budget (core/pin_budget.py: what the pool spares beside the running requests, 10-50%
of it); unpinning or a lapsed TTL makes it evictable again."""

from __future__ import annotations

import random
import time

import pytest

from engine_service import SamplingParams
from engine_service.core.prefix_policy import PinBudgetFull

BLOCK = 16
ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
NUM_BLOCKS = 40  # pin budget: 4 to 20 blocks
FIXED_BUDGET = dict(pin_budget_floor=0.1, pin_budget_ceiling=0.1)  # 4 blocks, whatever runs


def prompt(start: int, num_tokens: int) -> list[int]:
    return list(range(start, start + num_tokens))


HOT = prompt(1000, 3 * BLOCK + 5)  # 3 full blocks


def cached(llm, token_ids: list[int]) -> int:
    return llm.generate({"prompt_token_ids": token_ids}, ONE_TOKEN)[0].num_cached_tokens


def flood(llm, start: int) -> None:
    """Prompts that need the whole pool, one at a time: every unpinned idle block is evicted."""
    for i in range(3):
        llm.generate({"prompt_token_ids": prompt(start + 1000 * i, 35 * BLOCK)}, ONE_TOKEN)


def test_pin_computes_a_prefix_and_keeps_it_through_a_full_pool(make_llm, tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, block_size=BLOCK, num_blocks=NUM_BLOCKS)
    engine = llm.llm_engine
    steps = engine.stats().num_steps
    assert llm.pin_prefix({"prompt_token_ids": HOT}) == 3  # computed now: nothing was cached
    assert engine.stats().num_steps == steps + 1  # one prefill step, no decode
    assert engine.stats().num_pinned_blocks == 3
    flood(llm, 10_000)
    assert cached(llm, HOT) == 3 * BLOCK  # the first request pays no prefill for the prefix
    # Unpinned, it is an ordinary cached prefix again: the next flood evicts it.
    assert llm.pin_prefix({"prompt_token_ids": HOT}, unpin=True) == 3
    assert engine.stats().num_pinned_blocks == 0
    flood(llm, 20_000)
    assert cached(llm, HOT) == 0


def test_without_a_pin_the_flood_evicts_the_prefix(make_llm, tiny_llama_dir):
    """The control for the test above: the same flood evicts an unpinned prefix."""
    llm = make_llm(tiny_llama_dir, block_size=BLOCK, num_blocks=NUM_BLOCKS)
    assert cached(llm, HOT) == 0
    flood(llm, 10_000)
    assert cached(llm, HOT) == 0


def test_pins_past_the_budget_are_refused_whole_before_any_prefill(make_llm, tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, block_size=BLOCK, num_blocks=NUM_BLOCKS, **FIXED_BUDGET)
    assert llm.pin_prefix({"prompt_token_ids": HOT}) == 3
    other = prompt(5000, 2 * BLOCK)
    steps = llm.llm_engine.stats().num_steps
    with pytest.raises(PinBudgetFull, match="pin budget of 4 blocks"):
        llm.pin_prefix({"prompt_token_ids": other})
    assert llm.llm_engine.stats().num_steps == steps  # nothing computed for a refused pin
    assert llm.llm_engine.stats().num_pinned_blocks == 3  # nothing of it was pinned
    # Pinning what is pinned already renews it and takes no budget.
    assert llm.pin_prefix({"prompt_token_ids": HOT}) == 3
    # Another salt is another prefix (other blocks).
    with pytest.raises(PinBudgetFull):
        llm.pin_prefix({"prompt_token_ids": HOT, "cache_salt": "tenant-b"})


def test_a_pin_lapses_after_its_ttl(make_llm, tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, block_size=BLOCK, num_blocks=NUM_BLOCKS)
    assert llm.pin_prefix({"prompt_token_ids": HOT}, ttl_s=0.2) == 3
    time.sleep(0.3)
    flood(llm, 10_000)  # the first step of the flood lapses the pin
    assert llm.llm_engine.stats().num_pinned_blocks == 0
    assert cached(llm, HOT) == 0


def test_an_idle_engine_lapses_a_pin_between_steps(make_llm, tiny_llama_dir):
    """No request, no step: the engine thread's pass over its commands lapses the pin, so its
    stats do not count it until the next request (the serving core runs that pass while idle,
    a step never comes)."""
    llm = make_llm(tiny_llama_dir, block_size=BLOCK, num_blocks=NUM_BLOCKS)
    engine = llm.llm_engine
    assert llm.pin_prefix({"prompt_token_ids": HOT}, ttl_s=0.2) == 3
    steps = engine.num_steps
    time.sleep(0.3)
    engine.run_commands()
    assert engine.num_steps == steps
    assert engine.stats().num_pinned_in_budget == 0
    assert engine.snapshot.num_pinned_in_budget == 0  # what the serving front reads
    assert engine.pool.num_free_blocks == NUM_BLOCKS  # the lapsed pin's blocks are evictable


def test_overlapping_pins_hold_their_shared_blocks_while_either_lasts(make_llm,
                                                                      tiny_llama_dir):
    """A (2 blocks) pinned for good, AB (3 blocks, starting with A) for 0.2 s: when AB lapses
    A's blocks stay pinned, and unpinning AB again (nothing left) leaves them too."""
    llm = make_llm(tiny_llama_dir, block_size=BLOCK, num_blocks=NUM_BLOCKS)
    a, ab = HOT[:2 * BLOCK], HOT
    assert llm.pin_prefix({"prompt_token_ids": a}) == 2
    assert llm.pin_prefix({"prompt_token_ids": ab}, ttl_s=0.2) == 3
    assert llm.llm_engine.pool.policy.num_pinned == 3
    time.sleep(0.3)
    flood(llm, 10_000)
    assert llm.llm_engine.pool.policy.num_pinned == 2
    assert cached(llm, ab) == 2 * BLOCK  # A's blocks kept, AB's leaf evicted
    assert llm.pin_prefix({"prompt_token_ids": ab}, unpin=True) == 0
    flood(llm, 20_000)
    assert cached(llm, a + [5]) == 2 * BLOCK


def test_a_lone_request_that_needs_the_pinned_blocks_takes_whole_pins(make_llm,
                                                                       tiny_llama_dir):
    """A request needing 38 of 40 blocks runs (pins give way), and the pin it broke is
    dropped whole: no pinned block is left behind an evicted parent."""
    llm = make_llm(tiny_llama_dir, block_size=BLOCK, num_blocks=NUM_BLOCKS)
    assert llm.pin_prefix({"prompt_token_ids": HOT}) == 3
    out = llm.generate({"prompt_token_ids": prompt(20_000, 38 * BLOCK - 1)}, ONE_TOKEN)[0]
    assert len(out.outputs[0].token_ids) == 1
    assert llm.llm_engine.pool.policy.num_pinned == 0
    assert llm.llm_engine.stats().num_pins_released > 0


def test_an_engine_without_the_prefix_cache_refuses_pins(make_llm, tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, block_size=BLOCK, num_blocks=NUM_BLOCKS,
                   enable_prefix_caching=False)
    with pytest.raises(ValueError, match="needs the prefix cache"):
        llm.pin_prefix({"prompt_token_ids": HOT})


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"ttl_s": -1}, "ttl_s must be a number of seconds in"),
    ({"ttl_s": float("nan")}, "ttl_s must be a number of seconds in"),
    ({"ttl_s": 1e308}, "ttl_s must be a number of seconds in"),
    ({"ttl_s": True}, "ttl_s must be a number of seconds in"),
    ({"unpin": "no"}, "unpin must be True or False"),
    ({"cache_salt": "b"}, "cache_salt is given twice"),
])
def test_pin_validation(make_llm, tiny_llama_dir, kwargs, message):
    llm = make_llm(tiny_llama_dir, block_size=BLOCK, num_blocks=NUM_BLOCKS)
    with pytest.raises(ValueError, match=message):
        llm.pin_prefix({"prompt_token_ids": HOT, "cache_salt": "a"}, **kwargs)
    with pytest.raises(ValueError, match=r"at least one full block \(16 tokens\).*got 10"):
        llm.pin_prefix({"prompt_token_ids": HOT[:10]})


def test_random_pins_generations_and_floods_keep_the_pool_consistent(make_llm,
                                                                     tiny_llama_dir):
    """Seeded random sequences of pins, unpins, generations and floods; after every operation
    the pool's invariants hold and every pinned prefix is still wholly cached. (A fixed
    budget of 4 blocks: a flood's 35 blocks always fit beside the pins.)"""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    llm = make_llm(tiny_llama_dir, block_size=BLOCK, num_blocks=NUM_BLOCKS, **FIXED_BUDGET)
    engine = llm.llm_engine
    prefixes = [prompt(20_000 + 1000 * i, rng.randint(1, 2) * BLOCK + 3) for i in range(4)]
    pinned: set[int] = set()
    for step in range(40):
        op = rng.choice(("pin", "unpin", "generate", "flood"))
        i = rng.randrange(len(prefixes))
        where = f"seed {seed}, step {step}, {op} {i}"
        if op == "pin":
            try:
                llm.pin_prefix({"prompt_token_ids": prefixes[i]})
                pinned.add(i)
            except PinBudgetFull:
                assert engine.pool.policy.num_pinned + len(prefixes[i]) // BLOCK > 4, where
        elif op == "unpin":
            llm.pin_prefix({"prompt_token_ids": prefixes[i]}, unpin=True)
            pinned.discard(i)
        elif op == "generate":
            cached(llm, prompt(25_000 + 300 * rng.randrange(50), rng.randint(10, 200)))
        else:
            flood(llm, 41_000 + 50 * (step % 10))
        assert engine.check_block_invariants() == [], where
        for j in pinned:
            full = len(prefixes[j]) // BLOCK * BLOCK
            assert cached(llm, prefixes[j]) == full, where


def test_the_local_budget_follows_the_running_requests(make_llm, tiny_llama_dir):
    """Idle, the budget is the ceiling (half the pool: 20 blocks); a request that will hold 30
    blocks at its peak leaves 10 to spare, so a pin that fits 20 but not 10 is refused while it
    runs; once it is done (a window of 0 s: at once) the ceiling is back and the pin is made.
    A shrinking budget drops no pin."""
    llm = make_llm(tiny_llama_dir, block_size=BLOCK, num_blocks=NUM_BLOCKS,
                   pin_budget_window_s=0.0)
    engine = llm.llm_engine
    assert engine.pool.policy.pin_budget == 20
    assert llm.pin_prefix({"prompt_token_ids": HOT}) == 3
    big = prompt(30_000, 20 * BLOCK)  # 20 + 10 output blocks = 30 at its peak
    engine.add_request("big", big, SamplingParams(temperature=0, max_tokens=10 * BLOCK,
                                                   ignore_eos=True))
    engine.step()
    assert engine.pin_budget.peak_demand == 30
    assert engine.pool.policy.pin_budget == 10
    assert engine.pool.policy.num_pinned == 3  # kept
    eight = prompt(40_000, 8 * BLOCK + 1)  # 8 more blocks: 11 > 10
    with pytest.raises(PinBudgetFull, match="pin budget of 10 blocks"):
        engine.pool.policy.check_pin(engine.hasher.chain(eight[:8 * BLOCK], None))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.pool.policy.pin_budget == 20
    assert llm.pin_prefix({"prompt_token_ids": eight}) == 8
    assert engine.pool.policy.num_pinned == 11
