"""IncrementalDetokenizer: streamed deltas add up to decode(), and stop strings never leak."""

import random

import pytest
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from engine_service.model.detokenizer import (
    PROMPT_CONTEXT_TOKENS,
    IncrementalDetokenizer,
    TokenDecoder,
)
from tests.engine.sampling_fixtures import (
    build_sentencepiece_style_tokenizer,
    load_smollm2_tokenizer,
    random_text,
)

REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def smollm2_tokenizer() -> PreTrainedTokenizerBase:
    return load_smollm2_tokenizer()


@pytest.fixture(scope="module")
def sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    return build_sentencepiece_style_tokenizer()


def stream(detok: IncrementalDetokenizer, token_ids: list[int]) -> list[str]:
    """Every delta, the final flush included, stopping where the caller would (at a stop)."""
    deltas = []
    for token_id in token_ids:
        deltas.append(detok.add_token(token_id))
        if detok.matched_stop is not None:
            break
    deltas.append(detok.finish())
    return deltas


def test_deltas_of_random_text_add_up_without_replacement_chars(
    smollm2_tokenizer: PreTrainedTokenizerBase,
) -> None:
    rng = random.Random(0)
    for _ in range(150):
        prompt = smollm2_tokenizer.encode(random_text(rng, 8))
        output = smollm2_tokenizer.encode(random_text(rng))
        detok = IncrementalDetokenizer(smollm2_tokenizer, prompt, stop=[])
        deltas = stream(detok, output)
        # Valid text split mid-character must be held back, never shown as U+FFFD.
        assert not any(REPLACEMENT in d for d in deltas), deltas
        assert "".join(deltas) == smollm2_tokenizer.decode(output, skip_special_tokens=True)
        assert detok.text == "".join(deltas)
        assert detok.matched_stop is None


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_deltas_of_random_token_ids_add_up_to_decode(
    smollm2_tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool
) -> None:
    # Arbitrary ids: invalid UTF-8, stray continuation bytes, special tokens anywhere.
    rng = random.Random(1)
    vocab = len(smollm2_tokenizer)
    for _ in range(150):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
        prompt = smollm2_tokenizer.encode(random_text(rng, 4)) if rng.random() < 0.5 else prompt
        output = [rng.randrange(vocab) for _ in range(rng.randint(1, 25))]
        output += [rng.randrange(12) for _ in range(rng.randint(0, 2))]  # special tokens
        rng.shuffle(output)
        detok = IncrementalDetokenizer(
            smollm2_tokenizer, prompt, stop=[], skip_special_tokens=skip_special_tokens
        )
        expected = smollm2_tokenizer.decode(output, skip_special_tokens=skip_special_tokens)
        assert "".join(stream(detok, output)) == expected, output


@pytest.mark.parametrize("include_stop", [False, True])
def test_stop_string_truncates_and_never_leaks(
    smollm2_tokenizer: PreTrainedTokenizerBase, include_stop: bool
) -> None:
    rng = random.Random(2 + include_stop)
    num_matched = 0
    for _ in range(200):
        output = smollm2_tokenizer.encode(random_text(rng))
        text = smollm2_tokenizer.decode(output)
        # A substring of the text (so it usually straddles token boundaries), or a miss.
        start = rng.randrange(len(text))
        stop = text[start : start + rng.randint(1, 8)] if rng.random() < 0.8 else "@@@"
        index = text.find(stop)
        expected = text if index < 0 else text[: index + (len(stop) if include_stop else 0)]

        detok = IncrementalDetokenizer(smollm2_tokenizer, [], [stop], include_stop)
        released = ""
        for token_id in output:
            released += detok.add_token(token_id)
            # At every step: only text that will be in the final output has been released.
            assert expected.startswith(released), (released, expected, stop)
            if detok.matched_stop is not None:
                break
        if detok.matched_stop is not None:
            # After a stop the caller ends the sequence; nothing more ever comes out.
            assert detok.add_token(output[-1]) == ""
        released += detok.finish()
        assert released == expected
        assert detok.matched_stop == (stop if index >= 0 else None)
        num_matched += index >= 0
    assert num_matched > 100  # the property was exercised on real matches


def test_partial_stop_string_is_held_then_released_at_finish(
    smollm2_tokenizer: PreTrainedTokenizerBase,
) -> None:
    detok = IncrementalDetokenizer(smollm2_tokenizer, [], ["\nUser:"])
    released = "".join(detok.add_token(t) for t in smollm2_tokenizer.encode("Sure.\nUs"))
    # "\nUs" could still become "\nUser:", so it must not be out yet.
    assert released == "Sure."
    # The sequence ended (say, max_tokens) without a stop: the tail is ordinary output.
    assert detok.finish() == "\nUs"
    assert detok.matched_stop is None and detok.text == "Sure.\nUs"


def test_earliest_stop_wins_when_several_match(smollm2_tokenizer: PreTrainedTokenizerBase) -> None:
    # Both stops arrive in the same token; list order must not matter, position does.
    detok = IncrementalDetokenizer(smollm2_tokenizer, [], ["lazy", "the"])
    text = "".join(stream(detok, smollm2_tokenizer.encode("over the lazy dog")))
    assert text == "over " and detok.matched_stop == "the"


def test_stop_strings_are_ignored_until_min_tokens(
    smollm2_tokenizer: PreTrainedTokenizerBase,
) -> None:
    ids = smollm2_tokenizer.encode("A B A B A")
    assert len(ids) == 5
    detok = IncrementalDetokenizer(smollm2_tokenizer, [], ["B"], min_tokens=3)
    text = "".join(stream(detok, ids))
    # The first "B" is token 2 (<= min_tokens): output continues to the "B" of token 4.
    assert text == "A B A " and detok.matched_stop == "B"


def test_special_tokens_follow_skip_special_tokens(
    smollm2_tokenizer: PreTrainedTokenizerBase,
) -> None:
    ids = smollm2_tokenizer.encode("Hi<|im_end|>")
    kept = IncrementalDetokenizer(smollm2_tokenizer, [], [], skip_special_tokens=False)
    skipped = IncrementalDetokenizer(smollm2_tokenizer, [], [], skip_special_tokens=True)
    assert "".join(stream(kept, ids)) == "Hi<|im_end|>"
    assert "".join(stream(skipped, ids)) == "Hi"


class WindowRecorder:
    """Wraps a tokenizer and records how many ids each decode() call was given."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.window_sizes: list[int] = []

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        self.window_sizes.append(len(token_ids))
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)


def test_each_step_decodes_a_short_window_not_the_whole_output(
    smollm2_tokenizer: PreTrainedTokenizerBase,
) -> None:
    rng = random.Random(4)
    output = smollm2_tokenizer.encode(" ".join(random_text(rng) for _ in range(30)))
    assert len(output) > 1000
    recorder = WindowRecorder(smollm2_tokenizer)
    detok = IncrementalDetokenizer(recorder, [1, 2, 3, 4, 5, 6, 7], ["never-there"])
    assert "".join(stream(detok, output)) == smollm2_tokenizer.decode(output)
    # Two decodes per step at most, each of a few tokens (more only while a character is
    # split over several tokens, e.g. a 4-byte emoji with a skin tone modifier).
    assert len(recorder.window_sizes) <= 2 * len(output) + 2
    assert max(recorder.window_sizes) <= PROMPT_CONTEXT_TOKENS + 8


def test_sentencepiece_leading_space_is_kept(
    sentencepiece_tokenizer: PreTrainedTokenizerFast,
) -> None:
    tok = sentencepiece_tokenizer
    prompt = tok.encode("the quick")
    output = tok.encode("brown fox 世界")  # "▁brown": a word-start marker, like Llama
    detok = IncrementalDetokenizer(tok, prompt, [])
    # decode(output) alone would strip the leading space; continuing the prompt must not.
    assert "".join(stream(detok, output)) == " brown fox 世界"


def test_sentencepiece_byte_fallback_deltas_add_up(
    sentencepiece_tokenizer: PreTrainedTokenizerFast,
) -> None:
    tok = sentencepiece_tokenizer
    rng = random.Random(5)
    for _ in range(100):
        prompt = tok.encode(random_text(rng, 4))
        output = tok.encode(random_text(rng))
        detok = IncrementalDetokenizer(tok, prompt, [])
        deltas = stream(detok, output)
        assert not any(REPLACEMENT in d for d in deltas)
        # The text the output adds to the prompt (vLLM's meaning of a completion's text).
        prompt_text = tok.decode(prompt)
        assert "".join(deltas) == tok.decode(prompt + output)[len(prompt_text) :]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_add_tokens_at_once_gives_the_streamed_text(
    smollm2_tokenizer: PreTrainedTokenizerBase, sentencepiece_tokenizer: PreTrainedTokenizerFast,
    skip_special_tokens: bool,
) -> None:
    """A deferred output (add_tokens at its end, through a decoder shared with other
    detokenizers and its single-token texts kept) has exactly the text of the same tokens
    streamed one by one through a detokenizer of its own: whole, and when it stops without
    finish (an abort, which releases nothing held back)."""
    rng = random.Random(6)
    for tok in (smollm2_tokenizer, sentencepiece_tokenizer):
        shared = TokenDecoder(tok)
        vocab = len(tok)
        for _ in range(100):
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(0, 8))]
            output = [rng.randrange(vocab) for _ in range(rng.randint(1, 25))]
            if rng.random() < 0.5:  # valid text, characters split over tokens
                output = tok.encode(random_text(rng))
            output += [rng.randrange(12) for _ in range(rng.randint(0, 2))]  # special tokens
            rng.shuffle(output)
            cut = rng.randint(0, len(output))
            for finish in (True, False):
                streamed = IncrementalDetokenizer(tok, prompt, [],
                                                  skip_special_tokens=skip_special_tokens)
                deferred = IncrementalDetokenizer(tok, prompt, [], decoder=shared,
                                                  skip_special_tokens=skip_special_tokens)
                tokens = output if finish else output[:cut]
                expected = "".join(streamed.add_token(t) for t in tokens)
                delta = deferred.add_tokens(tokens)
                if finish:
                    expected += streamed.finish()
                    delta += deferred.finish()
                assert delta == expected == deferred.text == streamed.text, (prompt, tokens)


def test_add_tokens_with_stop_strings_stops_as_add_token(
    smollm2_tokenizer: PreTrainedTokenizerBase,
) -> None:
    tok = smollm2_tokenizer
    output = tok.encode(" one two three four")
    streamed = IncrementalDetokenizer(tok, [], ["three"])
    deferred = IncrementalDetokenizer(tok, [], ["three"])
    assert deferred.add_tokens(output) == "".join(stream(streamed, output)) == " one two "
    assert deferred.matched_stop == streamed.matched_stop == "three"
