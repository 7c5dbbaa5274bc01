"""A request that starts with a pinned prefix is admitted on the blocks it needs beyond it
(issue 34 review). Pinned idle blocks are never counted free, so acquiring them as cache hits
takes nothing from the free pool; charged as if it did, a request that hits a large pinned
prefix on a tight pool looked too big: it waited while others ran, and alone it broke the very
pins it was about to use. Through the offline API on an engine without the index."""

from __future__ import annotations

from engine_service import SamplingParams

BLOCK = 16
NUM_BLOCKS = 40
PREFIX_BLOCKS = 24  # pinned: 16 blocks stay free
PREFIX = list(range(1000, 1000 + PREFIX_BLOCKS * BLOCK))
ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def test_a_request_on_a_pinned_prefix_keeps_the_pins(make_llm, tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, block_size=BLOCK, num_blocks=NUM_BLOCKS,
                   pin_budget_floor=0.1, pin_budget_ceiling=0.8)
    engine = llm.llm_engine
    assert llm.pin_prefix({"prompt_token_ids": PREFIX}) == PREFIX_BLOCKS
    assert engine.stats().num_free_blocks == NUM_BLOCKS - PREFIX_BLOCKS
    # 24 pinned blocks shared, 5 more allocated: fits the 16 free ones.
    [out] = llm.generate({"prompt_token_ids": PREFIX + list(range(7, 7 + 4 * BLOCK + 3))},
                         ONE_TOKEN)
    assert out.num_cached_tokens == PREFIX_BLOCKS * BLOCK
    stats = engine.stats()
    assert stats.num_pins_released == 0
    assert stats.num_pinned_blocks == PREFIX_BLOCKS
    # Twice at once: each needs 5 of the 16 free blocks beside the shared pinned prefix.
    outs = llm.generate([{"prompt_token_ids": PREFIX + list(range(s, s + 4 * BLOCK + 3))}
                         for s in (100, 200)], ONE_TOKEN)
    assert [o.num_cached_tokens for o in outs] == [PREFIX_BLOCKS * BLOCK] * 2
    assert engine.stats().num_pins_released == 0
    assert engine.stats().num_pinned_blocks == PREFIX_BLOCKS
