"""Background cooling of automatic pins: re-checks each engine's hot blocks every interval."""

from __future__ import annotations

import asyncio
import logging

from redis.exceptions import RedisError

from prefix_index.server.metrics import IndexMetrics
from prefix_index.server.store import IndexStore

log = logging.getLogger("prefix_index.server.sweeper")


async def cool_all(store: IndexStore, metrics: IndexMetrics) -> int:
    cooled = 0
    for engine_id in await store.engine_ids():
        cooled += await store.cool(engine_id)
    metrics.cooled_pins.inc(cooled)
    return cooled


async def run_sweeper(store: IndexStore, metrics: IndexMetrics, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            cooled = await cool_all(store, metrics)
            if cooled:
                log.info("unpinned %d cooled blocks", cooled)
        except (RedisError, OSError, TimeoutError) as exc:
            log.debug("sweep skipped: %s", exc)  # the health probe reports Redis being down
