"""Clients of a prefix index served on the session's certificates (mutual TLS).

The index authorizes by the certificate's role: an engine writes (Register, Heartbeat, Apply),
a router reads (Lookup, Stats, WatchResidency), and one connection has one role. Most index
tests act as an engine and check the index's state with reads, so `EngineAndReader` writes on an
engine channel and reads on a second, router channel, with PrefixIndexClient's interface.
"""

from __future__ import annotations

from prefix_index.api.client import PrefixIndexClient
from prefix_index.api.ops import EngineMatch, EngineStats
from trust.credentials import TlsMaterial


class EngineAndReader(PrefixIndexClient):
    """Writes as an engine (`engine_tls`), reads as a router (`reader_tls`) on its own
    channel; stats() of no id is still this client's engine's."""

    def __init__(self, target: str, timeout_s: float, engine_tls: TlsMaterial,
                 reader_tls: TlsMaterial) -> None:
        super().__init__(target, timeout_s, engine_tls)
        self.reader = PrefixIndexClient(target, timeout_s, reader_tls)

    async def lookup(self, chain, model_identity: str = "") -> list[EngineMatch]:
        return await self.reader.lookup(chain, model_identity)

    async def stats(self, engine_id: str | None = None) -> list[EngineStats]:
        return await self.reader.stats(self.engine_id if engine_id is None else engine_id)

    def watch_residency(self):
        return self.reader.watch_residency()

    async def close(self) -> None:
        await self.reader.close()
        await super().close()

