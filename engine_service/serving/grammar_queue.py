"""Requests with structured outputs wait here while their grammar compiles, so the engine keeps
stepping the others (a JSON Schema's compilation takes milliseconds to seconds). A thread of
the queue's hands each constraint in turn to the compiler process (serving/grammar_process.py)
and waits for it. The core loop admits each request when its grammar is ready
(serving/core_process.py); the queue is the loop's alone."""

from __future__ import annotations

import concurrent.futures
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


class GrammarQueue:
    def __init__(self, compile_grammar: Callable, wake: Callable[[], None],
                 interrupt: Callable[[str], bool] | None = None) -> None:
        self._compile = compile_grammar
        self._wake = wake
        # compile_grammar(spec, request_id); interrupt(request_id) stops that compilation
        # if it is under way.
        self._interrupt = interrupt
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._waiting: dict[str, Compiling] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._waiting

    def __len__(self) -> int:
        return len(self._waiting)

    def submit(self, request_id: str, command: tuple, params: SamplingParams) -> None:
        if self._executor is None:  # made on the first constrained request
            self._executor = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="grammar")
        future = self._executor.submit(self._compile, params.structured_outputs, request_id)
        future.add_done_callback(lambda _f: self._wake())
        self._waiting[request_id] = Compiling(command, future, time.monotonic())

    def ready(self) -> list[Compiling]:
        """The requests whose compilation ended (with a grammar or an error), oldest first."""
        done = [rid for rid, item in self._waiting.items() if item.future.done()]
        return [self._waiting.pop(rid) for rid in done]

    def abort(self, request_id: str) -> RequestOutput | None:
        """Drops a waiting request; its final output (every sequence aborted), or None when it
        is not waiting here. A compilation not started yet is dropped; one running is stopped,
        unless another request waits for the same grammar."""
        item = self._waiting.pop(request_id, None)
        if item is None:
            return None
        if not item.future.cancel() and self._interrupt is not None \
                and not self._wanted(item.command[3]):
            self._interrupt(request_id)  # only if that compilation is still under way
        params: SamplingParams = item.command[3]
        return RequestOutput(
            request_id=request_id, prompt=None, prompt_token_ids=item.command[2],
            outputs=[CompletionOutput(index=i, text="", token_ids=[], finish_reason="abort")
                     for i in range(params.n)],
            finished=True, arrival_time=item.arrival_time, finished_time=time.monotonic())

    def _wanted(self, params: SamplingParams) -> bool:
        key = params.structured_outputs.key
        return any(other.command[3].structured_outputs.key == key
                   for other in self._waiting.values())

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(item.command[2]) for item in self._waiting.values())

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
