"""A stream whose client stopped reading, still open when the HTTP API stops, is ended as a
client leaving would end it (its connection closed, its work cancelled), with one WARNING
counting such responses.

Before, uvicorn cancelled it at its own deadline and logged an ERROR ("Cancel 1 running
task(s)") and an "Exception in ASGI application" with a traceback at every stop that found a
frozen client, though no server code had failed. The servicer here is a stand-in that streams
text without end, so the HTTP API's own stop is what is tested, on a real loopback server."""

from __future__ import annotations

import logging
import time

from openai_api.server import HttpServer
from tests.http.http_util import serving
from tests.http.test_send_stall_http import EndlessServicer, _open_stream, _wait


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_an_unread_stream_open_at_the_stop_is_closed_without_an_error():
    servicer = EndlessServicer()
    # No stall watch: only the stop ends this stream.
    http = HttpServer("127.0.0.1", 0, send_stall_timeout_s=0)
    records = Records()
    # uvicorn's loggers do not propagate to the root logger, and its start sets their
    # handlers (its own logging config): watched once it has started.
    watched = [logging.getLogger(name) for name in ("uvicorn.error", "openai_api.server")]
    sock = None
    try:
        with serving(http, servicer) as port:
            for logger in watched:
                logger.addHandler(records)
            sock = _open_stream(port)  # open past the stop: the client never leaves
            _wait(lambda: servicer.open_streams == 1, "the stream started", 10)
            # A 4 KB receive buffer: the server's writes fill it and its own send buffer in
            # milliseconds (~2 MB/s of events); the client never reads.
            time.sleep(1.0)
            assert servicer.closed_streams == 0
        # (serving's exit stopped the server, with a 0.1 s grace)
    finally:
        for logger in watched:
            logger.removeHandler(records)
        if sock is not None:
            sock.close()
    assert servicer.closed_streams == 1 and servicer.open_streams == 0
    errors = [f"{r.name}: {r.getMessage()}" for r in records.records
              if r.levelno >= logging.ERROR]
    assert not errors, errors
    warnings = [r.getMessage() for r in records.records if r.levelno == logging.WARNING]
    assert any(m.startswith("1 HTTP responses still unfinished") for m in warnings), warnings
