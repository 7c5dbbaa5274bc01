"""Tool calls read out of a model's free text, for tool_choice "auto" (--tool-call-parser): each
model family writes its calls its own way. A parser reads a completion as it streams (text
goes out as content as soon as it cannot be the start of a call; a call goes out whole once
its text closes), and a whole reply is the same reading of the whole text, so the two agree.

- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number (Qwen2.5,
  Qwen3, Hermes 2/3 and models trained on their format);
- llama3_json: a reply that is `{"name": ..., "parameters": {...}}` (several joined by `;`),
  Llama 3.1/3.2's JSON tool calling;
- mistral: `[TOOL_CALLS]` and the calls (mistral_tool_parser.py);
- pythonic: a reply that is `[name(key=value, ...), ...]`, Llama 3.2's and Llama 4's
  (pythonic_tool_parser.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from openai_api.tool_calls import call_json, raw_members

PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")
# Parsers whose tags some tokenizers make special tokens: their text must keep special tokens.
TAGS_MAY_BE_SPECIAL = frozenset({"hermes", "mistral"})


@dataclass(slots=True)
class Parsed:
    """What a piece of a completion says: text for the client, and calls (OpenAI's form)."""

    content: str = ""
    calls: list[dict] = field(default_factory=list)


class HermesReader:
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._pending = ""  # text not yet given out: a possible START, or a call's body
        self._in_call = False
        self._searched = 0  # of a call's body, the characters known to hold no END
        self._called = False  # a call was given out
        # Whitespace at the end of the content so far, held: before a call (or at the end of
        # a reply with calls) it is not content; before more text it is. (Held in a stream and
        # a whole reply alike: they read the same, however the text is cut.)
        self._blank: list[str] = []

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        self._pending += text
        while True:
            if self._in_call:
                # (from where the last search stopped: a long call read token by token is
                # searched once, not once per token)
                end = self._pending.find(self.END, self._searched)
                if end < 0:
                    self._searched = max(0, len(self._pending) - len(self.END) + 1)
                    return out
                body, self._pending = self._pending[:end], self._pending[end + len(self.END):]
                self._in_call, self._searched = False, 0
                self._give_call(out, body, closed=True)
                continue
            start = self._pending.find(self.START)
            if start >= 0:
                self._give_content(out, self._pending[:start])
                self._pending = self._pending[start + len(self.START):]
                self._in_call = True
                continue
            # Held back: an end that could still become START.
            keep = longest_prefix_suffix(self._pending, self.START)
            self._give_content(out, self._pending[:len(self._pending) - keep])
            self._pending = self._pending[len(self._pending) - keep:]
            return out

    def finish(self) -> Parsed:
        out = Parsed()
        if self._in_call:  # a last call the model did not close (EOS, max_tokens)
            body = self._pending
            cut = longest_prefix_suffix(body, self.END)  # (cut inside its END)
            self._give_call(out, body[:len(body) - cut], closed=False, text=body)
        else:
            self._give_content(out, self._pending)
        if not self._called:
            out.content += "".join(self._blank)
        self._pending, self._in_call, self._searched, self._blank = "", False, 0, []
        return out

    def _give_call(self, out: Parsed, body: str, closed: bool, text: str | None = None
                   ) -> None:
        """`text`: the call's text as written, when it is not `body` (an END cut short)."""
        call = named_call(body, "arguments")
        if call is None:  # not a call after all: the text as the model wrote it
            self._give_content(out, self.START + (body if text is None else text)
                               + (self.END if closed else ""))
            return
        out.calls.append(call)
        self._called, self._blank = True, []

    def _give_content(self, out: Parsed, text: str) -> None:
        give_content(out, self._blank, text)


def give_content(out: Parsed, blank: list[str], text: str) -> None:
    """`text` given out as content but its trailing whitespace, held in `blank` (before a
    call it is not content; before more text it is). Whitespace alone is held in pieces: a
    long run is not copied again with each one."""
    kept = text.rstrip()
    if not kept:
        blank.append(text)
        return
    out.content += "".join(blank) + kept
    blank[:] = [text[len(kept):]]


class WholeReplyReader:
    """A reply that is calls whole or none of it: one that starts with OPENS (whitespace
    aside) is held to the end and read by `calls`; any other goes out as it comes."""

    OPENS = ""

    def __init__(self) -> None:
        self._held: list[str] = []
        self._decided: bool | None = None  # True: held as calls; False: content

    def feed(self, text: str) -> Parsed:
        if self._decided is False:
            return Parsed(content=text)
        self._held.append(text)
        if self._decided is None and text and not text.isspace():
            held = "".join(self._held)
            self._decided = held.lstrip().startswith(self.OPENS)
            if not self._decided:
                self._held = []
                return Parsed(content=held)
        return Parsed()

    def finish(self) -> Parsed:
        held, decided = "".join(self._held), self._decided
        self._held, self._decided = [], None
        calls = self.calls(held) if decided else None
        return Parsed(calls=calls) if calls else Parsed(content=held)

    def calls(self, held: str) -> list[dict] | None:
        """The calls the whole reply holds, or None when it is not calls."""
        raise NotImplementedError


class Llama3JsonReader(WholeReplyReader):
    """`{"name": ..., "parameters": {...}}` objects, `;` or whitespace between them."""

    OPENS = "{"

    def calls(self, held: str) -> list[dict] | None:
        calls = [named_call(piece, "parameters", "arguments") for piece in _split_objects(held)]
        return None if not calls or any(c is None for c in calls) else calls


def reader(name: str):
    """A fresh reader of one completion for the parser `name` (one of PARSERS): feed() each
    piece of text, then finish()."""
    # (imported here: those modules build on this one's helpers)
    from openai_api.mistral_tool_parser import MistralReader
    from openai_api.pythonic_tool_parser import PythonicReader

    readers = {"hermes": HermesReader, "llama3_json": Llama3JsonReader,
               "mistral": MistralReader, "pythonic": PythonicReader}
    return readers[name]()


def parse(name: str, text: str) -> Parsed:
    """A whole completion read as its stream is."""
    read = reader(name)
    first, last = read.feed(text), read.finish()
    return Parsed(first.content + last.content, first.calls + last.calls)


def named_call(text: str, *argument_keys: str) -> dict | None:
    """OpenAI's call for a JSON object {"name": str, <argument key>: object}, its arguments
    the text the model wrote; None when the text is not that, or not standard JSON (NaN,
    Infinity), or names no function (a name no UTF-8 can carry)."""
    try:
        value = json.loads(text, parse_constant=not_json)
        raw, _ = raw_members(text)
    except (ValueError, RecursionError):
        return None
    name = value.get("name") if isinstance(value, dict) else None
    if not isinstance(name, str) or not utf8(name):
        return None
    for key in argument_keys:
        if isinstance(value.get(key), dict):
            return call_json(name, raw[key])
    return None


def not_json(constant: str) -> None:
    raise ValueError(f"{constant} is not JSON")


def utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate ("\ud800" in the JSON)
        return False
    return True


def _split_objects(text: str) -> list[str]:
    """JSON objects one after another, `;` or whitespace between them; [] when the text is
    not that."""
    decoder, pieces, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and (text[at].isspace() or text[at] == ";"):
            at += 1
        if at == len(text):
            return pieces
        try:
            _, end = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):
            return []
        pieces.append(text[at:end])
        at = end


def longest_prefix_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (shorter than it)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
