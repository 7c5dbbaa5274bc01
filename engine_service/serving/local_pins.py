"""PinPrefix on an engine without the prefix index: pins held by the engine's own LRU policy
(engine_service/core/prefix_policy.py), under its local budget. Runs on the engine's thread
(the core process's step loop, or the in-process engine's), which owns the pool."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine_service.core.prefix_policy import PinBudgetFull
from engine_service.index.link import PinRefusedError

if TYPE_CHECKING:  # the front imports no torch: the engine is the core's
    from engine_service.core.engine import LLMEngine


def check_pin_room(engine: LLMEngine, chain: list[bytes]) -> None:
    """Before a prefix is computed to be pinned: what the pin would refuse after, refused now
    (an engine that caches no prefixes; past the local budget, counting every block of the
    chain not pinned yet), so a refused pin costs no prefill."""
    if not engine.kv.enable_prefix_caching:
        raise PinRefusedError("off", "PinPrefix needs the prefix cache, and this engine runs "
                                     "without it (--no-prefix-caching)")
    check = getattr(engine.pool.policy, "check_pin", None)
    if check is None:  # pins at the index: its budget is decided there
        return
    try:
        check(chain)
    except PinBudgetFull as error:
        raise PinRefusedError("budget", str(error)) from None


def pin_locally(engine: LLMEngine, chain: list[bytes], ttl_s: float, unpin: bool) -> int:
    """Blocks of `chain` pinned (or unpinned); PinRefusedError as the index would refuse."""
    pin = getattr(engine.pool.policy, "pin", None)
    if pin is None:
        raise PinRefusedError("invalid", "this engine's prefix policy takes no local pins")
    try:
        return pin(chain, ttl_s, unpin, engine.pool.is_cached)
    except PinBudgetFull as error:
        raise PinRefusedError("budget", str(error)) from None
