"""bfloat16 end to end (weights, KV cache, activations) against HF transformers in bfloat16,
compared as vLLM compares lower precision (tests/support/logprobs_close.py), on SmolLM2 and the
tiny models, at block sizes 8 and 16. The float32 parity tests (test_hf_parity.py) stay exact."""

import pytest
import torch

from engine_service import SamplingParams
from tests.engine.prompts import parity_prompts
from tests.support.hf_reference import hf_greedy_top_logprobs
from tests.support.logprobs_close import compare_greedy

TOP_K = 5
# A near-tie: top-1 and top-2 within 0.1 nats. bf16 keeps 8 significant bits, so a logit of
# magnitude ~10-20 moves by ~0.05 between two bf16 implementations that round differently;
# a gap under 0.1 can flip, a larger one should not.
TIE_MARGIN = 0.1


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize(("kind", "max_tokens"), [("smollm2", 32), ("tiny_llama", 24),
                                                  ("tiny_qwen2", 24)])
def test_bf16_greedy_is_close_to_hf_bf16(kind, max_tokens, block_size, make_llm, request):
    model_dir = request.getfixturevalue(f"{kind}_dir")
    llm = make_llm(model_dir, dtype="bfloat16", block_size=block_size, num_blocks=512)
    assert llm.llm_engine.runner.kv_caches.dtype == torch.bfloat16
    prompts = parity_prompts(llm.get_tokenizer())
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                            logprobs=TOP_K)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    compared = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        ours = [(e.token_id, e.top) for e in out.outputs[0].logprobs]
        reference = hf_greedy_top_logprobs(model_dir, prompt, max_tokens, torch.bfloat16, TOP_K)
        result = compare_greedy(ours, reference, TIE_MARGIN)
        compared += result.num_compared
    # Not vacuous: most positions were compared with identical contexts on both sides.
    assert compared >= len(prompts) * max_tokens // 2, compared
