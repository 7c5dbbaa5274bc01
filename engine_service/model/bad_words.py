"""vLLM's bad_words: strings the output must not contain as tokens, each banned in the
tokenizations a model would write it with (alone, and after a space).

A word of one token is never sampled; a word of several is cut at its last token: that token
is masked in a step whose output so far ends with the word's other tokens. Only the output is
read (vLLM's semantics): a word begun in the prompt is not caught. The words are tokenized
where the tokenizer is (the serving front, the offline API); the engine core gets the ids.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 256


def bad_words_token_ids(tokenizer, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """Each word's token ids as the model would write it: on its own (leading whitespace cut)
    and after a space (a word inside a sentence: " redu" may be one token where "redu" is
    two; vLLM keeps the spaced form only where its length is the plain one's); no special
    tokens, no repeats."""
    out: dict[tuple[int, ...], None] = {}
    for word in words:
        word = word.lstrip()
        plain = tuple(tokenizer.encode(word, add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word, add_special_tokens=False))
        # (A tokenizer that adds the space itself gives the same spaced form, or one led by
        # a lone space token: banned after that token only, which costs nothing.)
        for ids in (plain, spaced):
            if ids:
                out[ids] = None
    return tuple(out)


def banned_next(words: Sequence[tuple[int, ...]], output: Sequence[int]) -> list[int]:
    """The tokens that would complete a bad word after `output` (read from its end, in place:
    the engine's output views copy on slicing)."""
    banned = []
    num_output = len(output)
    for word in words:
        lead = len(word) - 1
        if lead > num_output:
            continue
        start = num_output - lead
        if all(output[start + j] == word[j] for j in range(lead)):
            banned.append(word[-1])
    return banned
