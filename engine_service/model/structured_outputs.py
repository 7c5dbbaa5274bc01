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
    """A schema given as JSON text or as a dict, as compact JSON text of an object (or a bool,
    JSON Schema's match-anything and match-nothing)."""
    if isinstance(schema, str):
        _check_size("json", len(schema))
        try:
            schema = json.loads(schema)
        except ValueError as error:
            raise ValueError(f"structured_outputs.json must be a JSON Schema in JSON text, got "
                             f"text that is not JSON ({error})") from None
    if not isinstance(schema, dict | bool):
        raise ValueError(f"structured_outputs.json must be a JSON Schema (an object), got "
                         f"{_shown(schema)}")
    try:
        text = json.dumps(schema, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as error:
        raise ValueError(f"structured_outputs.json must hold only JSON values, got "
                         f"{error}") from None
    _check_size("json", len(text))
    return text


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
    _check_size("choice", sum(len(c) for c in choices))
    return tuple(choices)


def _check_size(name: str, num_chars: int) -> None:
    if num_chars > MAX_SPEC_CHARS:
        raise ValueError(f"structured_outputs.{name} must be at most {MAX_SPEC_CHARS} "
                         f"characters, got {num_chars}")


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:77]}..."
