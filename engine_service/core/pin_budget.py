"""The pin budget: how many blocks pins may hold (issue 34), decided here and only here.

A pin holds a cached block out of eviction, so every pinned block is one the running requests
cannot grow into. The budget is what the pool can spare beside them:

    budget = clamp(num_blocks - peak demand, floor, ceiling)

where the demand is the blocks the running (and swapped-out) requests hold at their peak, each
at its max_tokens (LLMEngine.blocks_for_request: what it holds plus what it will still need to
finish) less the blocks of it that pins hold already (request_demand: a pinned prefix the
request reads is counted once, as pins, not again as demand), and the peak is the largest
demand of the last `window_s` seconds: a burst shrinks the budget at once, and it grows back
only once the burst is that old, so it does not flap with every admission and finish. The
floor is the fixed budget pins had before (10% of the pool: a prefix pinned under it stays
pinnable whatever the load); the ceiling keeps a quiet engine from pinning most of its pool on
the strength of one hot prefix.

Both policies follow it: the local LRU's pins (engine without the index) and, through
SetPinBudgetOp, the index's automatic pins and its check of explicit ones. Others are told of a
change of at least `hysteresis_fraction` of the pool (at least one block), or one that reaches
the floor or the ceiling, so the index is not written on every small move.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PinBudgetConfig:
    floor_fraction: float = 0.1  # of the pool, always allowed: the fixed budget of before
    ceiling_fraction: float = 0.5  # of the pool, never passed
    window_s: float = 30.0  # how long a peak of demand holds the budget down
    hysteresis_fraction: float = 0.02  # of the pool: smaller moves are not reported

    def __post_init__(self) -> None:
        for name in ("floor_fraction", "ceiling_fraction", "hysteresis_fraction"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) \
                    or not 0 <= value <= 1:
                raise ValueError(f"pin budget {name} must be a number in [0, 1], got {value!r}")
        if self.floor_fraction > self.ceiling_fraction:
            raise ValueError(f"pin budget floor_fraction ({self.floor_fraction}) must not be "
                             f"above ceiling_fraction ({self.ceiling_fraction})")
        w = self.window_s
        if isinstance(w, bool) or not isinstance(w, int | float) or not math.isfinite(w) \
                or w < 0:
            raise ValueError(f"pin budget window_s must be a finite number of seconds >= 0, "
                             f"got {w!r}")

    @classmethod
    def fixed(cls, fraction: float) -> PinBudgetConfig:
        """A budget that never moves (floor = ceiling): what pins had before issue 34."""
        return cls(floor_fraction=fraction, ceiling_fraction=fraction)


def request_demand(peak_blocks: int, table_hashes: Iterable[bytes | None],
                   is_pinned: Callable[[bytes], bool]) -> int:
    """One running request's demand on the pool beside the pins: its peak in blocks less the
    pinned blocks it reads. `table_hashes`: the hashes of its device blocks in order (None for
    a block not cached); pins cover prefixes, so its pinned blocks lead its table and the count
    stops at the first block no pin holds (O(pinned prefix), not O(table)). Counted as demand
    too, those blocks would be counted twice: a request on a pinned prefix would take the
    budget below the very prefix it reads, and the window would hold it there."""
    pinned = 0
    for block_hash in table_hashes:
        if block_hash is None or not is_pinned(block_hash):
            break
        pinned += 1
    return max(0, peak_blocks - pinned)


def _blocks(fraction: float, num_blocks: int) -> int:
    # The epsilon keeps 0.29 * 100 at 29, not 28.999... -> 28 (as the index's budget does).
    return int(math.floor(fraction * num_blocks + 1e-9))


class PinBudget:
    """The budget of one pool. `observe` each time the demand may have changed (an admission,
    a finish, a preemption) and now and then (a peak ages out with time alone); `report` says
    when the change is worth telling the policy."""

    def __init__(self, num_blocks: int, config: PinBudgetConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
        self.config = config or PinBudgetConfig()
        self.num_blocks = num_blocks
        self.floor = _blocks(self.config.floor_fraction, num_blocks)
        self.ceiling = _blocks(self.config.ceiling_fraction, num_blocks)
        self.hysteresis = max(1, _blocks(self.config.hysteresis_fraction, num_blocks))
        self._clock = clock
        self._demand = 0  # the demand now
        # Past demands that were superseded, as (when superseded, demand): the ends rise and
        # the demands fall from front to back (a later, larger one makes a smaller one moot),
        # so the front is the largest still inside the window. O(1) amortized per observation.
        self._past: deque[tuple[float, int]] = deque()
        self.blocks = self.ceiling  # nothing has run yet
        self.reported: int | None = None  # what report() last handed out

    @property
    def peak_demand(self) -> int:
        """The largest demand of the last window_s seconds (the demand now included)."""
        horizon = self._clock() - self.config.window_s
        while self._past and self._past[0][0] <= horizon:
            self._past.popleft()
        return max(self._demand, self._past[0][1]) if self._past else self._demand

    def observe(self, demand_blocks: int) -> int:
        """The running requests' demand now, in blocks; the budget it leaves."""
        if demand_blocks < 0:
            raise ValueError(f"demand_blocks must be >= 0, got {demand_blocks}")
        if demand_blocks != self._demand:
            now = self._clock()
            while self._past and self._past[-1][1] <= self._demand:
                self._past.pop()
            self._past.append((now, self._demand))
            self._demand = demand_blocks
        return self.refresh()

    def refresh(self) -> int:
        """The budget now (a peak may have aged out since the last observation)."""
        spare = self.num_blocks - self.peak_demand
        self.blocks = min(self.ceiling, max(self.floor, spare))
        return self.blocks

    def report(self) -> int | None:
        """The budget, when it moved enough since the last report to be worth telling (the
        first time always); else None."""
        b = self.blocks
        last = self.reported
        if last is None or abs(b - last) >= self.hysteresis or (
                b != last and b in (self.floor, self.ceiling)):
            self.reported = b
            return b
        return None

    def forget_report(self) -> None:
        """The next report() hands the budget out whatever it is (a new listener)."""
        self.reported = None
