"""A thread with a tokenizer of its own for the text work a client decides the size of
(Detokenize, Tokenize): however long it takes, the event loop meanwhile serves every other
stream, health check and signal. HF fast tokenizers must not be used from two threads at once,
hence the worker's own copy (the loop's stays the servicer's, for the generation path)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from engine_service.serving.validation import RequestValidator

T = TypeVar("T")


class TextWorker:
    def __init__(self, validator: RequestValidator) -> None:
        self.validator = validator  # its tokenizer is used on the worker's thread alone
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine-text")

    async def run(self, work: Callable[..., T], *args) -> T:
        """`work(self.validator, *args)` on the worker's thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, work, self.validator, *args)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
