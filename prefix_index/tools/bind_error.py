"""A server that cannot bind one of its ports says so in one line and exits 1 (the index, the
engine and the router alike), rather than a traceback or a crash while tearing down what it
had started."""

from __future__ import annotations

from collections.abc import Callable


class BindError(OSError):
    """A server's gRPC or metrics port could not be bound."""


def serve_metrics(serve: Callable[[int, str], None], port: int, host: str) -> None:
    """Start the Prometheus endpoint (call it before anything else runs)."""
    try:
        serve(port, host)
    except OSError as error:
        raise BindError(f"metrics port {host}:{port}: {error.strerror or error}") from error
