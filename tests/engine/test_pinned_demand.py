"""A running request's demand counts only the blocks pins do not hold (issue 34 review).

The pin budget is the pool less the running requests' peak demand. A request that reads a
pinned prefix holds those blocks as pins already: counted in its demand too, they were counted
twice, and a request on a pinned prefix shrank the budget below that very prefix (held there
for the window). Through the offline API, on the local LRU's pins.
"""

from __future__ import annotations

from engine_service import SamplingParams

BLOCK = 16
NUM_BLOCKS = 40
CEILING = 0.8  # 32 blocks on a quiet engine
PREFIX_BLOCKS = 24
PREFIX = list(range(1000, 1000 + PREFIX_BLOCKS * BLOCK))
# 24 pinned blocks + 4 prompt tokens + 28 generated = 416 tokens: 26 blocks at its peak, of
# which 2 are not pinned. Counted whole, 26 would leave a budget of 40 - 26 = 14.
TAIL = [7, 8, 9, 10]
GROWS = SamplingParams(temperature=0, max_tokens=28, ignore_eos=True)


def test_a_request_on_a_pinned_prefix_demands_only_its_unpinned_blocks(make_llm,
                                                                       tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, block_size=BLOCK, num_blocks=NUM_BLOCKS,
                   pin_budget_floor=0.1, pin_budget_ceiling=CEILING)
    engine = llm.llm_engine
    assert llm.pin_prefix({"prompt_token_ids": PREFIX}) == PREFIX_BLOCKS
    [out] = llm.generate({"prompt_token_ids": PREFIX + TAIL}, GROWS)
    assert out.num_cached_tokens == PREFIX_BLOCKS * BLOCK  # it read the pinned prefix
    assert engine.pin_budget.peak_demand == 2
    assert engine.pin_budget.blocks == int(CEILING * NUM_BLOCKS)
    assert engine.stats().num_pinned_in_budget == PREFIX_BLOCKS  # the pins stayed


def test_two_requests_on_one_pinned_prefix(make_llm, tiny_llama_dir):
    """Both read the same pinned blocks: neither counts them (each still counts its own)."""
    llm = make_llm(tiny_llama_dir, block_size=BLOCK, num_blocks=NUM_BLOCKS,
                   pin_budget_floor=0.1, pin_budget_ceiling=CEILING)
    engine = llm.llm_engine
    assert llm.pin_prefix({"prompt_token_ids": PREFIX}) == PREFIX_BLOCKS
    outs = llm.generate([{"prompt_token_ids": PREFIX + TAIL},
                         {"prompt_token_ids": PREFIX + TAIL[::-1]}], GROWS)
    assert [o.num_cached_tokens for o in outs] == [PREFIX_BLOCKS * BLOCK] * 2
    assert engine.pin_budget.peak_demand == 4
    assert engine.pin_budget.blocks == int(CEILING * NUM_BLOCKS)
