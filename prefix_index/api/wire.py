"""Conversions between the plain data in ops.py and the proto messages."""

from __future__ import annotations

from collections.abc import Sequence

from pagedgen_api import prefix_index_pb2 as pb
from prefix_index.api.ops import (
    Acquire,
    ApplyResult,
    Commit,
    EngineMatch,
    EngineStats,
    Evict,
    EvictedBlock,
    Forget,
    Op,
    OpResult,
    OpStatus,
    Pin,
    PinChange,
    PinState,
    Release,
    ResidencyChange,
    SetPinBudget,
    Unpin,
)


def op_to_proto(op: Op) -> pb.Op:
    match op:
        case Acquire(chain=chain, kind=kind):
            return pb.Op(acquire=pb.AcquireOp(chain=chain, kind=int(kind)))
        case Commit(hash=h, parent=parent, block_id=block_id):
            return pb.Op(commit=pb.CommitOp(hash=h, parent=parent, block_id=block_id))
        case Release(hashes=hashes):
            return pb.Op(release=pb.ReleaseOp(hashes=hashes))
        case Evict(k=k):
            return pb.Op(evict=pb.EvictOp(k=k))
        case Pin(chain=chain, ttl_s=ttl_s, automatic=automatic):
            return pb.Op(pin=pb.PinOp(chain=chain, ttl_s=ttl_s, automatic=automatic))
        case Unpin(chain=chain, automatic_only=automatic_only):
            return pb.Op(unpin=pb.UnpinOp(chain=chain, automatic_only=automatic_only))
        case Forget(hash=h, block_id=block_id):
            return pb.Op(forget=pb.ForgetOp(hash=h, block_id=block_id))
        case SetPinBudget(blocks=blocks):
            return pb.Op(set_pin_budget=pb.SetPinBudgetOp(blocks=blocks))
    raise TypeError(f"not an op: {op!r}")


def result_to_proto(result: OpResult) -> pb.OpResult:
    return pb.OpResult(
        status=int(result.status), detail=result.detail, block_ids=result.block_ids,
        evicted=[pb.EvictedBlock(hash=e.hash, block_id=e.block_id) for e in result.evicted],
        count=result.count)


def result_from_proto(msg: pb.OpResult) -> OpResult:
    return OpResult(OpStatus(msg.status), msg.detail, list(msg.block_ids),
                    [EvictedBlock(e.hash, e.block_id) for e in msg.evicted], msg.count)


def pin_change_to_proto(c: PinChange) -> pb.PinChange:
    return pb.PinChange(hash=c.hash, block_id=c.block_id, state=int(c.state))


def apply_result_to_proto(r: ApplyResult) -> pb.ApplyResponse:
    return pb.ApplyResponse(results=[result_to_proto(x) for x in r.results],
                            pin_changes=[pin_change_to_proto(c) for c in r.pin_changes],
                            replayed=r.replayed)


def apply_result_from_proto(msg: pb.ApplyResponse) -> ApplyResult:
    return ApplyResult([result_from_proto(r) for r in msg.results],
                       [PinChange(c.hash, c.block_id, PinState(c.state))
                        for c in msg.pin_changes], msg.replayed)


def match_to_proto(m: EngineMatch) -> pb.EngineMatch:
    return pb.EngineMatch(engine_id=m.engine_id, matched_blocks=m.matched_blocks,
                          num_blocks=m.num_blocks, held_blocks=m.held_blocks,
                          evictable_blocks=m.evictable_blocks)


def match_from_proto(msg: pb.EngineMatch) -> EngineMatch:
    return EngineMatch(msg.engine_id, msg.matched_blocks, msg.num_blocks, msg.held_blocks,
                       msg.evictable_blocks)


_STATS_FIELDS = ("engine_id", "epoch", "model_identity", "block_size", "num_blocks", "blocks",
                 "evictable", "pinned", "auto_pinned", "pin_budget", "queries", "hits",
                 "evictions", "lease_remaining_s", "forgets", "history",
                 "serving_address")


def stats_to_proto(s: EngineStats) -> pb.EngineStats:
    return pb.EngineStats(**{name: getattr(s, name) for name in _STATS_FIELDS})


def stats_from_proto(msg: pb.EngineStats) -> EngineStats:
    return EngineStats(**{name: getattr(msg, name) for name in _STATS_FIELDS})


def ops_to_proto(ops: Sequence[Op]) -> list[pb.Op]:
    return [op_to_proto(op) for op in ops]


def residency_to_proto(change: ResidencyChange | None) -> pb.ResidencyEvent:
    """None: the event that ends the snapshot; a change of no engine: a heartbeat."""
    if change is None:
        return pb.ResidencyEvent(synced=True)
    if not change.engine_id:
        return pb.ResidencyEvent(heartbeat=True)
    return pb.ResidencyEvent(engine_id=change.engine_id, epoch=change.epoch,
                             reset=change.reset, model_identity=change.model_identity,
                             added=change.added, removed=change.removed)


def residency_from_proto(event: pb.ResidencyEvent) -> ResidencyChange | None:
    if event.synced:
        return None
    return ResidencyChange(event.engine_id, event.epoch, event.reset, event.model_identity,
                           tuple(event.added), tuple(event.removed))
