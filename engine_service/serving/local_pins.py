"""PinPrefix on an engine without the prefix index: pins held by the engine's own LRU policy
(engine_service/core/prefix_policy.py), under its local budget. Runs on the engine's thread
(the core process's step loop, or the in-process engine's), which owns the pool."""

from __future__ import annotations

from engine_service.core.engine import LLMEngine
from engine_service.core.prefix_policy import PinBudgetFull
from engine_service.index.link import PinRefusedError


def pin_locally(engine: LLMEngine, chain: list[bytes], ttl_s: float, unpin: bool) -> int:
    """Blocks of `chain` pinned (or unpinned); PinRefusedError as the index would refuse."""
    pin = getattr(engine.pool.policy, "pin", None)
    if pin is None:
        raise PinRefusedError("invalid", "this engine's prefix policy takes no local pins")
    try:
        return pin(chain, ttl_s, unpin)
    except PinBudgetFull as error:
        raise PinRefusedError("budget", str(error)) from None
