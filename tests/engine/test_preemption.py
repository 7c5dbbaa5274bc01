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


GROUP_PROMPTS = ["The capital of France is", "Once upon a time, in a land far away",
                 "def fib(n):", "Hello"]
GROUP_SAMPLING = {
    "greedy": SamplingParams(n=4, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
    "seeded": SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=MAX_TOKENS,
                             ignore_eos=True),
}


@pytest.fixture(scope="module")
def roomy_group_outputs(tiny_llama_dir):
    from engine_service import LLM

    llm = LLM(str(tiny_llama_dir), block_size=8, num_blocks=1024, dtype="float32")
    return {name: [[c.token_ids for c in o.outputs] for o in llm.generate(GROUP_PROMPTS, p)]
            for name, p in GROUP_SAMPLING.items()}


@pytest.mark.parametrize("sampling", sorted(GROUP_SAMPLING))
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_n4_groups_preempted_often_match_a_roomy_pool(mode, sampling, make_llm, tiny_llama_dir,
                                                      roomy_group_outputs):
    """Four n=4 groups in 28 blocks of 8 (one group at its peak needs about 27): the groups
    preempt each other over and over, are re-admitted (recompute: the shared prompt counted
    once, the other samples park until it is recomputed) and still give exactly the outputs of
    a pool where nothing is preempted. This hung (recompute) or mixed up KV (seeded) before."""
    # float32: outputs must not depend on which rows share a batch (they do not, in fp32).
    llm = make_llm(tiny_llama_dir, block_size=8, num_blocks=28, preemption_mode=mode,
                   swap_space=16 * llm_block_bytes(tiny_llama_dir), dtype="float32")
    outputs = llm.generate(GROUP_PROMPTS, GROUP_SAMPLING[sampling])
    assert [[c.token_ids for c in o.outputs] for o in outputs] == roomy_group_outputs[sampling]
    counters = llm.llm_engine.scheduler.counters
    assert counters.num_preemptions >= 4
    assert (counters.num_swapped_out if mode == "swap" else counters.num_recomputed) > 0


def test_bf16_seeded_n4_groups_preempted_often_match_a_roomy_pool(make_llm, tiny_llama_dir):
    """The same in bfloat16 on our linears (AVX512-BF16 or AMX): a recompute runs a sequence's
    tokens in another batch than the first time, and its seeded samples still come out the
    same, because a row's linear and attention results do not depend on its batch."""
    from engine_service import LLM
    from engine_service.model.models.packed_linear import bf16_linear_kernel

    if bf16_linear_kernel() not in ("amx", "vdpbf16ps"):
        pytest.skip("bf16 linears are not ours here (oneDNN's depend on the batch)")
    params = GROUP_SAMPLING["seeded"]
    roomy = LLM(str(tiny_llama_dir), block_size=8, num_blocks=1024, dtype="bfloat16")
    expected = [[c.token_ids for c in o.outputs] for o in roomy.generate(GROUP_PROMPTS, params)]
    del roomy
    llm = make_llm(tiny_llama_dir, block_size=8, num_blocks=28, preemption_mode="recompute",
                   dtype="bfloat16")
    outputs = llm.generate(GROUP_PROMPTS, params)
    assert [[c.token_ids for c in o.outputs] for o in outputs] == expected
    assert llm.llm_engine.scheduler.counters.num_recomputed > 0


def llm_block_bytes(model_dir) -> int:
    import torch

    from engine_service.model.config import load_model_config
    from engine_service.model.runner import kv_bytes_per_block

    return kv_bytes_per_block(load_model_config(model_dir), 8, torch.float32)


def test_group_that_can_never_fit_is_refused_naming_n(make_llm, tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, block_size=8, num_blocks=20)
    params = SamplingParams(n=4, max_tokens=40, ignore_eos=True)
    with pytest.raises(ValueError, match=r"max_tokens and n must fit .* got max_tokens=40, n=4"):
        llm.generate({"prompt_token_ids": list(range(10, 30))}, params)
    # The same request with n=1 fits: the group's n sequences are what does not.
    assert llm.generate({"prompt_token_ids": list(range(10, 30))},
                        SamplingParams(max_tokens=40, ignore_eos=True))[0].finished
