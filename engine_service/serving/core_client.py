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
from collections.abc import Callable
from typing import Any

from engine_service.core.engine import EngineStats
from engine_service.core.errors import EngineDeadError
from engine_service.core.outputs import CompletionOutput, RequestOutput
from engine_service.index.link import IndexUnavailableError
from engine_service.model.sampling_params import SamplingParams
from engine_service.serving.core_process import CoreOptions, CoreTarget, run_core
from engine_service.serving.engine_info import EngineInfo
from engine_service.serving.output_text import RequestText

log = logging.getLogger("engine_service.serving.core_client")

_DELTA_FIELDS = tuple(n for n in CompletionOutput.__slots__ if n.endswith("_delta"))
_WHOLE_FIELDS = tuple(n for n in CompletionOutput.__slots__ if not n.endswith("_delta"))


def merge_outputs(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """One output saying what `older` and then `newer` said: deltas joined, the rest newer's."""
    by_index = {c.index: c for c in older.outputs}
    for completion in newer.outputs:
        kept = by_index.get(completion.index)
        if kept is None:
            by_index[completion.index] = completion
            continue
        for name in _DELTA_FIELDS:
            before, after = getattr(kept, name), getattr(completion, name)
            if before is None or after is None:
                setattr(kept, name, after if before is None else before)
            else:
                setattr(kept, name, before + after)
        for name in _WHOLE_FIELDS:
            setattr(kept, name, getattr(completion, name))
    newer.outputs = sorted(by_index.values(), key=lambda c: c.index)
    newer.first_token_time = older.first_token_time or newer.first_token_time
    return newer


class OutputBuffer:
    """A request's outputs on their way to its stream: at most one pending item, merged."""

    __slots__ = ("_pending", "_ready", "prompt_token_ids", "prompt", "text")

    def __init__(self, prompt_token_ids: list[int], prompt: str | None,
                 text: RequestText | None) -> None:
        self._pending: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()
        self.prompt_token_ids = prompt_token_ids
        self.prompt = prompt
        self.text = text  # makes the text of each output, in order (None: ids only)

    def put(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, RequestOutput):
            item.prompt_token_ids, item.prompt = self.prompt_token_ids, self.prompt
            if self.text is not None:
                self.text.apply(item)
            if isinstance(self._pending, RequestOutput):
                item = merge_outputs(self._pending, item)
            elif isinstance(self._pending, BaseException):
                return  # an error ends the stream; nothing after it counts
        self._pending = item
        self._ready.set()

    async def get(self) -> RequestOutput | BaseException:
        await self._ready.wait()
        item, self._pending = self._pending, None
        self._ready.clear()
        return item


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
        self.snapshot: EngineStats | None = None
        self.link = CoreLinkView(self) if options.prefix_index else None
        self.dead: BaseException | None = None
        self._streams: dict[str, OutputBuffer] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count(1)
        self._outbox: list[tuple] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._process = None
        self._conn = None
        self._stopping = False

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> EngineInfo:
        """Starts the core process and waits until its engine is built (model load, memory
        profiling, warm-up): ValueError with the core's message when it cannot start."""
        self._loop = asyncio.get_running_loop()
        context = multiprocessing.get_context("spawn")  # no fork of a process with threads
        self._conn, child_end = context.Pipe(duplex=True)
        self._process = context.Process(target=self._core_target, args=(child_end, self.options),
                                        name="pagedgen-engine-core", daemon=True)
        self._process.start()
        child_end.close()
        first = await asyncio.to_thread(self._first_message)
        if first[0] != "ready":
            await asyncio.to_thread(self._process.join, 10)
            raise ValueError(f"the engine core could not start: {first[1]}")
        self.info = first[1]
        self._loop.add_reader(self._conn.fileno(), self._readable)
        self._loop.add_reader(self._process.sentinel, self._core_exited)
        return self.info

    def _first_message(self) -> tuple:
        while not self._conn.poll(0.2):
            if not self._process.is_alive():
                return ("failed", f"the core process exited with code {self._process.exitcode}")
        try:
            return self._conn.recv()
        except EOFError:
            return ("failed", "the core process closed its channel")

    def start_link(self, serving_address: str, instance_id: str) -> None:
        """Starts the core's index link (once the front serves at serving_address)."""
        self._send(("start_link", serving_address, instance_id))

    async def stop(self) -> None:
        """Aborts what is live, tells the core to stop, waits for it to exit."""
        for request_id in list(self._streams):
            self.abort(request_id)
        self._stopping = True
        if self.dead is None:
            self._send(("stop",))
            self._flush()
        process = self._process
        if process is None:
            return
        await asyncio.to_thread(process.join, 30)
        if process.is_alive():
            log.warning("the engine core did not stop in 30 s: killing it")
            process.kill()
            await asyncio.to_thread(process.join, 5)
        self._close_channel()

    def _close_channel(self) -> None:
        if self._conn is not None and self._loop is not None:
            self._loop.remove_reader(self._conn.fileno())
            self._loop.remove_reader(self._process.sentinel)
            self._conn.close()
            self._conn = None

    # ---- requests (the servicer's AsyncEngine interface) --------------------------------------
    @property
    def num_live(self) -> int:
        return len(self._streams)

    def is_live(self, request_id: str) -> bool:
        return request_id in self._streams

    def check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self.dead}")

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
            prompt: str | None = None, cache_salt: str | None = None,
            priority: int = 0) -> OutputBuffer:
        self.check_alive()
        if request_id in self._streams:
            raise ValueError(f"request_id must be unique among live requests, got {request_id!r}")
        text = None
        if self.tokenizer is not None:
            text = RequestText(self.tokenizer, prompt_token_ids, params,
                               lambda index, stop: self._send(
                                   ("finish_seq", request_id, index, stop)))
        buffer = OutputBuffer(prompt_token_ids, prompt, text)
        self._streams[request_id] = buffer
        self._send(("add", request_id, prompt_token_ids, params, cache_salt, priority))
        return buffer

    def abort(self, request_id: str) -> bool:
        if request_id not in self._streams:
            return False
        self._send(("abort", request_id))
        return True

    async def call(self, name: str, args: tuple) -> Any:
        self.check_alive()
        call_id = next(self._call_ids)
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
        if not self._outbox or self._conn is None or self.dead is not None:
            self._outbox = []
            return
        batch, self._outbox = self._outbox, []
        try:
            self._conn.send(batch)
        except (BrokenPipeError, ConnectionResetError, OSError) as error:
            self._die(f"the engine core's channel broke: {error!r}")

    def _readable(self) -> None:
        try:
            while self._conn is not None and self._conn.poll():
                message = self._conn.recv()
                self._dispatch(message)
        except (EOFError, ConnectionResetError, OSError):
            self._core_exited()
        except Exception as error:  # noqa: BLE001 - a step's outputs lost: streams would hang
            log.exception("a message from the engine core could not be read")
            self._die(f"a message from the engine core could not be read: {error!r}")

    def _dispatch(self, message: tuple) -> None:
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
            buffer = streams.get(output.request_id)
            if buffer is None:
                continue
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
        if self._process is None or self.dead is not None:
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
