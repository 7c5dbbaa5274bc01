"""What a request's output must match (vLLM's `StructuredOutputsParams`), as plain data.

Exactly one kind per request: a JSON Schema, any JSON object, a regular expression, one of a
list of strings, or an EBNF grammar (xgrammar's dialect, as vLLM's `guided_grammar`). The
engine compiles it once for the model's tokenizer (model/grammar.py) and masks each step's
logits to the tokens that keep the output inside it. Checked here: the shape and the sizes;
whether the schema, regex or grammar compiles is the engine's to say.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

# The text of a schema, regex or grammar (and all choices together): its compilation runs
# beside the engine's steps, and its cost grows with it.
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 1024
# Levels of nested objects and arrays in a schema: its compilation grows much faster than its
# text with them (990 levels of `items`, 25 KB, took 76 s), and Python's JSON coders recurse.
MAX_SCHEMA_DEPTH = 64
KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    json: str | dict | None = None  # a JSON Schema; normalized to its JSON text
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None  # normalized to a tuple
    grammar: str | None = None  # EBNF
    # The prompt's last `resumed_tokens` tokens were generated under this constraint already
    # (a stream the router resumes on another replica): the grammar starts after them.
    resumed_tokens: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.resumed_tokens, bool) or not isinstance(self.resumed_tokens, int) \
                or self.resumed_tokens < 0:
            raise ValueError(f"structured_outputs.resumed_tokens must be an int >= 0, "
                             f"got {self.resumed_tokens!r}")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be a bool, "
                             f"got {self.json_object!r}")
        chosen = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError(
                f"structured_outputs must set exactly one of {', '.join(KINDS)}, got "
                f"{' and '.join(chosen) if chosen else 'none of them'}")
        if self.json is not None:
            object.__setattr__(self, "json", _schema_text(self.json))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, str) or not value:
                    raise ValueError(f"structured_outputs.{name} must be a non-empty string, "
                                     f"got {_shown(value)}")
                _check_size(name, len(value))
                _check_utf8(f"structured_outputs.{name}", value)
        if self.choice is not None:
            object.__setattr__(self, "choice", _choices(self.choice))

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple:
        """What identifies the compiled grammar (equal keys compile to the same one)."""
        return (self.kind, getattr(self, self.kind))


def _schema_text(schema: object) -> str:
    """A schema given as JSON text or as a dict, as compact JSON text of an object."""
    if isinstance(schema, str):
        _check_size("json", len(schema))
        try:
            schema = json.loads(schema)
        except ValueError as error:
            raise ValueError(f"structured_outputs.json must be a JSON Schema in JSON text, got "
                             f"text that is not JSON ({error})") from None
        except RecursionError:
            raise _too_deep() from None
    if not isinstance(schema, dict):
        raise ValueError(f"structured_outputs.json must be a JSON Schema (an object), got "
                         f"{_shown(schema)}")
    if _depth(schema) > MAX_SCHEMA_DEPTH:
        raise _too_deep()
    try:
        text = json.dumps(schema, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as error:
        raise ValueError(f"structured_outputs.json must hold only JSON values, got "
                         f"{error}") from None
    _check_size("json", len(text))
    return text


def _depth(value: object) -> int:
    """Levels of nested dicts and lists in `value`, counted without recursion (a deeper one
    stops the count: more than the limit is all that matters)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, level)
            if level > MAX_SCHEMA_DEPTH:
                return level
            stack.extend((child, level + 1)
                         for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def _too_deep() -> ValueError:
    return ValueError(f"structured_outputs.json must nest objects and arrays at most "
                      f"{MAX_SCHEMA_DEPTH} levels deep, got a deeper schema")


def _check_utf8(name: str, text: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"{name} must be valid Unicode text, got a lone surrogate at "
                         f"character {error.start}") from None


def _choices(choices: object) -> tuple[str, ...]:
    if isinstance(choices, str) or not isinstance(choices, list | tuple):
        raise ValueError(f"structured_outputs.choice must be a list of strings, "
                         f"got {_shown(choices)}")
    if not 1 <= len(choices) <= MAX_CHOICES:
        raise ValueError(f"structured_outputs.choice must hold 1 to {MAX_CHOICES} strings, "
                         f"got {len(choices)}")
    for i, choice in enumerate(choices):
        if not isinstance(choice, str) or not choice:
            raise ValueError(f"structured_outputs.choice[{i}] must be a non-empty string, "
                             f"got {_shown(choice)}")
        _check_utf8(f"structured_outputs.choice[{i}]", choice)
    _check_size("choice", sum(len(c) for c in choices))
    return tuple(choices)


def _check_size(name: str, num_chars: int) -> None:
    if num_chars > MAX_SPEC_CHARS:
        raise ValueError(f"structured_outputs.{name} must be at most {MAX_SPEC_CHARS} "
                         f"characters, got {num_chars}")


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."
