"""A reasoning model's thinking, split from its answer: `<think> ... </think>` in the text.

Two formats, by where the thinking starts (vLLM's parser names):
- `qwen3`: Qwen3's hybrid models write `<think>` themselves when they think; a reply that does
  not open with it is all answer (thinking turned off with chat_template_kwargs'
  `enable_thinking: false`, or a model that skipped it).
- `deepseek_r1`: DeepSeek-R1 and its distills, QwQ, Qwen3's Thinking-2507 models: the chat
  template opens the thinking in the prompt, so the reply is thinking from its first token
  until `</think>` (a `<think>` the model writes anyway is dropped); without `</think>` (cut
  short) it is all thinking.

Where the rendered prompt already opened or closed the thinking (a template that writes
`<think>` for the model, or `<think></think>` with thinking turned off), the reply starts
there, whichever the parser (prompt_state). The answer starts after `</think>` and the line
breaks that follow it. ThinkReader reads a
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

    def __init__(self, parser: str, prompt_end: str | None = None) -> None:
        """`prompt_end`: where the rendered prompt left the thinking (prompt_state): "open"
        (it ends with <think>: the reply starts inside it), "closed" (it ends with
        </think>, thinking turned off: the reply is all answer), None: the parser's rule."""
        if parser not in PARSERS:
            raise ValueError(f"reasoning parser must be one of {PARSERS}, got {parser!r}")
        self._opens_itself = parser == "qwen3"  # else the prompt opened the thinking
        self._state = "opening"  # -> "thinking" -> "after" -> "answer"
        self._held = ""
        # "opening": the reply's leading whitespace, apart (a reply of blank tokens held in
        # one growing string was quadratic)
        self._blanks: list[str] = []
        self.thought = False  # the reply had a thinking part (even an empty one)
        if prompt_end == "open":
            self._state, self.thought = "thinking", True
        elif prompt_end == "closed":
            self._state = "answer"

    def feed(self, text: str) -> Split:
        out = Split()
        if self._state == "opening" and not self._held:
            stripped = text.lstrip()
            self._blanks.append(text[:len(text) - len(stripped)])
            text = stripped
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
        if self._state == "opening":
            held = "".join(self._blanks) + held
        if self._state == "thinking" or (self._state == "opening" and not self._opens_itself):
            out.reasoning = held
            self.thought = True
        elif self._state in ("opening", "answer"):
            out.content = held
        return out  # ("after": only the whitespace after </think>, dropped)

    def _opening(self, out: Split) -> None:
        """Before the first non-space characters are known to be `<think>` or not."""
        held = self._held  # (feed keeps the leading whitespace in _blanks)
        if START.startswith(held) and held != START:
            return  # part of <think>: not known yet
        if held.startswith(START):
            self._held = held[len(START):]
            self._state, self.thought = "thinking", True
            return
        self._held = "".join(self._blanks) + held
        if self._opens_itself:
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
        """The line breaks after </think> are dropped (an answer's first-line indentation
        stays: code)."""
        stripped = self._held.lstrip("\r\n")
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


def prompt_state(prompt: str) -> str | None:
    """Where a rendered chat prompt leaves the thinking: "open" when it ends with <think>,
    "closed" when it ends with </think> (trailing whitespace aside), else None."""
    end = prompt.rstrip()
    if end.endswith(END):
        return "closed"
    if end.endswith(START):
        return "open"
    return None


def continued_state(content: str) -> str | None:
    """Where a message the model continues (continue_final_message) leaves the thinking:
    "open" when its last <think> is not closed after it ("<think>Let me"), "closed" when a
    </think> is its last tag, else None (the rendered prompt says)."""
    start, end = content.rfind(START), content.rfind(END)
    if start > end:
        return "open"
    if end >= 0:
        return "closed"
    return None


# The parser for an output held to a schema or grammar from its first token, whichever the
# server's: one that looks for <think> (JSON has none: all answer) rather than assume the
# prompt opened it.
CONSTRAINED_OUTPUT_PARSER = "qwen3"


def split(parser: str, text: str, prompt_end: str | None = None) -> tuple[str | None, str]:
    """A whole reply: (its thinking, None where it had none; its answer)."""
    reader = ThinkReader(parser, prompt_end)
    first, last = reader.feed(text), reader.finish()
    reasoning = first.reasoning + last.reasoning
    return (reasoning if reader.thought else None), first.content + last.content
