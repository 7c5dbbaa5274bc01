"""Requests with structured outputs wait here while their grammar compiles, so the engine keeps
stepping the others (a JSON Schema's compilation takes milliseconds to seconds). A thread of
the queue's hands each constraint in turn to the compiler process (serving/grammar_process.py)
and waits for it. The core loop admits each request when its grammar is ready
(serving/core_process.py); the queue is the loop's alone."""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine_service.core.outputs import CompletionOutput, RequestOutput
from engine_service.model.sampling_params import SamplingParams


@dataclass(slots=True)
class Compiling:
    command: tuple  # the core's ("add", ...) command, admitted as it came once compiled
    future: concurrent.futures.Future
    arrival_time: float


class CompileAbandoned(Exception):
    """Every request waiting for this constraint left before its compilation started."""


class GrammarQueue:
    """The core loop calls every method; the compilations run on the queue's one thread."""

    def __init__(self, compile_grammar: Callable, wake: Callable[[], None],
                 interrupt: Callable[[], bool] | None = None) -> None:
        self._compile = compile_grammar  # compile_grammar(spec)
        self._wake = wake
        self._interrupt = interrupt  # stops the compilation under way, if any
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._waiting: dict[str, Compiling] = {}
        # Shared with the compile thread, under _lock: how many waiting requests want each
        # constraint, and which one compiles now. A compilation is stopped once the last
        # request wanting it leaves, whichever of them its job was queued for.
        self._lock = threading.Lock()
        self._wanted: collections.Counter[tuple] = collections.Counter()
        self._compiling: tuple | None = None

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waiting

    def __len__(self) -> int:
        return len(self._waiting)

    def submit(self, request_id: str, command: tuple, params: SamplingParams) -> None:
        if self._executor is None:  # made on the first constrained request
            self._executor = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="grammar")
        spec = params.structured_outputs
        with self._lock:
            self._wanted[spec.key] += 1
        future = self._executor.submit(self._job, spec)
        future.add_done_callback(lambda _f: self._wake())
        self._waiting[request_id] = Compiling(command, future, time.monotonic())

    def _job(self, spec):
        """On the compile thread: the grammar, unless nobody waits for it any more."""
        with self._lock:
            if not self._wanted[spec.key]:
                raise CompileAbandoned()
            self._compiling = spec.key
        try:
            return self._compile(spec)
        finally:
            with self._lock:
                self._compiling = None

    def ready(self) -> list[Compiling]:
        """The requests whose compilation ended (with a grammar or an error), oldest first."""
        done = [rid for rid, item in self._waiting.items() if item.future.done()]
        items = [self._waiting.pop(rid) for rid in done]
        for item in items:
            self._leave(item, interrupt=False)
        return items

    def abort(self, request_id: str) -> RequestOutput | None:
        """Drops a waiting request; its final output (every sequence aborted), or None when it
        is not waiting here. A compilation not started yet is dropped; one running is stopped
        once no other waiting request wants the same constraint."""
        item = self._waiting.pop(request_id, None)
        if item is None:
            return None
        item.future.cancel()
        self._leave(item, interrupt=True)
        params: SamplingParams = item.command[3]
        return RequestOutput(
            request_id=request_id, prompt=None, prompt_token_ids=item.command[2],
            outputs=[CompletionOutput(index=i, text="", token_ids=[], finish_reason="abort")
                     for i in range(params.n)],
            finished=True, arrival_time=item.arrival_time, finished_time=time.monotonic())

    def _leave(self, item: Compiling, interrupt: bool) -> None:
        key = item.command[3].structured_outputs.key
        with self._lock:
            self._wanted[key] -= 1
            if self._wanted[key]:
                return
            del self._wanted[key]
            # Under the lock: the compilation under way is this constraint's, not the next
            # one's (a job sets _compiling under it). At worst it has just ended: the idle
            # compiler is stopped and started again on need.
            if interrupt and self._compiling == key and self._interrupt is not None:
                self._interrupt()

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(item.command[2]) for item in self._waiting.values())

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
