"""Prefix caching: shared prefixes are served from the cache, salts isolate tenants."""

from engine_service import SamplingParams
from tests.engine.prompts import PARAGRAPH

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _shared_prefix_prompts(tokenizer) -> tuple[list[int], list[int]]:
    prefix = tokenizer.encode(PARAGRAPH * 5)[:200]
    assert len(prefix) == 200
    first = prefix + tokenizer.encode(" Question one: what came first?")
    second = prefix + tokenizer.encode(" Question two: what came last?")
    return first, second


def _prefill_tokens(llm) -> int:
    """Tokens the engine has run through the model so far."""
    return llm.llm_engine.num_computed_tokens


def test_shared_prefix_is_cached_and_output_unchanged(make_llm, tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, block_size=16, num_blocks=128)
    first, second = _shared_prefix_prompts(llm.get_tokenizer())
    out_first = llm.generate({"prompt_token_ids": first}, PARAMS)[0]
    assert out_first.num_cached_tokens == 0
    before = _prefill_tokens(llm)
    out_second = llm.generate({"prompt_token_ids": second}, PARAMS)[0]
    computed = _prefill_tokens(llm) - before
    assert out_second.num_cached_tokens >= 192
    # Only the uncached part of the prompt is prefilled, then one token per decode step.
    assert computed == len(second) - out_second.num_cached_tokens + PARAMS.max_tokens - 1

    uncached = make_llm(tiny_llama_dir, block_size=16, num_blocks=128, enable_prefix_caching=False)
    reference = uncached.generate({"prompt_token_ids": second}, PARAMS)[0]
    assert reference.num_cached_tokens == 0
    assert out_second.outputs[0].token_ids == reference.outputs[0].token_ids


def test_different_cache_salt_shares_nothing(make_llm, tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, block_size=16, num_blocks=128)
    first, second = _shared_prefix_prompts(llm.get_tokenizer())
    llm.generate({"prompt_token_ids": first, "cache_salt": "tenant-a"}, PARAMS)
    other = llm.generate({"prompt_token_ids": second, "cache_salt": "tenant-b"}, PARAMS)[0]
    assert other.num_cached_tokens == 0
    same = llm.generate({"prompt_token_ids": second, "cache_salt": "tenant-a"}, PARAMS)[0]
    assert same.num_cached_tokens >= 192


def test_identical_prompt_recomputes_only_last_token(make_llm, tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, block_size=16, num_blocks=128)
    prompt = list(range(100, 164))  # exactly 4 full blocks
    llm.generate({"prompt_token_ids": prompt}, PARAMS)
    again = llm.generate({"prompt_token_ids": prompt}, PARAMS)[0]
    # The block holding the last prompt token is recomputed so there are logits to sample.
    assert again.num_cached_tokens == 48


def test_hash_collision_never_shares_other_tokens(make_llm, tiny_llama_dir):
    """A cached block whose stored tokens differ from the request's is not shared, even when
    the hash matches (forced here by overwriting the stored tokens)."""
    llm = make_llm(tiny_llama_dir, block_size=16, num_blocks=128)
    prompt = list(range(200, 248))
    llm.generate({"prompt_token_ids": prompt}, PARAMS)
    pool = llm.llm_engine.pool
    for block in pool.blocks:
        if block.token_ids is not None:
            block.token_ids = tuple(t + 1 for t in block.token_ids)
    again = llm.generate({"prompt_token_ids": prompt}, PARAMS)[0]
    assert again.num_cached_tokens == 0
