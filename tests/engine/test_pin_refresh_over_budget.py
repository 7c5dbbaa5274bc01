"""Pinning a prefix again (a longer TTL) adds no block, so a budget that shrank below the
pins held does not refuse it (issue 34 review): a shrink never drops an explicit pin, and a
pin with a TTL that could not be renewed while the budget is down would lapse because of the
shrink. Pins that add blocks are still refused past the budget. Offline API, no index; the
index's side is tests/prefix_index/test_set_pin_budget.py."""

from __future__ import annotations

import pytest

from engine_service import SamplingParams
from engine_service.core.prefix_policy import PinBudgetFull

BLOCK = 16
NUM_BLOCKS = 40  # budget 20 while quiet
PREFIX_BLOCKS = 12
PREFIX = list(range(1000, 1000 + PREFIX_BLOCKS * BLOCK))
# 2 prompt blocks and 33 more at its peak: 35 of 40, the budget down to 5 (below the 12
# pinned), held there by the hour-long window after the request is aborted (it could not
# finish beside the pins).
BIG = SamplingParams(temperature=0, max_tokens=33 * BLOCK - 1, ignore_eos=True)


def test_a_pin_is_renewed_while_the_budget_is_below_the_pins(make_llm, tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, block_size=BLOCK, num_blocks=NUM_BLOCKS,
                   pin_budget_floor=0.1, pin_budget_ceiling=0.5, pin_budget_window_s=3600.0)
    engine = llm.llm_engine
    assert llm.pin_prefix({"prompt_token_ids": PREFIX}, ttl_s=600) == PREFIX_BLOCKS
    engine.add_request("big", list(range(7, 7 + 2 * BLOCK)), BIG)
    engine.step()
    engine.step()
    engine.abort_request("big")
    engine.step()
    assert engine.pin_budget.blocks == NUM_BLOCKS - 35
    assert engine.stats().num_pinned_blocks == PREFIX_BLOCKS  # the shrink dropped none
    # Renewed: nothing new is pinned.
    assert llm.pin_prefix({"prompt_token_ids": PREFIX}, ttl_s=1200) == PREFIX_BLOCKS
    assert engine.stats().num_pinned_blocks == PREFIX_BLOCKS
    # A pin that adds a block is refused while the pins pass the budget.
    with pytest.raises(PinBudgetFull):
        llm.pin_prefix({"prompt_token_ids": PREFIX + list(range(9, 9 + BLOCK))})
    assert engine.stats().num_pinned_blocks == PREFIX_BLOCKS
    assert llm.pin_prefix({"prompt_token_ids": PREFIX}, unpin=True) == PREFIX_BLOCKS
