"""Python-call tool calls (--tool-call-parser pythonic): a reply that is a Python list of calls
with keyword arguments of literal values, `[get_weather(city="Paris", days=2), get_time()]`,
as Llama 3.2 and Llama 4 write them (Llama 4's <|python_start|> / <|python_end|> are special
tokens, left out of the text).

The whole reply is calls or none of it is: a reply that starts with '[' is held to the end and
read with Python's own parser (nothing is evaluated: each value is a literal; the parser
bounds the nesting). The arguments go out as JSON (the model wrote Python), so a value JSON
has no form for (a set, bytes, NaN, a dict key that is not a string) or a keyword given twice
leaves the reply as content.
"""

from __future__ import annotations

import ast
import json

from openai_api.tool_calls import call_json
from openai_api.tool_parsers import WholeReplyReader, utf8


class PythonicReader(WholeReplyReader):
    OPENS = "["

    def calls(self, held: str) -> list[dict] | None:
        return python_calls(held)


def python_calls(text: str) -> list[dict] | None:
    """The calls of a Python list of `name(key=literal, ...)`, or None when it is not one."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        arguments = {}
        for keyword in node.keywords:
            if keyword.arg is None or keyword.arg in arguments:  # **kwargs, a key twice
                return None
            try:
                arguments[keyword.arg] = ast.literal_eval(keyword.value)
            except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
                return None
        if not _string_keys(arguments):
            return None
        try:
            text_arguments = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
        except (TypeError, ValueError, RecursionError):  # a set, bytes, NaN: no JSON form
            return None
        if not utf8(node.func.id) or not utf8(text_arguments):
            return None
        calls.append(call_json(node.func.id, text_arguments))
    return calls


def _string_keys(value: object) -> bool:
    """Whether every dict in `value` has string keys alone: JSON would turn 1 and True into
    "1" and "true", and two keys could become one."""
    if isinstance(value, dict):
        return all(isinstance(k, str) for k in value) and all(
            _string_keys(v) for v in value.values())
    if isinstance(value, list | tuple):
        return all(_string_keys(v) for v in value)
    return True
