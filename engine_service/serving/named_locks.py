"""One asyncio lock per name, kept only while some caller holds or waits for it (the map does
not grow with every name ever used). The event loop's thread is its only user."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Hashable


class NamedLocks:
    def __init__(self) -> None:
        self._locks: dict[Hashable, asyncio.Lock] = {}
        self._users: dict[Hashable, int] = {}  # holding or waiting, per name

    @contextlib.asynccontextmanager
    async def hold(self, name: Hashable) -> AsyncIterator[None]:
        lock = self._locks.setdefault(name, asyncio.Lock())
        self._users[name] = self._users.get(name, 0) + 1
        try:
            async with lock:
                yield
        finally:
            self._users[name] -= 1
            if not self._users[name]:
                del self._users[name]
                del self._locks[name]

    def __len__(self) -> int:
        return len(self._locks)
