"""Errors of the index that the gRPC layer maps to status codes."""

from __future__ import annotations


class IndexRequestError(Exception):
    """A request the index refuses; subclasses say which status code it maps to."""


class InvalidRequestError(IndexRequestError):
    """Bad input (INVALID_ARGUMENT). The message names the field, the value and what is allowed."""


class EngineNotFoundError(IndexRequestError):
    """The engine never registered or its lease expired (NOT_FOUND)."""


class StaleEpochError(IndexRequestError):
    """The request carries an epoch older than the engine's current one (FAILED_PRECONDITION)."""


class EngineIdTakenError(IndexRequestError):
    """Another process (another nonce) holds a live lease on the engine id (ALREADY_EXISTS).
    `holder_address` and `holder_instance` say where that process serves and the ModelInfo
    instance id it registered ("" when it registered none): what the index probes."""

    def __init__(self, message: str, holder_address: str = "", holder_instance: str = "") -> None:
        super().__init__(message)
        self.holder_address = holder_address
        self.holder_instance = holder_instance


class SequenceError(IndexRequestError):
    """An Apply's sequence number shows lost or duplicated writes (ABORTED): register again."""


class NotOwnerError(IndexRequestError):
    """An engine's certificate acting on an engine id another certificate registered
    (PERMISSION_DENIED)."""


class QuotaExceededError(IndexRequestError):
    """A caller past one of its quotas (RESOURCE_EXHAUSTED); the message names the quota, its
    value and the flag that sets it. `retry_after_s`: when the same call would pass (a rate),
    None when only something else can free the quota (a lease lapsing, a watcher leaving)."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
