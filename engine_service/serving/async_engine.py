"""The engine's asyncio front: one thread owns the LLMEngine and steps it.

LLMEngine has one writer, the engine thread. Callers on the event loop (adds, aborts, calls) and
other threads (the prefix-index link) send commands through the engine's command queue
(`LLMEngine.post`); the engine thread runs them between two steps. Each request's outputs come
back in its own OutputBuffer (core_client.py: merged while its stream is busy, bounded when
nobody reads it), fed with loop.call_soon_threadsafe. The thread sleeps on an Event
when there is nothing to do, so an idle server costs no CPU. An abort takes effect between two
steps, i.e. within one forward, and frees the request's blocks there and then.

If the engine thread dies, every live stream gets EngineDeadError, every later call is refused
with it, and `on_dead` runs (the server turns NOT_SERVING and the process exits non-zero).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from engine_service.core.errors import EngineDeadError, RequestError
from engine_service.core.outputs import RequestOutput
from engine_service.core.stats import EngineStats
from engine_service.model.sampling_params import SamplingParams
from engine_service.serving.core_client import (
    DEFAULT_MAX_UNSENT_TOKENS,
    OutputBuffer,
    cut_streams,
)
from engine_service.serving.engine_info import EngineInfo

if TYPE_CHECKING:  # the front imports no torch: the engine is the core's
    from engine_service.core.engine import LLMEngine

log = logging.getLogger(__name__)
T = TypeVar("T")
IDLE_PIN_LAPSE_S = 0.1  # an idle engine holding pins looks for lapsed ones this often

__all__ = ["AsyncEngine", "EngineDeadError"]


class AsyncEngine:
    """Owns the engine thread. `add`/`abort`/`call` are for the event loop's thread only."""

    def __init__(
        self,
        engine: LLMEngine,
        on_step: Callable[[LLMEngine, list[RequestOutput]], None] | None = None,
        own_thread: bool = True,
        on_dead: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.engine = engine
        self._on_step = on_step
        self._on_dead = on_dead
        # own_thread=False: the owner steps the engine by calling run() on its own thread.
        # pagedgen-engine does that on the main thread, where torch's CPU kernels measured
        # 25 ms per batch-1 step against 37 ms on a second thread.
        self._own_thread = own_thread
        self._finished = threading.Event()
        self._wake = threading.Event()
        engine.wake = self._wake.set
        self._stopping = False
        # request id -> its outputs on their way; only touched on the loop thread.
        self._streams: dict[str, OutputBuffer] = {}
        self.max_unsent_tokens = DEFAULT_MAX_UNSENT_TOKENS  # OutputBuffer's bound
        self._calls: set[asyncio.Future] = set()  # awaiting a result from the engine thread
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.dead: BaseException | None = None
        self._info: EngineInfo | None = None

    # ---- event loop side ----------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if self._own_thread:
            self._thread = threading.Thread(target=self.run, name="engine-step", daemon=True)
            self._thread.start()

    async def stop(self) -> None:
        """Aborts whatever is live, then ends the thread."""
        for request_id in list(self._streams):
            self.abort(request_id)
        self._stopping = True
        self._wake.set()
        await asyncio.to_thread(self._finished.wait)
        self._thread = None

    @property
    def info(self) -> EngineInfo:
        """The engine's fixed facts (ModelInfo, request checks), as the core process gives them."""
        if self._info is None:
            self._info = EngineInfo.of(self.engine)
        return self._info

    @property
    def snapshot(self) -> EngineStats:
        return self.engine.snapshot  # published by the engine thread each step

    @property
    def num_live(self) -> int:
        return len(self._streams)

    def is_live(self, request_id: str) -> bool:
        return request_id in self._streams

    def check_alive(self) -> None:
        """Raise EngineDeadError once the engine thread has died."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self.dead!r}")

    def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
        pin_prefill: bool = False,
    ) -> OutputBuffer:
        """Submits a validated request; its RequestOutputs (the last one `finished`), or an
        exception, arrive on the returned buffer. The caller checked the id is not live."""
        self.check_alive()
        if request_id in self._streams:
            raise ValueError(f"request_id must be unique among live requests, got {request_id!r}")
        # Merged while the stream is busy sending, and bounded for a stream nobody reads (the
        # request is stopped), as in the core process's front (core_client.py).
        outputs = OutputBuffer(prompt_token_ids, prompt, None,
                               max_unsent_tokens=self.max_unsent_tokens,
                               on_overflow=lambda: self.abort(request_id))
        self._streams[request_id] = outputs

        def add(engine: LLMEngine) -> None:
            try:
                engine.add_request(request_id, prompt_token_ids, params, prompt=prompt,
                                   cache_salt=cache_salt, priority=priority,
                                   pin_prefill=pin_prefill)
            except RequestError as error:
                self._post(self._deliver, request_id, error)

        self.engine.post(add)
        return outputs

    def abort(self, request_id: str) -> bool:
        """Stops a live request at the next step boundary (its blocks are freed there); its
        final output (finish reason "abort") still arrives on its queue."""
        if request_id not in self._streams:
            return False

        def abort(engine: LLMEngine) -> None:
            output = engine.abort_request(request_id)
            if output is not None:
                self._post(self._deliver, request_id, output)

        self.engine.post(abort)
        return True

    def cut_live(self, error: BaseException) -> int:
        """Ends every live request's stream with `error` and stops the request in the engine
        (the server's drain ran out of time); how many there were."""
        return cut_streams(self._streams, self.abort, error)

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Runs fn(engine) on the engine thread between two steps (a consistent view)."""
        self.check_alive()
        future = asyncio.get_running_loop().create_future()
        self._calls.add(future)

        def call(engine: LLMEngine) -> None:
            try:
                result, error = fn(engine), None
            except Exception as exc:  # noqa: BLE001 - handed to the awaiting caller
                result, error = None, exc
            self._post(self._resolve, future, result, error)

        self.engine.post(call)
        try:
            return await future
        finally:
            self._calls.discard(future)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        outputs = self._streams.get(request_id)
        if outputs is None:
            return
        outputs.put_nowait(item)
        if isinstance(item, BaseException) or item.finished:
            del self._streams[request_id]

    @staticmethod
    def _resolve(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    # ---- engine thread --------------------------------------------------------------------
    def _post(self, fn: Callable[..., None], *args: object) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def run(self) -> None:
        """The step loop; returns when stop() is called or the engine fails."""
        try:
            self._run()
        finally:
            self._finished.set()

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping:
                engine.run_commands()
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    # Before the outputs go out: a client that has its last token and then
                    # reads the metrics must find them as they are after this step (the idle
                    # refresh came after the delivery, and a scrape could land between).
                    if self._on_step is not None:
                        self._on_step(engine, outputs)
                    for output in outputs:
                        self._post(self._deliver, output.request_id, output)
                else:
                    if self._on_step is not None:
                        self._on_step(engine, [])
                    # While pins are held, awake now and then: run_commands lapses those
                    # whose TTL ran out (no step does, idle), as the core process's loop does.
                    self._wake.wait(IDLE_PIN_LAPSE_S if engine.pool.policy.num_pinned else None)
                    self._wake.clear()
            engine.run_commands()  # the aborts stop() sent
        except BaseException as error:  # noqa: BLE001 - every waiter must hear about it
            log.exception("engine thread failed")
            self.dead = error
            self._post(self._fail_all, error)
            if self._on_dead is not None:
                self._on_dead(error)

    def _fail_all(self, error: BaseException) -> None:
        dead = EngineDeadError(f"the engine stopped after an error: {error!r}")
        for request_id in list(self._streams):
            self._deliver(request_id, dead)
        for future in list(self._calls):
            self._resolve(future, None, dead)
