"""A pin's own prefill does not shrink the pin budget below the pin (issue 34 review).

PinPrefix checks the budget, computes the prefix (a prefill-only request) and then pins it.
The budget is the pool minus the running requests' peak demand: counted as demand, the
prefill of a prefix that fits the budget would take the budget below that very prefix (and a
window would hold it there), so the pin it computed for would be refused after all its work,
whenever the prefill takes more than one step. Through the offline API here; over gRPC on a
served engine in tests/service/test_pin_prefill_budget.py.
"""

from __future__ import annotations

from engine_service import SamplingParams

BLOCK = 16
NUM_BLOCKS = 40
CEILING = 0.8  # 32 blocks on a quiet engine
PREFIX_BLOCKS = 24  # within it; 40 - 25 = 15 if its own prefill were counted as demand
PREFIX = list(range(1000, 1000 + PREFIX_BLOCKS * BLOCK))
ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def test_a_prefix_within_the_budget_is_computed_and_pinned(make_llm, tiny_llama_dir):
    # Prefill in chunks of 64 tokens: the prefix takes six steps, so the engine sees it run.
    llm = make_llm(tiny_llama_dir, block_size=BLOCK, num_blocks=NUM_BLOCKS,
                   pin_budget_floor=0.1, pin_budget_ceiling=CEILING,
                   max_num_batched_tokens=64)
    engine = llm.llm_engine
    assert engine.pin_budget.blocks == int(CEILING * NUM_BLOCKS)
    assert llm.pin_prefix({"prompt_token_ids": PREFIX}) == PREFIX_BLOCKS
    assert engine.stats().num_pinned_blocks == PREFIX_BLOCKS
    assert engine.pin_budget.blocks == int(CEILING * NUM_BLOCKS)
    # An ordinary request's demand still counts: 11 blocks at its peak leave 29 (held for
    # the window, 30 s, after it ends).
    llm.generate({"prompt_token_ids": list(range(7, 7 + 4 * BLOCK))},
                 SamplingParams(temperature=0, max_tokens=7 * BLOCK - 1, ignore_eos=True))
    assert engine.pin_budget.blocks == NUM_BLOCKS - 11
    assert engine.stats().num_pinned_blocks == PREFIX_BLOCKS
    assert llm.pin_prefix({"prompt_token_ids": PREFIX}, unpin=True) == PREFIX_BLOCKS
    assert engine.stats().num_pinned_blocks == 0
