"""What a request returns: stop conditions, logprobs, streaming deltas, other model formats."""

import pytest
import torch

from engine_service import SamplingParams
from tests.engine.prompts import parity_prompts
from tests.support.hf_reference import hf_greedy_ignore_eos, load_hf_model
from tests.support.tiny_models import LLAMA3_ROPE_SCALING, make_tiny_model


def test_stop_string_ends_output_and_never_leaks(smollm2_llm):
    tokenizer = smollm2_llm.get_tokenizer()
    prompt = tokenizer.encode("Count: 1, 2, 3, 4, 5,")
    free = smollm2_llm.generate(
        {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=20)
    )[0].outputs[0]
    assert " 8" in free.text, free.text  # the greedy continuation keeps counting
    out = smollm2_llm.generate(
        {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=20, stop=[" 8"])
    )[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == " 8"
    assert " 8" not in out.text and free.text.startswith(out.text)
    kept = smollm2_llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0, max_tokens=20, stop=[" 8"], include_stop_str_in_output=True),
    )[0].outputs[0]
    assert kept.text.endswith(" 8")


def test_stop_token_ids_min_tokens_and_length(make_llm, tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, num_blocks=64)
    prompt = {"prompt_token_ids": [11, 12, 13]}
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    tokens = free[0].outputs[0].token_ids
    assert len(tokens) == 12 and free[0].outputs[0].finish_reason == "length"
    stop_id = tokens[4]
    first = tokens.index(stop_id)
    stopped = llm.generate(
        prompt, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id])
    )[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_id
    assert stopped.token_ids == tokens[: first + 1]
    held = llm.generate(
        prompt,
        SamplingParams(
            temperature=0, max_tokens=12, stop_token_ids=[stop_id], min_tokens=first + 2
        ),
    )[0].outputs[0]
    assert len(held.token_ids) > first + 1


def test_logprobs_match_hf_log_softmax(make_llm, tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, num_blocks=64)
    prompt = [21, 22, 23, 24, 25]
    out = llm.generate(
        {"prompt_token_ids": prompt},
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3),
    )[0].outputs[0]
    model = load_hf_model(str(tiny_llama_dir.resolve()))
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1 : -1]
    expected = torch.log_softmax(logits.float(), dim=-1)
    assert len(out.logprobs) == 6
    for step, entry in enumerate(out.logprobs):
        assert entry.token_id == out.token_ids[step]
        assert entry.logprob == pytest.approx(expected[step, entry.token_id].item(), abs=1e-4)
        top3 = expected[step].topk(3).indices.tolist()
        assert set(top3) <= set(entry.top)


def test_streaming_deltas_add_up(make_llm, tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, num_blocks=64)
    engine = llm.llm_engine
    engine.add_request(
        "s", [31, 32, 33], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    )
    text, tokens = "", []
    while engine.has_unfinished_requests():
        for output in engine.step():
            text += output.outputs[0].text_delta
            tokens += output.outputs[0].token_ids_delta
            last = output
    assert last.finished and tokens == last.outputs[0].token_ids and text == last.outputs[0].text


def test_abort_frees_blocks_at_once(make_llm, tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, num_blocks=64)
    engine = llm.llm_engine
    engine.add_request("a", list(range(40)), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.stats().num_free_blocks < 64
    final = engine.abort_request("a")
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert engine.check_block_invariants() == []


def test_rope_scaled_llama_matches_hf(make_llm, tmp_path, smollm2_dir):
    model_dir = make_tiny_model(
        "llama",
        tmp_path / "rope",
        tokenizer_dir=smollm2_dir,
        seed=3,
        rope_scaling=LLAMA3_ROPE_SCALING,
    )
    llm = make_llm(model_dir, num_blocks=128)
    prompts = parity_prompts(llm.get_tokenizer())[:4]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy_ignore_eos(model_dir, prompts, 16)


def test_gguf_file_loads_and_matches_converted_dir(make_llm, smollm2_dir, smollm2_llm):
    from engine_service.model.paths import default_gguf_path

    gguf_llm = make_llm(default_gguf_path(), num_blocks=64)
    prompt = {"prompt_token_ids": smollm2_llm.get_tokenizer().encode("The capital of France is")}
    params = SamplingParams(temperature=0, max_tokens=12)
    from_gguf = gguf_llm.generate(prompt, params)[0].outputs[0]
    from_dir = smollm2_llm.generate(prompt, params)[0].outputs[0]
    assert from_gguf.token_ids == from_dir.token_ids and "Paris" in from_gguf.text


def test_cumulative_logprob_is_the_sum_of_the_sampled_tokens(make_llm, tiny_llama_dir):
    """As vLLM: a sampled completion carries it when logprobs are asked, each output the
    sum so far; without logprobs it is None."""
    llm = make_llm(tiny_llama_dir, num_blocks=64)
    params = SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=8, ignore_eos=True,
                            logprobs=1)
    [out] = llm.generate({"prompt_token_ids": [41, 42, 43]}, params)
    for completion in out.outputs:
        total = sum(entry.logprob for entry in completion.logprobs)
        assert completion.cumulative_logprob == pytest.approx(total, abs=1e-9)
        assert completion.cumulative_logprob < 0
    engine = llm.llm_engine
    engine.add_request("s", [31, 32, 33], params)
    streamed = 0.0
    while engine.has_unfinished_requests():
        for output in engine.step():
            first = output.outputs[0]
            streamed += sum(entry.logprob for entry in first.logprobs_delta)
            assert first.cumulative_logprob == pytest.approx(streamed, abs=1e-9)
    [plain] = llm.generate({"prompt_token_ids": [41, 42, 43]},
                           SamplingParams(temperature=0.8, seed=5, max_tokens=4))
    assert plain.outputs[0].cumulative_logprob is None
