"""Counts of Triton kernel launches, by kernel, for the code running in a `launch_counter()`
context: every Triton host wrapper reports its launches here. On a GPU each is one kernel
launch; tests count a step's launches on the CPU (where the kernels run in Triton's
interpreter, which itself issues torch ops that a dispatch-mode count must not mistake for
the model's)."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from contextvars import ContextVar

_counts: ContextVar[Counter | None] = ContextVar("triton_launch_counts", default=None)


@contextlib.contextmanager
def launch_counter() -> Iterator[Counter]:
    """The launches made inside, kernel name -> count."""
    counts: Counter = Counter()
    token = _counts.set(counts)
    try:
        yield counts
    finally:
        _counts.reset(token)


def count_launch(name: str) -> None:
    counts = _counts.get()
    if counts is not None:
        counts[name] += 1
