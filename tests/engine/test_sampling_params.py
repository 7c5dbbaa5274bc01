"""SamplingParams: defaults, normalization, and a clear ValueError for every bad field."""

import math

import pytest

from engine_service.model.sampling_params import (
    MAX_LOGPROBS,
    MAX_N,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    SamplingParams,
)


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.seed) == (16, 0, None, None)
    assert p.stop == [] and p.stop_token_ids == []
    assert p.skip_special_tokens and not p.ignore_eos and not p.include_stop_str_in_output
    assert not p.is_greedy and not p.has_penalties


def test_stop_string_and_ids_are_normalized_to_lists() -> None:
    p = SamplingParams(stop="###", stop_token_ids=(7, 9))
    assert p.stop == ["###"]
    assert p.stop_token_ids == [7, 9]


def test_ints_are_accepted_for_floats_and_stored_as_float() -> None:
    p = SamplingParams(temperature=1, top_p=1, repetition_penalty=2)
    assert isinstance(p.temperature, float) and isinstance(p.repetition_penalty, float)


def test_greedy_is_temperature_zero() -> None:
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=0.0, top_k=5).is_greedy
    assert not SamplingParams(temperature=0.5).is_greedy
    # top_k == 1 still samples (it draws from the generator) though it picks the argmax.
    assert not SamplingParams(top_k=1).is_greedy


def test_valid_edges_are_accepted() -> None:
    SamplingParams(
        n=MAX_N,
        top_p=1.0,
        top_k=-1,
        min_p=1.0,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        max_tokens=None,
        min_tokens=5,
        logprobs=MAX_LOGPROBS,
        seed=2**64 - 1,
    )
    SamplingParams(seed=-(2**63), logprobs=0, max_tokens=3, min_tokens=3)


@pytest.mark.parametrize(
    ("kwargs", "field", "shown"),
    [
        ({"n": 0}, "n", "0"),
        ({"n": MAX_N + 1}, "n", str(MAX_N + 1)),
        ({"n": True}, "n", "True"),
        ({"n": 2.0}, "n", "2.0"),
        ({"temperature": -0.5}, "temperature", "-0.5"),
        ({"temperature": math.nan}, "temperature", "nan"),
        ({"temperature": math.inf}, "temperature", "inf"),
        ({"temperature": "0.7"}, "temperature", "'0.7'"),
        ({"top_p": 0.0}, "top_p", "0.0"),
        ({"top_p": 1.5}, "top_p", "1.5"),
        ({"top_k": -2}, "top_k", "-2"),
        ({"top_k": 3.0}, "top_k", "3.0"),
        ({"min_p": -0.1}, "min_p", "-0.1"),
        ({"min_p": 1.01}, "min_p", "1.01"),
        ({"presence_penalty": 2.5}, "presence_penalty", "2.5"),
        ({"frequency_penalty": -2.01}, "frequency_penalty", "-2.01"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "0.0"),
        ({"repetition_penalty": -1.0}, "repetition_penalty", "-1.0"),
        ({"max_tokens": 0}, "max_tokens", "0"),
        ({"max_tokens": -3}, "max_tokens", "-3"),
        ({"min_tokens": -1}, "min_tokens", "-1"),
        ({"min_tokens": 10, "max_tokens": 5}, "min_tokens", "10"),
        ({"stop": ""}, "stop", "''"),
        ({"stop": ["ok", 3]}, "stop", "3"),
        ({"stop": 42}, "stop", "42"),
        ({"stop": ["s"] * (MAX_STOP_STRINGS + 1)}, "stop", str(MAX_STOP_STRINGS + 1)),
        ({"stop": ["x" * (MAX_STOP_STRING_CHARS + 1)]}, "stop", str(MAX_STOP_STRING_CHARS + 1)),
        ({"stop_token_ids": [1, -4]}, "stop_token_ids", "-4"),
        ({"stop_token_ids": [True]}, "stop_token_ids", "True"),
        ({"stop_token_ids": 5}, "stop_token_ids", "5"),
        ({"logprobs": -1}, "logprobs", "-1"),
        ({"logprobs": MAX_LOGPROBS + 1}, "logprobs", str(MAX_LOGPROBS + 1)),
        ({"seed": 2**64}, "seed", str(2**64)),
        ({"seed": 1.5}, "seed", "1.5"),
        ({"ignore_eos": 1}, "ignore_eos", "1"),
        ({"skip_special_tokens": "yes"}, "skip_special_tokens", "'yes'"),
        ({"include_stop_str_in_output": None}, "include_stop_str_in_output", "None"),
        ({"allowed_token_ids": []}, "allowed_token_ids", "[]"),
        ({"allowed_token_ids": [3, -1]}, "allowed_token_ids", "-1"),
        ({"allowed_token_ids": [True]}, "allowed_token_ids", "True"),
        ({"allowed_token_ids": 7}, "allowed_token_ids", "7"),
        ({"allowed_token_ids": [3], "structured_outputs": {"regex": "a"}},
         "allowed_token_ids", "1 ids"),
        ({"allowed_token_ids": [3], "beam_width": 2, "temperature": 0}, "allowed_token_ids",
         "1 entries"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "0"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens", "-2"),
        ({"truncate_prompt_tokens": 2.0}, "truncate_prompt_tokens", "2.0"),
        ({"bad_words": "word"}, "bad_words", "'word'"),
        ({"bad_words": ["ok", " "]}, "bad_words", "' '"),
        ({"bad_words": ["w"] * 129}, "bad_words", "129"),
        ({"bad_words": ["x" * 257]}, "bad_words", "257"),
        ({"bad_words": ["w"], "allowed_token_ids": [3]}, "bad_words", "got 1 word"),
        ({"bad_words": ["w", "v"], "structured_outputs": {"regex": "a"}}, "bad_words",
         "got 2 words"),
        ({"bad_words": ["w"], "beam_width": 2, "temperature": 0}, "bad_words", "got 1 word"),
        ({"bad_words_token_ids": [[1] * 33]}, "bad_words_token_ids", "1 to 32 token ids"),
        ({"bad_words_token_ids": [[1], []]}, "bad_words_token_ids", "[[1], []]"),
    ],
)
def test_invalid_value_names_field_and_value(kwargs: dict, field: str, shown: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**kwargs)
    message = str(excinfo.value)
    assert message.startswith(field), message
    assert shown in message, message


def test_check_for_model_rejects_stop_token_outside_vocab() -> None:
    p = SamplingParams(stop_token_ids=[3, 100])
    p.check_for_model(vocab_size=101)
    with pytest.raises(ValueError, match=r"stop_token_ids .* vocab size 100, got 100"):
        p.check_for_model(vocab_size=100)


def test_allowed_token_ids_are_sorted_without_repeats_and_checked_against_the_vocab() -> None:
    p = SamplingParams(allowed_token_ids=[9, 3, 9, 5])
    assert p.allowed_token_ids == (3, 5, 9)
    p.check_for_model(vocab_size=10)
    with pytest.raises(ValueError, match=r"allowed_token_ids must be < the model's vocab size "
                                         r"9, got 9"):
        p.check_for_model(vocab_size=9)


def _limits(max_model_len: int, num_blocks: int):
    from engine_service.core.request_limits import RequestLimits

    return RequestLimits(vocab_size=100, max_model_len=max_model_len, num_blocks=num_blocks,
                         block_size=16, max_num_seqs=8, max_num_batched_tokens=512,
                         has_tokenizer=True)


@pytest.mark.parametrize(("keep", "num_prompt", "kept"), [
    (None, 50, 50), (5, 50, 5), (5, 3, 3), (-1, 50, 31), (-1, 10, 10)])
def test_truncate_prompt_tokens_keeps_the_last_tokens(keep, num_prompt, kept):
    from engine_service.core.request_limits import truncated_prompt

    params = SamplingParams(truncate_prompt_tokens=keep, max_tokens=1)
    prompt = list(range(100, 100 + num_prompt))
    assert truncated_prompt(prompt, params, _limits(32, 1000)) == prompt[num_prompt - kept:]


@pytest.mark.parametrize(("context", "blocks", "n", "max_tokens"), [
    (4096, 1000, 1, 1), (4096, 240, 1, 1), (4096, 240, 2, 1), (4096, 240, 4, 100),
    (4096, 1000, 1, 16), (4096, 240, 3, None), (64, 2, 2, 8)])
def test_minus_one_keeps_the_longest_prompt_the_request_runs(context, blocks, n, max_tokens):
    """-1's cut: the request (its n sequences and max_tokens) fits the context and the KV
    pool with it, and with one more prompt token it would not (n ran past the pool)."""
    limits = _limits(context, blocks)
    params = SamplingParams(n=n, max_tokens=max_tokens, truncate_prompt_tokens=-1)
    longest = limits.longest_prompt_for(params)
    new = max_tokens or 1

    def fits(num_prompt: int) -> bool:
        return (num_prompt + new <= context and limits.blocks_for_request(
            num_prompt, SamplingParams(n=n, max_tokens=new)) <= blocks)

    assert fits(longest) and not fits(longest + 1)


def test_the_longest_prompt_is_the_context_or_the_pool_less_one_token():
    assert _limits(4096, 1000).longest_prompt == 4095
    assert _limits(4096, 240).longest_prompt == 240 * 16 - 1


def test_bad_words_ids_are_remade_when_the_words_or_the_tokenizer_change(tiny_llama_dir):
    """An offline caller may reuse SamplingParams: its ids follow its words (they were kept
    from the first words given)."""
    from transformers import AutoTokenizer

    from engine_service.model.bad_words import bad_words_token_ids

    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    params = SamplingParams(bad_words=["hello"])
    params.tokenize_bad_words(tokenizer)
    assert params.bad_words_token_ids == bad_words_token_ids(tokenizer, ["hello"])
    params.bad_words = ("world",)
    params.tokenize_bad_words(tokenizer)
    assert params.bad_words_token_ids == bad_words_token_ids(tokenizer, ["world"])
    with pytest.raises(ValueError, match="bad_words must hold words of at most 32 tokens, got "
                                         "one of 64"):
        SamplingParams(bad_words=["\u00e9" * 64]).tokenize_bad_words(tokenizer)


def test_bad_words_made_elsewhere_are_refused_by_an_engine_without_a_tokenizer():
    """Params reused from an engine with a tokenizer carry its ids: an engine without one
    refuses the words still (it ran the other model's ids)."""
    from engine_service.core.errors import InvalidRequestError

    params = SamplingParams(bad_words=["hello"], bad_words_token_ids=[[5]])
    limits = _limits(64, 100)
    limits.validate([1, 2, 3], params)
    import dataclasses

    with pytest.raises(InvalidRequestError, match="bad_words must be empty when the engine "
                                                  "has no tokenizer"):
        dataclasses.replace(limits, has_tokenizer=False).validate([1, 2, 3], params)
