"""Results as strict, compact JSON: objects one key a line, arrays of numbers (and arrays of
such arrays: a request's record, a memory trace) on one line.

`json.dumps(indent=2)` puts every number of a trace on a line of its own; the committed
results were ~200,000 lines that way, most of them one number each."""

from __future__ import annotations

import json
import math
from pathlib import Path


def finite(value):
    """Strict JSON: an infinite rate is written "inf", a missing figure (NaN) null."""
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def _is_flat(value) -> bool:
    return not isinstance(value, (dict, list, tuple))


def _one_line(items: list) -> bool:
    return all(
        _is_flat(x) or (isinstance(x, (list, tuple)) and all(_is_flat(y) for y in x))
        for x in items
    )


def _dumps(value, indent: int) -> str:
    pad = " " * (indent + 2)
    if isinstance(value, dict) and value:
        body = ",\n".join(f"{pad}{json.dumps(k)}: {_dumps(v, indent + 2)}"
                          for k, v in value.items())
        return "{\n" + body + "\n" + " " * indent + "}"
    if isinstance(value, (list, tuple)) and value and not _one_line(list(value)):
        body = ",\n".join(pad + _dumps(v, indent + 2) for v in value)
        return "[\n" + body + "\n" + " " * indent + "]"
    return json.dumps(value, allow_nan=False)


def results_text(value) -> str:
    return _dumps(finite(value), 0) + "\n"


def write_results(path: Path, value) -> None:
    path.write_text(results_text(value))
