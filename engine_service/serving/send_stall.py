"""Streams whose client takes nothing (--send-stall-timeout-s), on the engine's and the router's
gRPC streams; the HTTP API watches its own writes (openai_api/disconnect.py) and counts and logs
its stalls here too.

Without a bound, a client that opened a stream and never read held its queue slot and its
buffered output for good, its connection kept alive by keepalive pings.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

log = logging.getLogger(__name__)

# A stream whose next message has waited this long unsent is ended: the bound nginx's
# send_timeout (60 s) puts on a write to a client.
DEFAULT_SEND_STALL_TIMEOUT_S = 60.0
# At most one log line per this many seconds about stalled streams (a flood of them is one
# client's doing, counted in the metric).
STALL_LOG_INTERVAL_S = 10.0



def add_send_stall_arg(p: argparse.ArgumentParser) -> None:
    """--send-stall-timeout-s, the same on the engine and the router."""
    p.add_argument("--send-stall-timeout-s", type=float, default=DEFAULT_SEND_STALL_TIMEOUT_S,
                   help="a stream (gRPC or HTTP) whose client takes nothing this long while its "
                        "next message waits is ended (gRPC: DEADLINE_EXCEEDED; HTTP: the "
                        "connection closed) and its request stopped; a reader seen taking "
                        "anything in that time is not (one a whole window behind is seen at "
                        "its window updates: docs/operating.md) (0: never)")


@dataclass(slots=True, eq=False)
class StreamSend:
    """One stream's writes as SendStallWatch sees them: `since` is set while a message waits
    for the transport (from the yield that hands it to grpc.aio until the generator resumes,
    which is when its write is done) and None otherwise."""

    task: asyncio.Task | None
    context: object
    since: float | None = None
    stalled: bool = False  # ended by the watch (or, over HTTP, by the HTTP API's)
    closed: bool = False  # the stream has ended (close())
    # The call's headers are out (or the watch does not end this stream): see send_headers.
    headers_sent: bool = True
    headers: asyncio.Future | None = None  # their write, in a task of its own


class SendStallWatch:
    """Ends gRPC streams whose client takes nothing. grpc.aio finishes the write of a message
    once the transport has room for it: past the client's flow-control window (what it has not
    read), the write waits. A write still waiting after `timeout_s` means the client read
    nothing for that long (a slow reader takes something and the write completes), so the call
    is ended: its task is cancelled (the generator's `finally` stops the request and frees its
    slot) and DEADLINE_EXCEEDED is queued behind what gRPC holds (a client that reads on gets
    it after that; on one that never does, nothing more is spent).

    One sweeper task checks every open stream's pending write, so a streamed message costs a
    clock read, not a timer. `server`: whose flag the status names ("this engine's")."""

    def __init__(self, timeout_s: float, server: str,
                 on_stall: Callable[[], None] | None = None) -> None:
        self.timeout_s = timeout_s  # 0: streams are never ended for not reading
        self.server = server
        self.on_stall = on_stall  # counts it (a metric)
        self._sends: set[StreamSend] = set()
        self._tasks: set[asyncio.Task] = set()  # the sweeper and the aborts (strong refs)
        self._sweeper: asyncio.Task | None = None
        self._last_log = -STALL_LOG_INTERVAL_S
        self._unlogged = 0

    def open(self, context) -> StreamSend:
        """A stream's record, watched from now until close(); not watched when the watch is off
        or the call comes from the HTTP API (in-process: it watches its own writes)."""
        send = StreamSend(asyncio.current_task(), context)
        if getattr(context, "sends_watched", False):
            context.send = send  # marked stalled by its own watcher (HttpCallContext)
        elif self.timeout_s > 0:
            send.headers_sent = False
            self._sends.add(send)
            if self._sweeper is None:
                self._sweeper = self._spawn(self._sweep())
        return send

    async def send_headers(self, send: StreamSend) -> None:
        """Sends a watched call's headers on their own, before its first message. grpc.aio
        marks them sent only once a write carrying them completes; were the first message the
        stuck one, ending the call would send them again, which gRPC refuses
        (GRPC_CALL_ERROR_TOO_MANY_OPERATIONS): no status would go, and a client that has the
        headers and reads on would wait for its end until its deadline. Headers are not
        flow-controlled, but they queue behind what the connection has not taken: on a
        connection whose client takes no bytes at all (frozen, paused) this write waits too, so
        it is watched like a message, and made in a task of its own that ending the call does
        not cancel: should the client take bytes again, they go, then the status (_end)."""
        send.since = time.monotonic()
        send.headers = asyncio.ensure_future(send.context.send_initial_metadata(()))
        send.headers.add_done_callback(_retrieve_error)
        await asyncio.shield(send.headers)
        send.headers_sent = True

    def close(self, send: StreamSend) -> None:
        send.closed = True
        self._sends.discard(send)

    def stalled(self, waited_s: float) -> None:
        """A stream was ended for not reading (here or by the HTTP API): counted, and logged at
        most once per STALL_LOG_INTERVAL_S with the number ended since the last line."""
        if self.on_stall is not None:
            self.on_stall()
        now = time.monotonic()
        self._unlogged += 1
        if now - self._last_log >= STALL_LOG_INTERVAL_S:
            log.warning("%d stream(s) ended: the client took nothing for %.0f s "
                        "(--send-stall-timeout-s %g)", self._unlogged, waited_s, self.timeout_s)
            self._last_log, self._unlogged = now, 0

    def message(self, waited_s: float) -> str:
        return (f"the stream was not read: its next message waited {waited_s:.0f} s unsent (the "
                f"client took nothing), past {self.server} --send-stall-timeout-s "
                f"{self.timeout_s:g}; the request was stopped: read the stream as it comes")

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _sweep(self) -> None:
        # Checked 4 times a timeout (at least once a second): a stall is ended within
        # 1.25 timeouts of its write.
        interval = min(1.0, self.timeout_s / 4)
        try:
            while self._sends:
                await asyncio.sleep(interval)
                now = time.monotonic()
                for send in [s for s in self._sends
                             if s.since is not None and now - s.since >= self.timeout_s]:
                    self._sends.discard(send)  # (back in by _end if its write went through)
                    self._spawn(self._end(send))
        finally:
            self._sweeper = None

    async def _end(self, send: StreamSend) -> None:
        # Decided here, not in the sweep: the write may have gone through meanwhile (the
        # client read at last); then the stream goes on, watched again. From this check to the
        # cancel nothing awaits.
        if send.closed or send.task is None or send.task.done():
            return
        if send.since is None or time.monotonic() - send.since < self.timeout_s:
            # The write went through meanwhile (and maybe the next one began): watched again.
            self._sends.add(send)
            if self._sweeper is None:
                self._sweeper = self._spawn(self._sweep())
            return
        waited_s = time.monotonic() - send.since
        send.stalled = True
        self.stalled(waited_s)
        message = self.message(waited_s)
        # The cancel lands once this awaits, after abort has set the call's code (which the
        # generator's ending counts): the pending write raises CancelledError in grpc.aio's
        # task, which ends the call's handler there, and the generator is closed with it.
        send.task.cancel()
        if not send.headers_sent and send.headers is not None:
            # Stalled in sending its headers: the status can only follow them (sent again with
            # it, gRPC would refuse the batch), so it waits for them, as long as the client's
            # connection lasts.
            try:
                await send.headers
            except Exception as error:  # the client has gone: nothing to send
                log.debug("a stalled stream's headers did not go: %r", error)
                return
        # abort raises by design (AbortError), once the client has read up to the status. It
        # fails when the client has gone meanwhile (the status's batch fails: nothing to do),
        # or when gRPC refuses to start that batch: then no status goes and a client reading on
        # waits for it until its deadline (our side is freed all the same). send_headers is
        # there for the one such case seen; another is logged.
        try:
            await send.context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, message)
        except grpc.aio.AbortError:
            pass
        except Exception as error:  # (grpc.aio's ExecuteBatchError is not public)
            refused = "start_batch" in str(error)  # its words for a batch refused at the start
            log.log(logging.WARNING if refused else logging.DEBUG,
                    "a stalled stream's status could not be sent: %r", error)


def _retrieve_error(headers: asyncio.Future) -> None:
    # A call ended otherwise (its client cancelled) leaves its headers' write unawaited: its
    # error is nobody's to report (asyncio would log it as never retrieved).
    if not headers.cancelled():
        headers.exception()
