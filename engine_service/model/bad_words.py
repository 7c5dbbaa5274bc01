"""vLLM's bad_words: strings the output must not contain as tokens, each banned in the
tokenizations a model would write it with (alone, and after a space).

A word of one token is never sampled; a word of several is cut at its last token: that token
is masked in a step whose output so far ends with the word's other tokens. Only the output is
read (vLLM's semantics): a word begun in the prompt is not caught. The words are tokenized
where the tokenizer is (the serving front, the offline API); the engine core gets the ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 256
# Tokens of one word: each step compares a word's lead with the output's end, on the host, in
# the step every request shares (a word of 255 repeated tokens cost 13 ms a row a step).
MAX_BAD_WORD_TOKENS = 32


def bad_words_token_ids(tokenizer, words: Sequence[str]) -> tuple[tuple[int, ...], ...]:
    """Each word's token ids as the model would write it: on its own (leading whitespace cut)
    and after a space (a word inside a sentence: " redu" may be one token where "redu" is
    two; vLLM keeps the spaced form only where its length is the plain one's); none of the
    special tokens a tokenizer adds on its own (a word that is a special token's text, such
    as "<|im_end|>", is that token: banned, the output cannot end with it); no repeats.
    ValueError for a word of more than MAX_BAD_WORD_TOKENS tokens."""
    out: dict[tuple[int, ...], None] = {}
    for word in words:
        word = word.lstrip()
        plain = tuple(tokenizer.encode(word, add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word, add_special_tokens=False))
        longest = max(len(plain), len(spaced))
        if longest > MAX_BAD_WORD_TOKENS:
            raise ValueError(f"bad_words must hold words of at most {MAX_BAD_WORD_TOKENS} "
                             f"tokens, got one of {longest} ({word[:40]!r})")
        # (A tokenizer that adds the space itself gives the same spaced form, or one led by
        # a lone space token: banned after that token only, which costs nothing.)
        for ids in (plain, spaced):
            if ids:
                out[ids] = None
    return tuple(out)


@dataclass(frozen=True, slots=True)
class WordIndex:
    """A request's bad words as a step reads them: one-token words (always banned), and the
    longer ones by their next-to-last token, so a step compares only the words whose lead
    can end where the output does."""

    always: tuple[int, ...]
    by_last_lead_token: dict[int, tuple[tuple[int, ...], ...]]


def word_index(words: Sequence[tuple[int, ...]]) -> WordIndex:
    always, by_token = [], {}
    for word in words:
        if len(word) == 1:
            always.append(word[0])
        else:
            by_token.setdefault(word[-2], []).append(word)
    return WordIndex(tuple(always), {t: tuple(w) for t, w in by_token.items()})


def banned_next(index: WordIndex, output: Sequence[int]) -> list[int]:
    """The tokens that would complete a bad word after `output` (read from its end, in place:
    the engine's output views copy on slicing)."""
    banned = list(index.always)
    num_output = len(output)
    if not num_output:
        return banned
    for word in index.by_last_lead_token.get(output[num_output - 1], ()):
        lead = len(word) - 1
        if lead > num_output:
            continue
        start = num_output - lead
        if all(output[start + j] == word[j] for j in range(lead - 1)):
            banned.append(word[-1])
    return banned
