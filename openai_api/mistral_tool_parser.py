"""Mistral's tool calls (--tool-call-parser mistral): `[TOOL_CALLS]` and then the calls, to the
end of the reply, in either of the formats Mistral's tokenizers have written:

- v3 (Mistral-7B-Instruct-v0.3, Mistral-Nemo): `[TOOL_CALLS][{"name": ..., "arguments":
  {...}}, ...]`, one JSON array;
- v11 and later (Mistral-Small-3.2, Magistral, Devstral): `[TOOL_CALLS]name[ARGS]{...}` for
  each call (a `[CALL_ID]id` before `[ARGS]` is skipped).

Text before the first `[TOOL_CALLS]` is content as it streams; the calls go out whole when the
reply ends. A calls part that reads as neither format is content, as the model wrote it.
`[TOOL_CALLS]` is a special token in Mistral's tokenizers: replies keep special tokens
(TAGS_MAY_BE_SPECIAL).
"""

from __future__ import annotations

import json
import re

from openai_api.tool_calls import call_json
from openai_api.tool_parsers import (
    Parsed,
    give_content,
    longest_prefix_suffix,
    named_call,
    not_json,
    utf8,
)

TAG, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
# A function's name as Mistral's v11 format writes it before [ARGS]
NAME = re.compile(r"[\w.\-]+")


class MistralReader:
    def __init__(self) -> None:
        self._pending = ""  # content not given out yet: it may begin TAG
        self._calls: list[str] | None = None  # the text after TAG, held to the end
        # Trailing whitespace of the content, in pieces: not content before the calls.
        self._blank: list[str] = []

    def feed(self, text: str) -> Parsed:
        out = Parsed()
        if self._calls is not None:
            self._calls.append(text)
            return out
        self._pending += text
        start = self._pending.find(TAG)
        if start >= 0:
            self._give_content(out, self._pending[:start])
            self._calls, self._pending = [self._pending[start + len(TAG):]], ""
            return out
        keep = longest_prefix_suffix(self._pending, TAG)
        self._give_content(out, self._pending[:len(self._pending) - keep])
        self._pending = self._pending[len(self._pending) - keep:]
        return out

    def finish(self) -> Parsed:
        out = Parsed()
        if self._calls is None:
            self._give_content(out, self._pending)
            out.content += "".join(self._blank)
        else:
            body = "".join(self._calls)
            calls = mistral_calls(body)
            if calls is None:  # not calls after all: the text as the model wrote it
                self._give_content(out, TAG + body)
                out.content += "".join(self._blank)
            else:
                out.calls = calls
        self._pending, self._calls, self._blank = "", None, []
        return out

    def _give_content(self, out: Parsed, text: str) -> None:
        give_content(out, self._blank, text)


def mistral_calls(body: str) -> list[dict] | None:
    """The calls written after the first TAG (either format), or None when they are not."""
    stripped = body.strip()
    if stripped.startswith(("[", "{")):
        pieces = _json_objects(stripped)
        if not pieces:
            return None
        calls = [named_call(piece, "arguments") for piece in pieces]
        return None if any(c is None for c in calls) else calls
    # v11: name[ARGS]{...}, each after its TAG; read in order (an argument's string may hold
    # a TAG of its own).
    calls, at, decode = [], 0, json.JSONDecoder(parse_constant=not_json).raw_decode
    while True:
        args = body.find(ARGS, at)
        if args < 0:
            return None
        name = body[at:args].split(CALL_ID, 1)[0].strip()
        start = args + len(ARGS)
        while start < len(body) and body[start].isspace():
            start += 1
        try:
            value, end = decode(body, start)
        except (ValueError, RecursionError):
            return None
        if not NAME.fullmatch(name) or not utf8(name) or not isinstance(value, dict):
            return None
        calls.append(call_json(name, body[start:end]))
        rest = body[end:].lstrip()
        if not rest:
            return calls
        if not rest.startswith(TAG):
            return None
        at = len(body) - len(rest) + len(TAG)


def _json_objects(text: str) -> list[str]:
    """The objects of a JSON array of objects (or one object alone), each as written; [] when
    the text is not that."""
    decode = json.JSONDecoder().raw_decode
    if text.startswith("{"):
        try:
            _, end = decode(text)
        except (ValueError, RecursionError):
            return []
        return [text] if end == len(text) else []
    pieces, at = [], 1
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at < len(text) and text[at] == "]" and not pieces:
            return []
        try:
            _, end = decode(text, at)
        except (ValueError, RecursionError):
            return []
        pieces.append(text[at:end])
        at = end
        while at < len(text) and text[at].isspace():
            at += 1
        if at < len(text) and text[at] == ",":
            at += 1
            continue
        return pieces if at == len(text) - 1 and text[at] == "]" else []
