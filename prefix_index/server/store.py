"""The index state in Redis: each change to one engine is one Lua script, one round trip."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from redis.asyncio import Redis, RedisCluster
from redis.exceptions import ResponseError

from prefix_index.api.ops import (
    Acquire,
    Commit,
    EngineMatch,
    EngineStats,
    Evict,
    EvictedBlock,
    Op,
    OpResult,
    OpStatus,
    Pin,
    Registration,
    Release,
    Unpin,
)
from prefix_index.server.config import PinPolicy
from prefix_index.server.errors import (
    EngineNotFoundError,
    IndexRequestError,
    InvalidRequestError,
    StaleEpochError,
)
from prefix_index.server.keys import ENGINES_KEY, engine_keys
from prefix_index.server.scripts import load_scripts

# Error prefixes the Lua scripts use (common.lua `fail`), mapped to our exceptions.
_SCRIPT_ERRORS: dict[str, type[IndexRequestError]] = {
    "NOT_FOUND": EngineNotFoundError,
    "STALE_EPOCH": StaleEpochError,
    "INVALID": InvalidRequestError,
}


def _script_error(exc: ResponseError, engine_id: str) -> Exception:
    message = str(exc)
    code, _, rest = message.partition(" ")
    kind = _SCRIPT_ERRORS.get(code)
    if kind is None:
        return exc
    # Lua appends "script: <sha>, on @user_script:..." to error replies on some versions.
    rest = rest.split(" script: ")[0]
    return kind(f"engine_id {engine_id!r}: {rest}")


def encode_ops(ops: Sequence[Op]) -> list[bytes | str | int]:
    """Flatten ops into the ARGV layout apply.lua reads."""
    args: list[bytes | str | int] = []
    for op in ops:
        match op:
            case Acquire(chain=chain):
                args += ["A", len(chain), *chain]
            case Commit(hash=h, parent=parent, block_id=block_id):
                args += ["C", h, parent, block_id]
            case Release(hashes=hashes):
                args += ["R", len(hashes), *hashes]
            case Evict(k=k):
                args += ["E", k]
            case Pin(chain=chain, ttl_s=ttl_s):
                args += ["P", round(ttl_s * 1000), len(chain), *chain]
            case Unpin(chain=chain):
                args += ["U", len(chain), *chain]
            case _:
                raise TypeError(f"not an op: {op!r}")
    return args


def decode_result(raw: list) -> OpResult:
    status, detail, block_ids, evicted_flat, count = raw
    evicted = [EvictedBlock(bytes(evicted_flat[i]), int(evicted_flat[i + 1]))
               for i in range(0, len(evicted_flat), 2)]
    return OpResult(OpStatus(int(status)), detail.decode() if isinstance(detail, bytes) else
                    str(detail), [int(b) for b in block_ids], evicted, int(count))


class IndexStore:
    """Async access to the index in Redis. Connection errors propagate (the caller maps them)."""

    def __init__(self, redis: Redis | RedisCluster, pin_policy: PinPolicy) -> None:
        self.redis = redis
        self.pin_policy = pin_policy
        self._scripts = load_scripts()

    async def _run(self, name: str, engine_id: str, args: list) -> object:
        try:
            return await self._scripts[name].run(self.redis, engine_keys(engine_id), args)
        except ResponseError as exc:
            raise _script_error(exc, engine_id) from None

    def _hot_args(self) -> list:
        policy = self.pin_policy
        return [policy.hot_threshold, round(policy.window_s * 1000)]

    async def ping(self) -> bool:
        return bool(await self.redis.ping())

    async def reset_connections(self) -> None:
        """Drop pooled connections to a server that went away, so the next call dials anew.
        (A cluster client re-discovers its nodes by itself.)"""
        pool = getattr(self.redis, "connection_pool", None)
        if pool is not None:
            await pool.disconnect()

    async def register(self, engine_id: str, model_identity: str, block_size: int,
                       num_blocks: int, lease_s: float) -> Registration:
        budget = self.pin_policy.budget(num_blocks)
        # The directory lives in another slot, so it cannot join the script's transaction. It
        # is added before (lookup never misses a live engine) and again after; heartbeats
        # re-add it, which heals a prune that raced this registration.
        await self.redis.sadd(ENGINES_KEY, engine_id)
        epoch = await self._run("register", engine_id, [
            model_identity, block_size, num_blocks, round(lease_s * 1000), budget])
        await self.redis.sadd(ENGINES_KEY, engine_id)
        return Registration(int(epoch), lease_s, budget)

    async def heartbeat(self, engine_id: str, epoch: int) -> float:
        lease_ms = await self._run("heartbeat", engine_id, [str(epoch)])
        await self.redis.sadd(ENGINES_KEY, engine_id)
        return int(lease_ms) / 1000.0

    async def apply(self, engine_id: str, epoch: int, ops: Sequence[Op]) -> list[OpResult]:
        raw = await self._run("apply", engine_id,
                              [str(epoch), *self._hot_args(), *encode_ops(ops)])
        return [decode_result(r) for r in raw]

    async def cool(self, engine_id: str) -> int:
        policy = self.pin_policy
        if policy.hot_threshold <= 0:
            return 0
        return int(await self._run("cool", engine_id,
                                   [*self._hot_args(), policy.cool_fraction]))

    async def engine_ids(self) -> list[str]:
        return sorted(m.decode() for m in await self.redis.smembers(ENGINES_KEY))

    async def _forget(self, engine_id: str) -> None:
        # Only when the engine is really gone: a register racing this re-adds itself.
        if not await self.redis.exists(engine_keys(engine_id)[0]):
            await self.redis.srem(ENGINES_KEY, engine_id)

    async def lookup(self, chain: Sequence[bytes], model_identity: str = "") -> list[EngineMatch]:
        ids = await self.engine_ids()
        rows = await asyncio.gather(*(self._run("lookup", e, list(chain)) for e in ids))
        matches = []
        for engine_id, row in zip(ids, rows, strict=True):
            if not row:
                await self._forget(engine_id)
                continue
            _epoch, model, num_blocks, held, evictable, matched = row
            if model_identity and model.decode() != model_identity:
                continue
            matches.append(EngineMatch(engine_id, int(matched), int(num_blocks), int(held),
                                       int(evictable)))
        matches.sort(key=lambda m: (-m.matched_blocks, m.engine_id))
        return matches

    async def stats(self, engine_id: str = "") -> list[EngineStats]:
        ids = [engine_id] if engine_id else await self.engine_ids()
        rows = await asyncio.gather(*(self._run("stats", e, []) for e in ids))
        out = []
        for eid, row in zip(ids, rows, strict=True):
            if not row:
                if engine_id:
                    raise EngineNotFoundError(
                        f"engine_id {engine_id!r}: engine is not registered or its lease expired")
                await self._forget(eid)
                continue
            (epoch, model, block_size, num_blocks, blocks, evictable, pinned, auto, budget,
             queries, hits, evictions, pttl) = row
            out.append(EngineStats(eid, int(epoch), model.decode(), int(block_size),
                                   int(num_blocks), int(blocks), int(evictable), int(pinned),
                                   int(auto), int(budget), int(queries), int(hits),
                                   int(evictions), max(int(pttl), 0) / 1000.0))
        return out
