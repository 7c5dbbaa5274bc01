"""Errors the engine core raises reach the serving front pickled (engine_service/serving/
core_process.py): each must come back as the same type with the same fields, or the front
could not map it to its status code (and an unpicklable one would lose the whole step)."""

from __future__ import annotations

import pickle

import pytest

from engine_service.core.errors import (
    DuplicateRequestError,
    EngineDeadError,
    InvalidRequestError,
    QueueFullError,
    RequestTooLargeError,
)
from engine_service.index.link import IndexUnavailableError, PinRefusedError


@pytest.mark.parametrize("error", [
    InvalidRequestError("prompt", "prompt must not be empty, got ''"),
    RequestTooLargeError("max_tokens", "max_tokens must be at most 9, got 10"),
    DuplicateRequestError("request_id", "request_id must be unique, got 'a'"),
    QueueFullError("request", "too many live requests"),
])
def test_request_errors_keep_their_field(error):
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error)
    assert back.field == error.field and str(back) == str(error)


def test_pin_refusals_keep_their_reason():
    back = pickle.loads(pickle.dumps(PinRefusedError("budget", "the pin budget is full")))
    assert isinstance(back, PinRefusedError)
    assert back.reason == "budget" and str(back) == "the pin budget is full"


@pytest.mark.parametrize("error", [IndexUnavailableError("index down"),
                                   EngineDeadError("engine gone")])
def test_plain_errors_round_trip(error):
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is type(error) and str(back) == str(error)
