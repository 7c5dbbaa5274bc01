"""The grammar compiler's own process (`python -m engine_service.serving.grammar_worker`): the
serving core sends it each constraint and gets the compiled grammar back as xgrammar's JSON
(serving/grammar_process.py). A compilation in a process can be stopped: a thread's cannot, and
a schema can take minutes to compile.

Frames both ways on stdin / stdout: an 8-byte length, then a pickle. The first request is
("init", model_config, vocab_size, stop_token_ids), answered ("ready", tokenizer info JSON),
or, for a worker started again, ("init_info", that JSON), answered ("ready", None). Then each
("compile", spec) is answered ("ok", grammar JSON), ("invalid", xgrammar's reason) or
("failed", what went wrong).
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import struct
import sys
import time
from typing import BinaryIO

from engine_service.serving.parent_death import die_with_parent

FRAME_LENGTH = struct.Struct("<Q")  # a frame: the pickle's length, then the pickle


def write_frame(out: BinaryIO, message: object) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    out.write(FRAME_LENGTH.pack(len(data)) + data)
    out.flush()


def read_frame(source: BinaryIO) -> object | None:
    """The next message, or None at the end of the stream (a writer killed mid-frame too)."""
    head = source.read(FRAME_LENGTH.size)
    if len(head) < FRAME_LENGTH.size:
        return None
    length = FRAME_LENGTH.unpack(head)[0]
    data = source.read(length)
    return pickle.loads(data) if len(data) == length else None


class FrameTimedOut(Exception):
    """A worker's frame not whole by its deadline."""


def read_frame_by(fd: int, deadline: float) -> object | None:
    """The parent's read_frame: the next frame from the pipe `fd`, all of it by `deadline`
    (time.monotonic()), else FrameTimedOut, so that a worker stopped mid-frame (SIGSTOP,
    swapped out) does not hold the compile thread. None at the end of the stream (a worker
    killed mid-frame)."""
    head = _read_exactly(fd, FRAME_LENGTH.size, deadline)
    if head is None:
        return None
    data = _read_exactly(fd, FRAME_LENGTH.unpack(head)[0], deadline)
    return None if data is None else pickle.loads(data)


def _read_exactly(fd: int, size: int, deadline: float) -> bytes | None:
    chunks: list[bytes] = []
    missing = size
    while missing:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise FrameTimedOut()
        chunk = os.read(fd, min(missing, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        missing -= len(chunk)
    return b"".join(chunks)


def serve(source: BinaryIO, out: BinaryIO) -> None:
    from engine_service.model.grammar import compile_spec, new_compiler, tokenizer_info

    compiler = None
    while (message := read_frame(source)) is not None:
        try:
            if message[0] == "init":
                info = tokenizer_info(*message[1:])
                compiler = new_compiler(info, cache=False)  # the core caches
                write_frame(out, ("ready", info.serialize_json()))
            elif message[0] == "init_info":  # a restart: the vocabulary as the first had it
                import xgrammar

                compiler = new_compiler(xgrammar.TokenizerInfo.deserialize_json(message[1]),
                                        cache=False)
                write_frame(out, ("ready", None))
            else:
                try:
                    grammar = compile_spec(compiler, message[1])
                except RuntimeError as error:  # xgrammar's parse and conversion errors
                    write_frame(out, ("invalid", str(error)))
                    continue
                write_frame(out, ("ok", grammar.serialize_json()))
        except Exception as error:  # noqa: BLE001 - told to the core, which fails the request
            write_frame(out, ("failed", f"{type(error).__name__}: {error}"))


def main() -> None:
    # Killed with the core, even mid compile (else it would run on to the compilation's end);
    # the core's thread that starts it is the compile thread, which lives as long as the core.
    die_with_parent()
    # The core's Ctrl-C or SIGTERM reaches its whole process group: this process ends with
    # the core, when its stdin closes, not with a traceback of its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a stray print must not break a frame
    serve(sys.stdin.buffer, out)


if __name__ == "__main__":
    main()
