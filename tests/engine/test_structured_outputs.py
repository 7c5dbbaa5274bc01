"""Structured outputs through the engine (the offline API on the tiny random Llama, whose
unconstrained text is gibberish): every output matches its JSON Schema, regex, choice or
grammar; constrained rows leave the other rows of a batch alone; min_tokens yields where the
grammar must end; preemption keeps each sequence's grammar state; bad constraints are refused
naming the field."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch

from engine_service import LLM, SamplingParams
from engine_service.core.errors import InvalidRequestError
from engine_service.model.sampler import Sampler
from engine_service.model.structured_outputs import MAX_SPEC_CHARS

PROMPTS = ["Give me a record:", "Once upon a time", "def fib(n):", "Hello"]
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "colour": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["ok", "colour", "count", "tags"],
    "additionalProperties": False,
}
WORDS = r"[a-z ]{20,400}"  # long outputs: the tiny model rarely ends them (length)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir, live_llms):
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", block_size=16, num_blocks=256,
              max_model_len=512)
    live_llms.append(llm)
    yield llm
    live_llms.remove(llm)


def _texts(llm: LLM, params: SamplingParams, prompts=PROMPTS) -> list[list[str]]:
    outputs = llm.generate(prompts, params)
    return [[c.text for c in o.outputs] for o in outputs]


@pytest.mark.parametrize("sampling", [dict(temperature=0), dict(temperature=1.0, seed=7, n=3)])
def test_json_schema_outputs_are_valid_compact_json(llm, sampling):
    params = SamplingParams(max_tokens=80, structured_outputs={"json": SCHEMA}, **sampling)
    outputs = llm.generate(PROMPTS, params)
    for output in outputs:
        for completion in output.outputs:
            assert completion.finish_reason == "stop", completion.text
            value = json.loads(completion.text)
            jsonschema.validate(value, SCHEMA)
            # Compact: exactly json.dumps' separators, no other whitespace.
            assert completion.text == json.dumps(value)


def test_a_schema_as_text_equals_the_same_schema_as_a_dict(llm):
    as_dict = _texts(llm, SamplingParams(temperature=0, max_tokens=80,
                                         structured_outputs={"json": SCHEMA}))
    as_text = _texts(llm, SamplingParams(temperature=0, max_tokens=80,
                                         structured_outputs={"json": json.dumps(SCHEMA)}))
    assert as_dict == as_text


def test_regex_choice_and_grammar(llm):
    regex = r"[0-9]{3}-[a-z]{2,4}"
    for texts in _texts(llm, SamplingParams(temperature=0.9, seed=1, n=2, max_tokens=20,
                                            structured_outputs={"regex": regex})):
        assert all(re.fullmatch(regex, t) for t in texts), texts
    choices = ["yes", "no", "maybe so", 'a "quoted" \\ choice']
    seen = set()
    for texts in _texts(llm, SamplingParams(temperature=1.0, seed=2, n=8, max_tokens=20,
                                            structured_outputs={"choice": choices})):
        assert set(texts) <= set(choices), texts
        seen.update(texts)
    assert len(seen) > 1  # sampled among the choices, not one forced answer
    grammar = 'root ::= ("ab" | "cd") [0-9] ("!" | "?")'
    for texts in _texts(llm, SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=20,
                                            structured_outputs={"grammar": grammar})):
        assert all(re.fullmatch(r"(ab|cd)[0-9][!?]", t) for t in texts), texts


def test_json_object_is_a_prefix_of_an_object_or_a_whole_one(llm):
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs={"json_object": True})
    for output in llm.generate(PROMPTS, params):
        [completion] = output.outputs
        assert completion.text.startswith("{")
        if completion.finish_reason == "stop":
            assert isinstance(json.loads(completion.text), dict)


def test_constrained_rows_leave_the_other_rows_of_a_batch_alone(llm):
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = llm.generate(PROMPTS, plain)
    constrained = SamplingParams(temperature=0, max_tokens=12,
                                 structured_outputs={"regex": r"[0-9]+"})
    mixed = llm.generate(PROMPTS, [constrained, plain, constrained, plain])
    for i in (1, 3):
        assert mixed[i].outputs[0].token_ids == alone[i].outputs[0].token_ids
    for i in (0, 2):
        assert re.fullmatch(r"[0-9]+", mixed[i].outputs[0].text)


def test_min_tokens_holds_off_the_end_only_while_the_grammar_allows_more(llm):
    # A word of 20 or more letters: EOS is masked for 30 tokens, then allowed.
    [long] = llm.generate(PROMPTS[:1], SamplingParams(
        temperature=0, max_tokens=60, min_tokens=30, structured_outputs={"regex": WORDS}))
    assert len(long.outputs[0].token_ids) >= 30
    assert re.fullmatch(WORDS, long.outputs[0].text)
    # "yes" or "no" leaves nothing but EOS after a few tokens: the grammar wins.
    [short] = llm.generate(PROMPTS[:1], SamplingParams(
        temperature=0, max_tokens=60, min_tokens=30,
        structured_outputs={"choice": ["yes", "no"]}))
    assert short.outputs[0].finish_reason == "stop"
    assert short.outputs[0].text in ("yes", "no")
    assert len(short.outputs[0].token_ids) < 30


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_constrained_groups_match_a_roomy_pool(make_llm, tiny_llama_dir, mode):
    """Four n=4 constrained groups in 28 blocks of 8 preempt each other; each sequence's
    matcher stays with it, so the outputs are those of a pool where nothing is preempted."""
    params = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=40,
                            structured_outputs={"regex": WORDS})
    roomy = make_llm(tiny_llama_dir, block_size=8, num_blocks=1024)
    expected = [[c.token_ids for c in o.outputs] for o in roomy.generate(PROMPTS, params)]
    block_bytes = roomy.llm_engine.kv_bytes_per_block
    small = make_llm(tiny_llama_dir, block_size=8, num_blocks=28, preemption_mode=mode,
                     swap_space=16 * block_bytes)
    outputs = small.generate(PROMPTS, params)
    assert [[c.token_ids for c in o.outputs] for o in outputs] == expected
    assert small.llm_engine.scheduler.counters.num_preemptions >= 2
    for output in outputs:
        for completion in output.outputs:
            assert re.fullmatch(r"[a-z ]*", completion.text)


def _nested_items(levels: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize(("constraint", "reason"), [
    ({"json": {"type": "objekt"}}, 'Unsupported type "objekt"'),
    ({"json": "{not json"}, "not JSON"),
    ({"json": [1, 2]}, "got [1, 2]"),
    ({"regex": "(abc"}, "parenthesis is not closed"),
    ({"grammar": 'root ::= "a" | missing'}, 'Rule "missing" is not defined'),
    ({"regex": "a", "choice": ["a"]}, "exactly one of"),
    ({}, "none of them"),
    ({"choice": []}, "1 to 1024 strings"),
    ({"choice": ["a", ""]}, "choice[1] must be a non-empty string"),
    ({"regex": "a" * (MAX_SPEC_CHARS + 1)}, f"at most {MAX_SPEC_CHARS} characters"),
    ({"json": {"type": "string", "pattern": "a" * MAX_SPEC_CHARS}},
     f"at most {MAX_SPEC_CHARS} characters"),
    ({"jsonn": {}}, "only the fields"),
    # Deep nesting: Python's JSON decoder raised RecursionError (a 500 over HTTP); 990 levels
    # of `items` took xgrammar 76 s to compile.
    ({"json": '{"anyOf":[' * 2000 + '{"type":"integer"}' + "]}" * 2000}, "at most 64 levels"),
    ({"json": _nested_items(65)}, "at most 64 levels"),
    ({"json": True}, "must be a JSON Schema (an object), got True"),
    ({"choice": ["ok", "\ud800"]}, "choice[1] must be valid Unicode text"),
    ({"regex": "a\udfff"}, "regex must be valid Unicode text"),
])
def test_bad_constraints_are_refused_naming_the_field(llm, constraint, reason):
    with pytest.raises(ValueError, match="structured_outputs") as caught:
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, structured_outputs=constraint))
    assert reason in str(caught.value)
    if isinstance(caught.value, InvalidRequestError):  # the engine's compile refusals
        assert caught.value.field == "structured_outputs"
        assert "/project/cpp" not in str(caught.value)  # xgrammar's source location dropped
    # The engine took nothing in: the next request runs as usual.
    [ok] = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=3,
                                                   structured_outputs={"regex": "[a-c]+"}))
    assert re.fullmatch("[a-c]+", ok.outputs[0].text)


@pytest.mark.parametrize(("extra", "field"), [
    (dict(beam_width=2, temperature=0), "structured_outputs must be left unset with beam"),
    (dict(ignore_eos=True), "ignore_eos must be False with structured_outputs"),
])
def test_structured_outputs_refused_with_beam_search_and_ignore_eos(extra, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(max_tokens=4, structured_outputs={"regex": "a+"}, **extra)


def test_an_engine_without_a_tokenizer_refuses_constraints(make_llm, tiny_llama_dir):
    llm = make_llm(tiny_llama_dir, skip_tokenizer_init=True, num_blocks=64, block_size=16)
    with pytest.raises(InvalidRequestError, match="no tokenizer") as caught:
        llm.generate([{"prompt_token_ids": [1, 2, 3]}],
                     SamplingParams(max_tokens=4, structured_outputs={"regex": "a+"}))
    assert caught.value.field == "structured_outputs"


def test_a_resumed_request_goes_on_where_the_first_left_off(llm):
    """The router resumes a stream elsewhere as prompt + output so far, with resumed_tokens
    saying how much of it is output: the grammar starts after it, and the rest equals what
    the uninterrupted request generated."""
    schema = {"json": SCHEMA}
    [whole] = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}],
                           SamplingParams(temperature=0, max_tokens=80, structured_outputs=schema))
    tokens = list(whole.outputs[0].token_ids)
    for cut in (1, 7):
        [rest] = llm.generate(
            [{"prompt_token_ids": [5, 6, 7, 8] + tokens[:cut]}],
            SamplingParams(temperature=0, max_tokens=80,
                           structured_outputs={**schema, "resumed_tokens": cut}))
        assert tokens[:cut] + list(rest.outputs[0].token_ids) == tokens
    with pytest.raises(InvalidRequestError, match="resumed_tokens must count output"):
        llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(
            max_tokens=4, structured_outputs={**schema, "resumed_tokens": 2}))
    with pytest.raises(InvalidRequestError, match="must be less than the prompt's 4 tokens"):
        llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(
            max_tokens=4, structured_outputs={**schema, "resumed_tokens": 4}))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_forbidding_stops_clears_exactly_their_bits(seed):
    """The min_tokens stops leave a grammar's bitmask (bits 31 of a word included, the int32
    sign), each other bit as it was; a row that allows nothing else is kept whole."""
    vocab = 1000
    rng = random.Random(seed)
    sampler = Sampler(vocab, {2, 31})
    stops = sorted(rng.sample(range(vocab), 200) + [63, vocab + 5])  # one past the vocabulary
    params = SamplingParams(min_tokens=4, stop_token_ids=stops)
    words = -(-vocab // 32)
    row = torch.tensor([rng.getrandbits(32) - (1 << 31) for _ in range(words)],
                       dtype=torch.int32)
    expected = row.clone()
    for token in {2, 31, *stops}:
        if token < vocab:
            expected[token // 32] &= ~(1 << (token % 32)) if token % 32 != 31 else 0x7FFFFFFF
    sampler._forbid_stops(row, params)
    assert torch.equal(row, expected)
    only_stops = torch.zeros(words, dtype=torch.int32)
    only_stops[0] = 1 << 2
    only_stops[1] = -(1 << 31)  # token 63
    kept = only_stops.clone()
    sampler._forbid_stops(only_stops, params)
    assert torch.equal(only_stops, kept)
