"""Outputs stay exact when the pool is too small (preemption) or prefill is chunked."""

import pytest

from engine_service import SamplingParams
from tests.engine.prompts import parity_prompts
from tests.support.hf_reference import hf_greedy_ignore_eos

MAX_TOKENS = 40


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, smollm2_dir):
    from transformers import AutoTokenizer

    prompts = parity_prompts(AutoTokenizer.from_pretrained(smollm2_dir))[:7]
    return prompts, hf_greedy_ignore_eos(tiny_llama_dir, prompts, MAX_TOKENS)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_small_pool_preempts_and_matches(mode, make_llm, tiny_llama_dir, reference):
    prompts, expected = reference
    # The longest request needs ceil((max prompt + 40) / 8) blocks; give it little more.
    longest = max(len(p) for p in prompts) + MAX_TOKENS
    num_blocks = -(-longest // 8) + 6
    llm = make_llm(tiny_llama_dir, block_size=8, num_blocks=num_blocks, preemption_mode=mode)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    counters = llm.llm_engine.scheduler.counters
    assert counters.num_preemptions > 0
    if mode == "swap":
        assert counters.num_swapped_out > 0
    else:
        assert counters.num_recomputed > 0


def test_small_prefill_chunks_match(make_llm, tiny_llama_dir, reference):
    prompts, expected = reference
    llm = make_llm(tiny_llama_dir, block_size=16, num_blocks=256, max_num_batched_tokens=20)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    # A 300-token prompt in 20-token chunks needs many steps before its first token.
    assert llm.llm_engine.num_steps > max(len(p) for p in prompts) // 20
