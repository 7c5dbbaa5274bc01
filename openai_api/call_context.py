"""What a gRPC servicer method needs of its `context`, for calls that come over HTTP.

The servicers (the engine's and the router's) read four things from their context: the time
left (no deadline over HTTP), trailing metadata to set, `abort`, which raises, and who calls
(`caller`). Calling the servicer's own methods with this context is what keeps one request
path: the same validation, the same sampling mapping, the same routing and failover, whichever
protocol the client spoke.
"""

from __future__ import annotations

import grpc


class CallAborted(Exception):
    """The servicer refused or ended the call (gRPC's context.abort raises too)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class HttpCallContext:
    # The servicers' send-stall watch leaves these calls alone: the HTTP API watches its own
    # writes to the client (openai_api/disconnect.py) and closes the connection itself.
    sends_watched = True

    def __init__(self, caller=None) -> None:
        # Who sent it (tenancy/gate.py's Caller, from the HTTP API's key check); None: an
        # open server, the same as gate.OPEN_CALLER.
        self.caller = caller
        self.trailing_metadata: tuple[tuple[str, str], ...] = ()
        self._code: grpc.StatusCode | None = None
        # The servicer's record of this stream's writes (send_stall.StreamSend), given by its
        # watch, which leaves the watching to the HTTP API: end_for_stall marks it.
        self.send = None

    def time_remaining(self) -> float | None:
        return None  # HTTP requests carry no deadline; a client that leaves aborts its request

    def set_trailing_metadata(self, metadata) -> None:
        self.trailing_metadata = tuple(metadata)

    def code(self) -> grpc.StatusCode | None:
        """The status the call was aborted with, as gRPC's context says it; None before."""
        return self._code

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        self._code = code
        raise CallAborted(code, details)

    def end_for_stall(self) -> None:
        """The HTTP API closes this stream's connection: its client took nothing for
        --send-stall-timeout-s. Marked as the servicer's own watch marks a gRPC stream it ends,
        the call counts DEADLINE_EXCEEDED (requests_total), not CANCELLED as a client that
        left."""
        if self.send is not None:
            self.send.stalled = True


class StreamCalls:
    """The servicer calls behind one streamed HTTP response (one per prompt), made here so the
    response's stall can be told to each."""

    def __init__(self, caller=None) -> None:
        self.caller = caller
        self._contexts: list[HttpCallContext] = []

    def context(self) -> HttpCallContext:
        context = HttpCallContext(self.caller)
        self._contexts.append(context)
        return context

    def end_for_stall(self) -> None:
        for context in self._contexts:
            context.end_for_stall()
