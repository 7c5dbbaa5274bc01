"""What each tenant holds at this front door: live requests, and blocks pinned through
PinPrefix (with the pin's expiry, so a lapsed pin stops counting). One ledger per process,
touched on the event loop only."""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass


@dataclass(slots=True)
class Pin:
    num_blocks: int
    expires_at: float | None  # monotonic; None: until unpinned


class TenantLedger:
    def __init__(self) -> None:
        self.live_requests: dict[str, int] = defaultdict(int)
        self._pins: dict[str, dict[bytes, Pin]] = defaultdict(dict)

    # ---- live requests ----------------------------------------------------------------------
    def enter(self, tenant: str, limit: int | None) -> bool:
        """Counts one more live request of `tenant`; False (nothing counted) at its limit."""
        if limit is not None and self.live_requests[tenant] >= limit:
            return False
        self.live_requests[tenant] += 1
        return True

    def leave(self, tenant: str) -> None:
        left = self.live_requests[tenant] - 1
        if left > 0:
            self.live_requests[tenant] = left
        else:
            del self.live_requests[tenant]

    # ---- pins -------------------------------------------------------------------------------
    def pinned_blocks(self, tenant: str) -> int:
        pins = self._pins.get(tenant)
        if not pins:
            return 0
        now = time.monotonic()
        for key in [k for k, p in pins.items() if p.expires_at is not None and p.expires_at <= now]:
            del pins[key]
        return sum(p.num_blocks for p in pins.values())

    def would_hold(self, tenant: str, prefix: bytes, num_blocks: int) -> int:
        """The blocks `tenant` would hold pinned with `prefix` (its chain's last hash) pinned
        too (a prefix pinned again counts once)."""
        held = self.pinned_blocks(tenant)
        old = self._pins.get(tenant, {}).get(prefix)
        return held - (old.num_blocks if old is not None else 0) + num_blocks

    def pin(self, tenant: str, prefix: bytes, num_blocks: int, ttl_s: float) -> None:
        expires_at = time.monotonic() + ttl_s if ttl_s > 0 else None
        self._pins[tenant][prefix] = Pin(num_blocks, expires_at)

    def restore(self, tenant: str, prefix: bytes, pin: Pin) -> None:
        """Puts back a pin unpin() returned (a reservation that was not kept)."""
        self._pins[tenant][prefix] = pin

    def unpin(self, tenant: str, prefix: bytes) -> Pin | None:
        pins = self._pins.get(tenant)
        return None if pins is None else pins.pop(prefix, None)
