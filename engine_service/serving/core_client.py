"""The serving front's handle on an engine core running in its own process (core_process.py).

It offers the servicer what the in-process AsyncEngine does (add, abort, liveness, stats, the
index link) from the event loop's thread, with no thread of its own: the channel's end is read
by the loop (add_reader), commands go out in one batch per loop turn.

Each request's outputs wait in a one-slot buffer that merges what arrives while the stream is
busy sending: a slow client gets fewer, larger messages instead of a queue that grows a message
per step, and the front's work per step stays one merge per request whatever the client does.
The buffer is bounded by the request's own output (max_tokens).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import os
import struct
import time
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

import grpc

from engine_service.core.errors import EngineDeadError
from engine_service.core.outputs import CompletionOutput, RequestOutput
from engine_service.core.stats import EngineStats
from engine_service.index.link import IndexUnavailableError
from engine_service.model.detokenizer import TokenDecoder
from engine_service.model.sampling_params import SamplingParams
from engine_service.serving.core_process import CoreChannel, CoreOptions, CoreTarget, run_core
from engine_service.serving.engine_info import EngineInfo
from engine_service.serving.output_text import RequestText
from engine_service.serving.output_wire import unpack_row
from engine_service.serving.status import RequestRejected

log = logging.getLogger("engine_service.serving.core_client")

# Core messages handled per reader callback before the loop gets a turn.
MESSAGES_PER_CALLBACK = 8
# What may wait for a stream its client does not read, in tokens (each top logprob one more):
# a reader that pauses lets a request's output merge into one larger message, up to this;
# past it the request is stopped (OutputBuffer._overflow). At 64 sequences of ~50 tokens/s it
# is 20 s of not reading; at one sequence, many minutes. Held as Python objects, a unit cost
# the front ~170 bytes (measured: 40 unread streams of 1,000 tokens with 20 logprobs, +140 MB),
# so up to ~11 MB a stream; the servicer's queue limit bounds how many streams (num_live).
# How long a stopping core gets to exit once told (it has nothing live: the drain cut it). An
# idle one takes a fraction of a second; one stuck in a step is killed, losing only its last
# flush to the index, so that the whole stop stays within the drain plus STOP_AFTER_DRAIN_S
# and the manifests' termination grace, not 30 s past it.
CORE_STOP_S = 3.0
DEFAULT_MAX_UNSENT_TOKENS = 1 << 16
# A core that sends nothing this long while it has work (a stream or a call) is taken for hung
# (a step that never returns: a driver, a deadlock) and killed: without it, a core alive but
# stuck kept health SERVING and took requests that waited for ever. The core sends a message
# every step, so only a single step this long reads as hung: on a GPU 60 s (vLLM's engine
# iteration timeout); on a CPU ten minutes, since one step there grows with its chunk's context
# (SmolLM2-135M on one thread: 17.8 s a step at 8,000 tokens; a model ten times its size, ten
# times that). 0: never.
DEFAULT_STALL_TIMEOUT_S = 60.0
DEFAULT_CPU_STALL_TIMEOUT_S = 600.0


def default_stall_timeout_s(device: str) -> float:
    return DEFAULT_STALL_TIMEOUT_S if device.startswith("cuda") else DEFAULT_CPU_STALL_TIMEOUT_S

_WHOLE_FIELDS = tuple(n for n in CompletionOutput.__slots__ if not n.endswith("_delta"))


def merge_outputs(older: RequestOutput, newer: RequestOutput,
                  text_parts: dict[int, list[str]]) -> RequestOutput:
    """`older` updated to say what it and then `newer` said: token and logprob deltas extended
    in place, text deltas collected in `text_parts` (joined once, when the stream takes the
    output), the rest newer's. Amortized O(new tokens) however long the stream has waited."""
    by_index = {c.index: c for c in older.outputs}
    for completion in newer.outputs:
        kept = by_index.get(completion.index)
        if kept is None:
            by_index[completion.index] = completion
            continue
        kept.token_ids_delta.extend(completion.token_ids_delta)
        if kept.logprobs_delta is None:
            kept.logprobs_delta = completion.logprobs_delta
        elif completion.logprobs_delta:
            kept.logprobs_delta.extend(completion.logprobs_delta)
        if completion.text_delta:
            text_parts.setdefault(completion.index, []).append(completion.text_delta)
        for name in _WHOLE_FIELDS:
            setattr(kept, name, getattr(completion, name))
    if len(by_index) != len(older.outputs):
        older.outputs = sorted(by_index.values(), key=lambda c: c.index)
    for name in ("finished", "num_cached_tokens", "finished_time"):
        setattr(older, name, getattr(newer, name))
    older.prompt_logprobs = older.prompt_logprobs or newer.prompt_logprobs  # in one output
    older.first_token_time = older.first_token_time or newer.first_token_time
    return older


def cut_streams(streams: dict[str, OutputBuffer], abort: Callable[[str], bool],
                error: BaseException) -> int:
    """Ends every stream in `streams` with `error` and aborts its request; how many."""
    request_ids = list(streams)
    for request_id in request_ids:
        streams[request_id].put(error)
        abort(request_id)
    return len(request_ids)


class OutputBuffer:
    """A request's outputs on their way to its stream: at most one pending item, merged.

    `stream_interval` > 1 holds the stream back until that many new tokens (in its longest
    sequence) have gathered, as vLLM's and SGLang's --stream-interval: the first tokens, the
    last output, and errors go at once. Fewer messages a token is what a stream costs less of
    in the front (grpcio's own work is most of a message's cost)."""

    __slots__ = ("_pending", "_ready", "_text_parts", "_interval", "_started", "prompt_token_ids",
                 "prompt", "text", "_unsent", "_max_unsent", "_on_overflow", "arrival_time",
                 "first_token_time")

    def __init__(self, prompt_token_ids: list[int], prompt: str | None,
                 text: RequestText | None, stream_interval: int = 1,
                 max_unsent_tokens: int = 0,
                 on_overflow: Callable[[], None] | None = None) -> None:
        self._pending: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()
        self._text_parts: dict[int, list[str]] = {}
        self._interval = stream_interval
        self._started = False  # the stream has taken an output with tokens
        self.prompt_token_ids = prompt_token_ids
        self.prompt = prompt
        self.text = text  # makes the text of each output, in order (None: ids only)
        # Tokens (each top logprob counted as one more) merged since the stream last took an
        # output; past _max_unsent (0: no bound) while the stream has one waiting, nobody is
        # reading it: the request is stopped (_on_overflow aborts it in the engine).
        self._unsent = 0
        self._max_unsent = max_unsent_tokens
        self._on_overflow = on_overflow
        # The request's times, from its outputs so far: what a TokenRow leaves out.
        self.arrival_time = 0.0
        self.first_token_time: float | None = None

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, RequestOutput):
            item.prompt_token_ids, item.prompt = self.prompt_token_ids, self.prompt
            self.arrival_time = item.arrival_time
            self.first_token_time = self.first_token_time or item.first_token_time
            if self.text is not None:
                self.text.apply(item)
            if isinstance(self._pending, BaseException):
                return  # an error ends the stream; nothing after it counts
            if self._max_unsent:
                self._unsent += _output_size(item)
                if self._unsent > self._max_unsent and self._ready.is_set() and (
                        not item.finished):
                    self._overflow()
                    return
            if isinstance(self._pending, RequestOutput):
                item = merge_outputs(self._pending, item, self._text_parts)
        self._pending = item
        if self._interval <= 1 or not isinstance(item, RequestOutput) or self._due(item):
            self._ready.set()

    def _overflow(self) -> None:
        """The stream has not taken what waits for it while more than the bound piled up: its
        client is not reading. What waits is dropped, the request stops (its blocks freed at
        the engine's next step), and the stream ends with RESOURCE_EXHAUSTED when its client
        reads on (or goes away)."""
        self._pending = RequestRejected(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"the stream was not read: {self._unsent} tokens (top logprobs counted) waited "
            f"unsent, past this engine's --max-unsent-tokens {self._max_unsent}; the request "
            f"was stopped: read the stream as it comes")
        self._text_parts = {}
        self._ready.set()
        if self._on_overflow is not None:
            self._on_overflow()

    put_nowait = put  # what the servicer's deadline timer calls

    def _due(self, output: RequestOutput) -> bool:
        if output.finished:
            return True
        most = max((len(c.token_ids_delta) for c in output.outputs), default=0)
        # (A sequence of several that ends early waits for the next message with the others.)
        return most >= self._interval or (most > 0 and not self._started)

    async def get(self) -> RequestOutput | BaseException:
        if not self._ready.is_set():  # set only with something pending, and only when due
            await self._ready.wait()
        item, self._pending = self._pending, None
        self._ready.clear()
        self._unsent = 0
        if isinstance(item, RequestOutput):
            self._started = self._started or any(c.token_ids_delta for c in item.outputs)
            if self._text_parts:
                for completion in item.outputs:
                    parts = self._text_parts.get(completion.index)
                    if parts:
                        completion.text_delta += "".join(parts)
                self._text_parts = {}
        return item


def _output_size(output: RequestOutput) -> int:
    """An output's new tokens, each top logprob counted as one more (what a message carries).
    Not its prompt logprobs: they come once, bounded by the context, and counting them would
    end an unread stream for its first message alone (the bound is for what grows)."""
    size = 0
    for completion in output.outputs:
        size += len(completion.token_ids_delta)
        for logprob in completion.logprobs_delta or ():
            size += len(logprob.top)
    return size


class CoreLinkView:
    """The servicer's IndexLink: the link lives in the core; its state comes with each step."""

    def __init__(self, client: CoreClient) -> None:
        self._client = client
        self.degraded = True
        self.details: dict[str, str] = {"state": "starting"}

    def health_details(self) -> dict[str, str]:
        return dict(self.details)

    async def pin_prefix(self, chain: list[bytes], ttl_s: float, unpin: bool) -> int:
        return await self._client.call("pin_prefix", (chain, ttl_s, unpin))


class CoreClient:
    """Start with `await start()`; then use from the event loop's thread only."""

    def __init__(
        self,
        options: CoreOptions,
        on_dead: Callable[[BaseException], None] | None = None,
        on_stats: Callable[[EngineStats, bool], None] | None = None,
        on_rpc: Callable[[str, float], None] | None = None,
        core_target: CoreTarget = run_core,
    ) -> None:
        self.options = options
        self.on_dead = on_dead
        self.on_stats = on_stats
        self.on_rpc = on_rpc
        self._core_target = core_target
        self.info: EngineInfo | None = None
        # The front's tokenizer (the servicer's: one thread uses it), for the outputs' text: the
        # core makes none. Set before the first request; None serves token ids only.
        self.tokenizer = None
        self.stream_interval = 1  # OutputBuffer's: new tokens gathered per streamed message
        # OutputBuffer's bound on what waits for a stream that is not read (0: none).
        self.max_unsent_tokens = DEFAULT_MAX_UNSENT_TOKENS
        self.stall_timeout_s = DEFAULT_CPU_STALL_TIMEOUT_S  # (the server sets it per device)
        self._heard_at = 0.0  # the core's last message, or when work began after a silence
        self.snapshot: EngineStats | None = None
        self.link = CoreLinkView(self) if options.prefix_index else None
        self.dead: BaseException | None = None
        self._streams: dict[str, OutputBuffer] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count(1)
        self._outbox: list[tuple] = []
        self._unsent = bytearray()  # framed commands the pipe could not take yet
        self._writing = False  # a writer callback waits for room in the pipe
        self._loop: asyncio.AbstractEventLoop | None = None
        self._process = None
        self._commands = None  # our end of the front -> core pipe
        self._outputs = None  # our end of the core -> front pipe
        self._started = False
        self._stopping = False

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> EngineInfo:
        """Starts the core process and waits until its engine is built (model load, memory
        profiling, warm-up): ValueError with the core's message when it cannot start."""
        self._loop = asyncio.get_running_loop()
        context = multiprocessing.get_context("spawn")  # no fork of a process with threads
        # One pipe each way. The front never blocks writing: its end is non-blocking and what
        # the pipe cannot take now waits in _unsent until the loop says it is writable, so the
        # loop always goes on reading what the core sends (two blocking writers on one full
        # socketpair would wait for each other for good).
        commands_in, self._commands = context.Pipe(duplex=False)
        self._outputs, outputs_out = context.Pipe(duplex=False)
        self._process = context.Process(target=self._core_target,
                                        args=(CoreChannel(commands_in, outputs_out), self.options),
                                        name="pagedgen-engine-core", daemon=True)
        self._process.start()
        commands_in.close()
        outputs_out.close()
        os.set_blocking(self._commands.fileno(), False)
        first = await asyncio.to_thread(self._first_message)
        if first[0] != "ready":
            await asyncio.to_thread(self._process.join, 10)
            raise ValueError(f"the engine core could not start: {first[1]}")
        self.info, self.snapshot = first[1], first[2]
        self._loop.add_reader(self._outputs.fileno(), self._readable)
        self._loop.add_reader(self._process.sentinel, self._core_exited)
        self._started = True
        self._heard_at = time.monotonic()
        self._loop.call_later(self._stall_check_interval(), self._check_stall)
        return self.info

    def _stall_check_interval(self) -> float:
        return min(1.0, self.stall_timeout_s / 4) if self.stall_timeout_s > 0 else 1.0

    def _check_stall(self) -> None:
        """Every second or so: a core silent past stall_timeout_s with work to do is killed and
        the front dies as when the core exits (NOT_SERVING, streams INTERNAL, exit 1)."""
        if self.dead is not None or self._stopping or self._outputs is None:
            return
        timeout = self.stall_timeout_s
        silent = time.monotonic() - self._heard_at
        if timeout > 0 and (self._streams or self._calls) and silent > timeout:
            self._process.kill()  # SIGKILL: a stopped or stuck process takes no other word
            self._die(f"the engine core sent nothing for {silent:.0f} s with "
                      f"{len(self._streams)} requests and {len(self._calls)} calls waiting "
                      f"(--core-stall-timeout-s {timeout:g}): taken for hung and killed")
            return
        self._loop.call_later(self._stall_check_interval(), self._check_stall)

    def _work_begins(self) -> None:
        """A request or call after a silence with nothing to do: the silence was not a stall."""
        if not self._streams and not self._calls:
            self._heard_at = time.monotonic()

    def _first_message(self) -> tuple:
        while not self._outputs.poll(0.2):
            if not self._process.is_alive():
                return ("failed", f"the core process exited with code {self._process.exitcode}")
        try:
            return self._outputs.recv()
        except EOFError:
            return ("failed", "the core process closed its channel")

    def start_link(self, serving_address: str, instance_id: str) -> None:
        """Starts the core's index link (once the front serves at serving_address)."""
        self._send(("start_link", serving_address, instance_id))

    async def stop(self) -> None:
        """Aborts what is live, tells the core to stop, waits for it to exit. A core that never
        finished starting (a signal during the model load, a port in use) is killed."""
        self._stopping = True
        process = self._process
        if process is None:
            return
        told = self._started and self.dead is None
        if told:
            for request_id in list(self._streams):
                self.abort(request_id)
            self._send(("stop",))
            self._flush()
        if self._started:  # told to stop, or exiting by itself once it said it died
            await asyncio.to_thread(process.join, CORE_STOP_S)
        if process.is_alive():
            if self._started:
                log.warning("the engine core did not %s in %g s: killing it",
                            "stop" if told else "exit after its failure", CORE_STOP_S)
            process.kill()
            await asyncio.to_thread(process.join, 5)
        self._close_channel()

    def _close_channel(self) -> None:
        if self._outputs is None:
            return
        if self._started:
            self._loop.remove_reader(self._outputs.fileno())
            self._loop.remove_reader(self._process.sentinel)
            if self._writing:
                self._loop.remove_writer(self._commands.fileno())
        self._outputs.close()
        self._commands.close()
        self._outputs = self._commands = None

    # ---- requests (the servicer's AsyncEngine interface) --------------------------------------
    @property
    def num_live(self) -> int:
        return len(self._streams)

    def is_live(self, request_id: str) -> bool:
        return request_id in self._streams

    def check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self.dead}")

    @property
    def tokenizer(self):
        return self._tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        # Every request's detokenizers decode through it (each single token's text kept).
        self._token_decoder = None if tokenizer is None else TokenDecoder(tokenizer)

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            prompt: str | None = None, cache_salt: str | None = None,
            priority: int = 0, pin_prefill: bool = False) -> OutputBuffer:
        self.check_alive()
        if request_id in self._streams:
            raise ValueError(f"request_id must be unique among live requests, got {request_id!r}")
        self._work_begins()
        text = None
        if self.tokenizer is not None:
            text = RequestText(self.tokenizer, prompt_token_ids, params,
                               lambda index, stop: self._send(
                                   ("finish_seq", request_id, index, stop)),
                               decoder=self._token_decoder)
        buffer = OutputBuffer(prompt_token_ids, prompt, text, self.stream_interval,
                              self.max_unsent_tokens, lambda: self.abort(request_id))
        self._streams[request_id] = buffer
        self._send(("add", request_id, prompt_token_ids, params, cache_salt, priority,
                    pin_prefill))
        return buffer

    def abort(self, request_id: str) -> bool:
        if request_id not in self._streams:
            return False
        self._send(("abort", request_id))
        return True

    def cut_live(self, error: BaseException) -> int:
        """Ends every live request's stream with `error` and stops the request in the engine
        (the server's drain ran out of time); how many there were."""
        return cut_streams(self._streams, self.abort, error)

    async def call(self, name: str, args: tuple) -> Any:
        self.check_alive()
        call_id = next(self._call_ids)
        self._work_begins()
        future = self._loop.create_future()
        self._calls[call_id] = future
        self._send(("call", call_id, name, args))
        try:
            return await future
        finally:
            self._calls.pop(call_id, None)

    # ---- the channel --------------------------------------------------------------------------
    def _send(self, command: tuple) -> None:
        if not self._outbox:
            self._loop.call_soon(self._flush)
        self._outbox.append(command)

    def _flush(self) -> None:
        """This loop turn's commands, as one message in multiprocessing's framing (what the
        core's Connection.recv reads), written without blocking."""
        if not self._outbox or self._commands is None or self.dead is not None:
            self._outbox = []
            return
        batch, self._outbox = self._outbox, []
        payload = ForkingPickler.dumps(batch)
        self._unsent += struct.pack("!i", len(payload)) + payload
        self._write()

    def _write(self) -> None:
        if self._commands is None:
            return
        try:
            while self._unsent:
                written = os.write(self._commands.fileno(), self._unsent)
                del self._unsent[:written]
        except BlockingIOError:
            pass  # the core is mid-step: the rest goes when the pipe has room
        except OSError as error:
            self._die(f"the engine core's channel broke: {error!r}")
            return
        if self._unsent and not self._writing:
            self._loop.add_writer(self._commands.fileno(), self._write)
            self._writing = True
        elif not self._unsent and self._writing:
            self._loop.remove_writer(self._commands.fileno())
            self._writing = False

    def _readable(self, limit: int = MESSAGES_PER_CALLBACK) -> None:
        """At most `limit` messages, then back to the loop (it calls again while more wait):
        a core outrunning the front must not starve the streams, health and signals."""
        try:
            for _ in range(limit):
                if self._outputs is None or not self._outputs.poll():
                    return
                self._dispatch(self._outputs.recv())
        except (EOFError, ConnectionResetError, OSError):
            self._core_exited()
        except Exception as error:  # noqa: BLE001 - a step's outputs lost: streams would hang
            log.exception("a message from the engine core could not be read")
            self._die(f"a message from the engine core could not be read: {error!r}")

    def _dispatch(self, message: tuple) -> None:
        self._heard_at = time.monotonic()
        kind = message[0]
        if kind == "died":
            self._die(message[1])
            return
        _, outputs, errors, stats, link_view, results, rpc_times = message
        streams = self._streams
        for request_id, error in errors:
            buffer = streams.pop(request_id, None)
            if buffer is not None:
                buffer.put(error)
        finished = False
        for output in outputs:
            row = type(output) is tuple  # a TokenRow (output_wire.py)
            buffer = streams.get(output[0] if row else output.request_id)
            if buffer is None:
                continue
            if row:
                output = unpack_row(output, buffer.arrival_time, buffer.first_token_time)
            buffer.put(output)
            if output.finished:
                finished = True
                del streams[output.request_id]
        self.snapshot = stats
        if link_view is not None and self.link is not None:
            self.link.degraded, self.link.details = link_view
        for call_id, result, error in results:
            future = self._calls.get(call_id)
            if future is not None and not future.done():
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(result)
        if self.on_rpc is not None:
            for method, seconds in rpc_times:
                self.on_rpc(method, seconds)
        if self.on_stats is not None:
            self.on_stats(stats, finished or not streams)

    def _core_exited(self) -> None:
        """The core's channel closed or its process ended: expected once stop() asked."""
        if self._process is None or self.dead is not None or self._outputs is None:
            return
        # What it sent before it went (its last step's outputs, its last word) counts first.
        try:
            while self._outputs is not None and self._outputs.poll():
                self._dispatch(self._outputs.recv())
        except (EOFError, OSError):
            pass
        if self.dead is not None:
            return
        if self._stopping:
            self._close_channel()
            return
        self._process.join(0.5)
        self._die(f"the engine core process exited (code {self._process.exitcode})")

    def _die(self, reason: str) -> None:
        if self.dead is not None:
            return
        log.error("%s", reason)
        self.dead = error = RuntimeError(reason)
        self._close_channel()
        dead = EngineDeadError(f"the engine stopped after an error: {reason}")
        for buffer in self._streams.values():
            buffer.put(dead)
        self._streams.clear()
        for future in self._calls.values():
            if not future.done():
                future.set_exception(IndexUnavailableError(reason))
        if self.on_dead is not None:
            self.on_dead(error)
