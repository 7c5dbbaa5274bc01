"""The standalone engine's prefix cache (`--prefix-index none`: LocalLRUPolicy), its eviction
order seen through the public API: a finished request's full blocks stay cached; when a new
request needs room, the least recently released blocks go first, and within one chain the leaf
before its parent, so what survives of a prompt is always a prefix a later request can use."""

from __future__ import annotations

from engine_service import SamplingParams

BLOCK = 16
ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def prompt(start: int, num_tokens: int) -> list[int]:
    """Token ids no other prompt here shares (each prompt its own range)."""
    return list(range(start, start + num_tokens))


# 3 full blocks and 2 tokens: 3 blocks cached once it ends; a repeat can hit all 3 (48 tokens).
A, B = prompt(1000, 50), prompt(2000, 50)
C = prompt(3000, 100)  # 6 full blocks and 4 tokens: 7 blocks while it runs


def cached(llm, token_ids: list[int]) -> int:
    return llm.generate({"prompt_token_ids": token_ids}, ONE_TOKEN)[0].num_cached_tokens


def test_least_recently_released_first_and_leaf_before_parent(make_llm, tiny_llama_dir):
    # 12 blocks: A and B leave 6 cached and 6 free; C needs 7, so exactly one cached block goes.
    llm = make_llm(tiny_llama_dir, block_size=BLOCK, num_blocks=12)
    assert cached(llm, A) == 0 and cached(llm, B) == 0
    assert cached(llm, C) == 0
    # The victim was A's (released before B's), and A's leaf: A keeps its first two blocks.
    assert cached(llm, A) == 2 * BLOCK
    # Probing A took one more block (its lost leaf again), the least recently released one
    # left: B's leaf.
    assert cached(llm, B) == 2 * BLOCK
    # Probing B took one more too: A's blocks were released again after the probe, so the
    # oldest left is C's leaf (C released its 6 blocks leaf first, before both probes).
    assert cached(llm, C) == 5 * BLOCK


def test_a_reused_prefix_moves_to_the_back(make_llm, tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, block_size=BLOCK, num_blocks=12)
    cached(llm, A), cached(llm, B)
    assert cached(llm, A) == 3 * BLOCK  # A used again: released after B now
    assert cached(llm, C) == 0  # needs one cached block: B's leaf, not A's
    assert cached(llm, A) == 3 * BLOCK
    assert cached(llm, B) == 2 * BLOCK


def test_a_pool_full_of_cache_is_reused_whole(make_llm, tiny_llama_dir):
    """Every block cached and none free: a new request evicts exactly what it needs, oldest
    chains first, each from its leaf."""
    llm = make_llm(tiny_llama_dir, block_size=BLOCK, num_blocks=12)
    prompts = [prompt(10_000 + 1000 * i, 50) for i in range(4)]  # 4 x 3 cached = 12 blocks
    for p in prompts:
        assert cached(llm, p) == 0
    stats = llm.llm_engine.stats()
    assert stats.num_free_blocks == 12  # cached blocks count as free: evictable
    assert cached(llm, prompt(20_000, 80)) == 0  # 5 full blocks + 1: needs 6
    # Gone: all of the first prompt and all of the second (released leaf first, so the second
    # lost its leaf, then its middle, then its root); the last two are whole.
    assert [cached(llm, p) for p in reversed(prompts)] == [3 * BLOCK, 3 * BLOCK, 0, 0]
