"""A thread with a tokenizer of its own for the text work a client decides the size of
(Detokenize, Tokenize, a generation's long prompt): however long it takes, the event loop
meanwhile serves every other stream, health check and signal. HF fast tokenizers must not be
used from two threads at once, hence the worker's own copy (the loop's stays the servicer's,
for the generation path's short prompts)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import grpc

from engine_service.serving.status import RequestRejected
from engine_service.serving.validation import RequestValidator

T = TypeVar("T")
# Tokenize and Detokenize calls on the worker, waiting or running, at most: each holds its
# request, up to a context's worth of text, while it waits, and a flood of them (1,000 calls of
# 130,000 characters: +370 MB, 50 s) made every other caller's wait as long, the HTTP chat
# calls that count their prompt first included. Past it a call is refused at once, to be
# retried. (Generations' long prompts are not counted here: the queue limit bounds those.)
MAX_WAITING = 64


class TextWorker:
    def __init__(self, validator: RequestValidator, max_waiting: int = MAX_WAITING) -> None:
        self.validator = validator  # its tokenizer is used on the worker's thread alone
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine-text")
        self.max_waiting = max_waiting
        self.num_waiting = 0  # bounded calls in run(), waiting or running (the loop's thread)

    async def run(self, work: Callable[..., T], *args, bounded: bool = True) -> T:
        """`work(self.validator, *args)` on the worker's thread; `bounded`: RequestRejected
        (RESOURCE_EXHAUSTED) when max_waiting such calls are on it already."""
        if not bounded:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._executor, work, self.validator, *args)
        if self.num_waiting >= self.max_waiting:
            raise RequestRejected(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"Tokenize and Detokenize calls waiting on this engine must be at most "
                f"{self.max_waiting}, got {self.num_waiting + 1}: retry later")
        self.num_waiting += 1
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._executor, work, self.validator, *args)
        finally:
            self.num_waiting -= 1

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
