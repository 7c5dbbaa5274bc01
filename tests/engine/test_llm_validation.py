"""Bad input to the offline API: a clear ValueError naming the field, nothing left behind."""

import pytest

from engine_service import LLM, SamplingParams
from engine_service.core.engine import RequestTooLargeError


@pytest.fixture(scope="module")
def llm(tiny_llama_dir, live_llms):
    llm = LLM(model=str(tiny_llama_dir), block_size=16, num_blocks=64, max_model_len=512)
    live_llms.append(llm)
    yield llm
    live_llms.remove(llm)


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ({"prompt_token_ids": []}, SamplingParams(), "prompt"),
        ({"prompt_token_ids": [1, 2, 10**6]}, SamplingParams(), "prompt_token_ids"),
        ({"prompt_token_ids": [1, -3]}, SamplingParams(), "prompt_token_ids"),
        ({"prompt_token_ids": list(range(600))}, SamplingParams(), "context"),
        ({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=511), "max_tokens"),
        ({"prompt_token_ids": [1, 2]}, SamplingParams(stop_token_ids=[10**7]), "stop_token_ids"),
        ({"prompt_token_ids": [1, 2]}, SamplingParams(logit_bias={10**7: 1.0}),
         "logit_bias must map token ids < the model's vocab size"),
        (42, SamplingParams(), "prompt must be"),
    ],
)
def test_bad_prompt_raises_value_error(llm, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, params)


def test_request_larger_than_pool_is_refused(tiny_llama_dir, make_llm):
    small = make_llm(tiny_llama_dir, block_size=16, num_blocks=4)
    with pytest.raises(RequestTooLargeError, match="KV blocks"):
        small.generate({"prompt_token_ids": list(range(40))}, SamplingParams(max_tokens=64))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 1.5),
        ("n", 0),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("presence_penalty", 3.0),
        ("repetition_penalty", 0.0),
        ("logprobs", 100),
        ("stop", [""]),
        ("seed", "x"),
    ],
)
def test_bad_sampling_value_names_field_and_value(field, value):
    with pytest.raises(ValueError, match=field) as info:
        SamplingParams(**{field: value})
    shown = value[0] if isinstance(value, list) else value
    assert f"got {shown!r}" in str(info.value)


def test_mismatched_params_list(llm):
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams(), SamplingParams(), SamplingParams()])


def test_bad_engine_args_name_the_field(tiny_llama_dir):
    for args, field in [
        ({"block_size": 12}, "block_size"),
        ({"device": "tpu"}, "device"),
        ({"preemption_mode": "drop"}, "preemption_mode"),
        ({"num_blocks": 1}, "num_blocks"),
        ({"kernel_backend": "x"}, "kernel"),
    ]:
        with pytest.raises(ValueError, match=field):
            LLM(model=str(tiny_llama_dir), **args)
    with pytest.raises(ValueError, match="does not exist"):
        LLM(model="/nonexistent/model")


def test_prompt_that_alone_overflows_the_pool_names_the_prompt(tiny_llama_dir, make_llm):
    small = make_llm(tiny_llama_dir, block_size=8, num_blocks=4)
    with pytest.raises(RequestTooLargeError, match=r"^prompt must fit this engine's KV pool of 4 "
                                                   r"blocks .* got 40 tokens") as caught:
        small.generate({"prompt_token_ids": list(range(40))}, SamplingParams(max_tokens=1))
    assert caught.value.field == "prompt"


def test_bool_token_ids_are_refused(tiny_llama_dir, make_llm):
    llm = make_llm(tiny_llama_dir, num_blocks=16)
    with pytest.raises(ValueError, match="prompt_token_ids must be ints .* got True"):
        llm.generate({"prompt_token_ids": [True, 6, 7]}, SamplingParams(max_tokens=1))
