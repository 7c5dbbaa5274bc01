"""Greedy output must match HF transformers token for token."""

import pytest

from engine_service import SamplingParams
from tests.engine.prompts import parity_prompts
from tests.support.hf_reference import hf_greedy, hf_greedy_ignore_eos
from tests.support.tiny_models import make_tiny_model


def test_smollm2_batch_matches_hf_generate(smollm2_llm, smollm2_dir):
    prompts = parity_prompts(smollm2_llm.get_tokenizer())
    assert len(prompts) >= 8 and min(map(len, prompts)) == 1 and max(map(len, prompts)) > 300
    outputs = smollm2_llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=64)
    )
    expected = hf_greedy(smollm2_dir, prompts, 64)
    for prompt, out, ref in zip(prompts, outputs, expected, strict=True):
        assert out.outputs[0].token_ids == ref, f"prompt of {len(prompt)} tokens diverged"


@pytest.mark.parametrize("block_size", [8, 16, 32, 64])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "phi3"])
def test_tiny_models_match_hf_at_block_sizes(kind, block_size, make_llm, request):
    model_dir = request.getfixturevalue(f"tiny_{kind}_dir")
    llm = make_llm(model_dir, block_size=block_size, num_blocks=256)
    prompts = parity_prompts(llm.get_tokenizer())
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    expected = hf_greedy_ignore_eos(model_dir, prompts, 24)
    assert [o.outputs[0].token_ids for o in outputs] == expected


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_attention_and_mlp_biases_match_hf(kind, make_llm, smollm2_dir, tmp_path):
    """Llama's attention_bias puts a bias on q, k, v and o, its mlp_bias on gate, up and down;
    Qwen3's attention_bias on q, k, v and o. (Our fused CPU decoder adds none but qkv's: these
    run the layer loop.)"""
    extra = {"attention_bias": True, **({"mlp_bias": True} if kind == "llama" else {})}
    model_dir = make_tiny_model(kind, tmp_path, tokenizer_dir=smollm2_dir, seed=5,
                                extra_config=extra)
    llm = make_llm(model_dir, block_size=16, num_blocks=256)
    layer = llm.llm_engine.runner.model.layers[0]
    assert layer.self_attn.o_proj.bias is not None
    assert (layer.mlp.down_proj.bias is not None) == (kind == "llama")
    prompts = parity_prompts(llm.get_tokenizer())
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy_ignore_eos(model_dir, prompts,
                                                                             16)


def test_text_prompt_and_chat_give_text(smollm2_llm):
    out = smollm2_llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=24),
    )[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason in ("stop", "length")
