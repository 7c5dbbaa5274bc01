"""Plain data for the batched ops and their results, shared by the client, the store and tests."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

HASH_BYTES = 16  # xxh3_128 block hashes


class OpStatus(enum.IntEnum):
    """Per-op outcome; the numbers are the proto's OpStatus values."""

    OK = 0
    NOT_HELD = 1
    REFCOUNT_ZERO = 2
    BLOCK_IN_USE = 3
    HASH_EXISTS = 4
    ALREADY_COMMITTED = 5
    PIN_BUDGET_EXCEEDED = 6
    BLOCK_MISMATCH = 7


class AcquireKind(enum.IntEnum):
    """Why an acquire is sent; only admissions count in the hit history (proto AcquireKind)."""

    ADMISSION = 0
    FORK = 1
    RESYNC = 2


class PinState(enum.IntEnum):
    """A block's pin state (proto PinState)."""

    NONE = 0
    EXPLICIT = 1
    AUTOMATIC = 2


@dataclass(frozen=True, slots=True)
class Acquire:
    """Longest held prefix of `chain`; refcount +1 on each of its blocks. An admission also
    counts a use of every hash of the chain in the hit history."""

    chain: list[bytes]
    kind: AcquireKind = AcquireKind.ADMISSION


@dataclass(frozen=True, slots=True)
class Commit:
    """Block `block_id` now holds the block hashed `hash`; `parent` is b"" for a chain's first."""

    hash: bytes
    parent: bytes
    block_id: int


@dataclass(frozen=True, slots=True)
class Release:
    hashes: list[bytes]


@dataclass(frozen=True, slots=True)
class Evict:
    k: int


@dataclass(frozen=True, slots=True)
class Pin:
    chain: list[bytes]
    ttl_s: float = 0.0  # 0 = until unpinned
    # A re-sync re-stating the index's automatic pins (proto PinOp.automatic); ttl_s is 0.
    automatic: bool = False


@dataclass(frozen=True, slots=True)
class Unpin:
    chain: list[bytes]
    # Only the automatic pins among the chain's hashes (proto UnpinOp.automatic_only): no
    # explicit pin is dropped, not even one named by the chain's last hash.
    automatic_only: bool = False


@dataclass(frozen=True, slots=True)
class Forget:
    """The engine evicted `block_id` (holding `hash`) on its own: drop exactly that entry."""

    hash: bytes
    block_id: int


@dataclass(frozen=True, slots=True)
class SetPinBudget:
    """The engine's pin budget now, in blocks (engine_service/core/pin_budget.py decides it);
    shrinking it unpins automatic pins, the least hot first, down to it."""

    blocks: int


Op = Acquire | Commit | Release | Evict | Pin | Unpin | Forget | SetPinBudget


@dataclass(frozen=True, slots=True)
class EvictedBlock:
    hash: bytes
    block_id: int


@dataclass(slots=True)
class OpResult:
    status: OpStatus
    detail: str = ""
    block_ids: list[int] = field(default_factory=list)
    evicted: list[EvictedBlock] = field(default_factory=list)
    count: int = 0

    @property
    def ok(self) -> bool:
        return self.status == OpStatus.OK


@dataclass(frozen=True, slots=True)
class PinChange:
    """A hash whose pin state changed; `block_id` -1 when it is no longer held."""

    hash: bytes
    block_id: int
    state: PinState


@dataclass(slots=True)
class ApplyResult:
    """What one Apply returned: per-op results, the pin changes since the engine's previous
    Apply, and whether this was a retry of an Apply already applied (seq)."""

    results: list[OpResult]
    pin_changes: list[PinChange] = field(default_factory=list)
    replayed: bool = False


@dataclass(frozen=True, slots=True)
class Registration:
    epoch: int
    lease_s: float
    pin_budget: int


@dataclass(frozen=True, slots=True)
class EngineMatch:
    engine_id: str
    matched_blocks: int
    num_blocks: int
    held_blocks: int
    evictable_blocks: int


@dataclass(frozen=True, slots=True)
class EngineStats:
    engine_id: str
    epoch: int
    model_identity: str
    block_size: int
    num_blocks: int
    blocks: int
    evictable: int
    pinned: int
    auto_pinned: int
    pin_budget: int
    queries: int
    hits: int
    evictions: int
    lease_remaining_s: float
    forgets: int = 0
    history: int = 0
    serving_address: str = ""  # where the engine serves Generation ("" = not routable)


@dataclass(frozen=True, slots=True)
class ResidencyChange:
    """One event of WatchResidency: see ResidencyEvent in protos/prefix_index.proto."""
    engine_id: str
    epoch: int
    reset: bool = False
    model_identity: str = ""
    added: tuple[bytes, ...] = ()
    removed: tuple[bytes, ...] = ()
