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


@dataclass(frozen=True, slots=True)
class Acquire:
    """Longest held prefix of `chain`; refcount +1 on each of its blocks."""

    chain: list[bytes]


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


@dataclass(frozen=True, slots=True)
class Unpin:
    chain: list[bytes]


Op = Acquire | Commit | Release | Evict | Pin | Unpin


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
