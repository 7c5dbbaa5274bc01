"""A reasoning model's thinking, split from its answer: `<think> ... </think>` in the text.

Two formats, by where the thinking starts (vLLM's parser names):
- `qwen3`: Qwen3's hybrid models write `<think>` themselves when they think; a reply that does
  not open with it is all answer (thinking turned off with chat_template_kwargs'
  `enable_thinking: false`, or a model that skipped it).
- `deepseek_r1`: DeepSeek-R1 and its distills, QwQ, Qwen3's Thinking-2507 models: the chat
  template opens the thinking in the prompt, so the reply is thinking from its first token
  until `</think>` (a `<think>` the model writes anyway is dropped); without `</think>` (cut
  short) it is all thinking.

The answer starts after `</think>` and the whitespace that follows it. ThinkReader reads a
stream in pieces, cut anywhere (inside a tag too), and gives the same split as reading the
whole text at once (`split`), which is the same reader fed once.
"""

from __future__ import annotations

from dataclasses import dataclass

PARSERS = ("qwen3", "deepseek_r1")
START, END = "<think>", "</think>"


@dataclass(slots=True)
class Split:
    reasoning: str = ""
    content: str = ""


class ThinkReader:
    """Feed a reply's text as it comes; each call gives what is known to be thinking or
    answer so far (text that may still be the start of a tag is held until it is not)."""

    def __init__(self, parser: str) -> None:
        if parser not in PARSERS:
            raise ValueError(f"reasoning parser must be one of {PARSERS}, got {parser!r}")
        self._opens_itself = parser == "qwen3"  # else the prompt opened the thinking
        self._state = "opening"  # -> "thinking" -> "after" -> "answer"
        self._held = ""
        self.thought = False  # the reply had a thinking part (even an empty one)

    def feed(self, text: str) -> Split:
        out = Split()
        self._held += text
        while self._held:
            before = (self._state, len(self._held))
            getattr(self, f"_{self._state}")(out)
            if (self._state, len(self._held)) == before:
                break  # waiting for more text
        return out

    def finish(self) -> Split:
        """The end of the reply: what was held is what it looked like."""
        out, held, self._held = Split(), self._held, ""
        if self._state == "thinking" or (self._state == "opening" and not self._opens_itself):
            out.reasoning = held
            self.thought = True
        elif self._state in ("opening", "answer"):
            out.content = held
        return out  # ("after": only the whitespace after </think>, dropped)

    def _opening(self, out: Split) -> None:
        """Before the first non-space characters are known to be `<think>` or not."""
        stripped = self._held.lstrip()
        if not stripped or (START.startswith(stripped) and stripped != START):
            return  # whitespace, or part of <think>: not known yet
        if stripped.startswith(START):
            self._held = stripped[len(START):]
            self._state, self.thought = "thinking", True
        elif self._opens_itself:
            self._state = "answer"
        else:
            self._state, self.thought = "thinking", True

    def _thinking(self, out: Split) -> None:
        end = self._held.find(END)
        if end >= 0:
            out.reasoning += self._held[:end]
            self._held = self._held[end + len(END):]
            self._state = "after"
            return
        keep = _partial_tag_length(self._held, END)
        out.reasoning += self._held[:len(self._held) - keep]
        self._held = self._held[len(self._held) - keep:]

    def _after(self, out: Split) -> None:
        stripped = self._held.lstrip()
        self._held = stripped
        if stripped:
            self._state = "answer"

    def _answer(self, out: Split) -> None:
        out.content += self._held
        self._held = ""


def _partial_tag_length(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (held: the tag may be cut)."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


def for_constrained_output(parser: str) -> str:
    """The parser for an output held to a schema or grammar from its first token: one that
    looks for <think> (JSON has none: all answer) rather than assume the prompt opened it."""
    return "qwen3"


def split(parser: str, text: str) -> tuple[str | None, str]:
    """A whole reply: (its thinking, None where it had none; its answer)."""
    reader = ThinkReader(parser)
    first, last = reader.feed(text), reader.finish()
    reasoning = first.reasoning + last.reasoning
    return (reasoning if reader.thought else None), first.content + last.content
