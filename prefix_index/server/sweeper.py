"""Background sweep of every engine: cools automatic pins, drops expired explicit pins and
decayed hit history, and prunes engines whose lease ran out from the directory."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from redis.exceptions import RedisError

from prefix_index.server.metrics import IndexMetrics
from prefix_index.server.store import IndexStore

log = logging.getLogger("prefix_index.server.sweeper")


@dataclass(frozen=True, slots=True)
class SweepResult:
    cooled_pins: int
    pruned_engines: int


async def sweep_all(store: IndexStore, metrics: IndexMetrics) -> SweepResult:
    cooled = pruned = 0
    for engine_id in await store.engine_ids():
        unpinned = await store.sweep(engine_id)
        if unpinned is None:
            pruned += 1
        else:
            cooled += unpinned
    metrics.cooled_pins.inc(cooled)
    metrics.pruned_engines.inc(pruned)
    return SweepResult(cooled, pruned)


async def run_sweeper(store: IndexStore, metrics: IndexMetrics, interval_s: float) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            result = await sweep_all(store, metrics)
            if result.cooled_pins or result.pruned_engines:
                log.info("unpinned %d cooled blocks, pruned %d gone engines",
                         result.cooled_pins, result.pruned_engines)
        except (RedisError, OSError, TimeoutError) as exc:
            log.debug("sweep skipped: %s", exc)  # the health probe reports Redis being down
