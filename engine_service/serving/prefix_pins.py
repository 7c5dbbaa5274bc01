"""PinPrefix's work, apart from the servicer's checks: the prefix computed when it is not
cached yet (the paper's reserved blocks for a known shared prefix: the first request no longer
pays its prefill), then pinned at the prefix index or, without one, by the engine's own policy
(engine_service/serving/local_pins.py)."""

from __future__ import annotations

import secrets
from typing import Protocol

from engine_service.model.sampling_params import SamplingParams
from engine_service.serving.async_engine import AsyncEngine
from engine_service.serving.core_client import CoreClient
from engine_service.serving.local_pins import check_pin_room, pin_locally


class IndexPins(Protocol):
    async def pin_prefix(self, chain: list[bytes], ttl_s: float, unpin: bool) -> int: ...


class PrefixPinner:
    def __init__(self, engine: AsyncEngine | CoreClient, index_link: IndexPins | None) -> None:
        self.engine = engine
        self.index_link = index_link

    async def check_room(self, chain: list[bytes]) -> None:
        """PinRefusedError now for a pin that would be refused after its prefill."""
        if isinstance(self.engine, CoreClient):
            await self.engine.call("pin_check", (chain,))
        else:
            await self.engine.call(lambda engine: check_pin_room(engine, chain))

    async def compute(self, token_ids: list[int], cache_salt: str | None) -> None:
        """A prefill-only request (one token sampled and dropped) on the prefix: its full
        blocks are computed and cached when this returns, and reach the index before the pin
        that follows (the link sends the step's commits first). A cached prefix costs the
        forward of its last token. Errors as the engine raises them (or puts in the stream)."""
        request_id = f"pin-prefill-{secrets.token_hex(8)}"
        outputs = self.engine.add(request_id, token_ids, SamplingParams(temperature=0.0,
                                                                        max_tokens=1),
                                  cache_salt=cache_salt, pin_prefill=True)
        finished = False
        try:
            while not finished:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
        finally:
            if not finished:  # cancelled (the client left): free its blocks now
                self.engine.abort(request_id)

    async def pin(self, chain: list[bytes], ttl_s: float, unpin: bool) -> int:
        if self.index_link is not None:
            return await self.index_link.pin_prefix(chain, ttl_s, unpin)
        if isinstance(self.engine, CoreClient):  # the core pins locally when it has no link
            return await self.engine.call("pin_prefix", (chain, ttl_s, unpin))
        return await self.engine.call(lambda engine: pin_locally(engine, chain, ttl_s, unpin))
