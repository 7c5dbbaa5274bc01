"""The index state in Redis: each change to one engine is one Lua script, one round trip."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Sequence

from redis.asyncio import Redis, RedisCluster
from redis.exceptions import OutOfMemoryError, RedisError, ResponseError

from prefix_index.api.ops import (
    Acquire,
    AcquireKind,
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
    Registration,
    Release,
    SetPinBudget,
    Unpin,
)
from prefix_index.server.config import PinPolicy
from prefix_index.server.errors import (
    EngineIdTakenError,
    EngineNotFoundError,
    IndexRequestError,
    InvalidRequestError,
    SequenceError,
    StaleEpochError,
)
from prefix_index.server.keys import (
    ENGINES_KEY,
    engine_keys,
    lookup_keys,
    parse_view_member,
    residency_channel,
    view_key,
    view_member,
)
from prefix_index.server.scripts import load_scripts

log = logging.getLogger("prefix_index.server.store")

# Error prefixes the Lua scripts use (common.lua `fail`), mapped to our exceptions.
_SCRIPT_ERRORS: dict[str, type[IndexRequestError]] = {
    "NOT_FOUND": EngineNotFoundError,
    "STALE_EPOCH": StaleEpochError,
    "INVALID": InvalidRequestError,
    "SEQUENCE": SequenceError,
}
_PIN_STATES = {b"e": PinState.EXPLICIT, b"a": PinState.AUTOMATIC, b"-": PinState.NONE}
# Lookup reads the view this many chain hashes per round trip, stopping at the first hash
# nobody holds.
_VIEW_CHUNK = 64
# Up to this many registered engines, Lookup asks each engine's own state (one script over all
# of them on a single server, ~0.2 ms) instead of reading the view first (a pipeline of one
# read per chain hash, then the same script for the candidates: ~2 ms). Past it the view keeps
# Lookup's cost to the engines that hold the chain. Both answers are exact: every match is the
# engine's own state.
SCAN_MAX_ENGINES = 8
_MAX_CONCURRENT_SCRIPTS = 16
_PIPELINED_SCRIPTS = 256
# Lookup reads the engine directory at most this often (a Register here refreshes it at once):
# a router asks on every request, and each read is a round trip. An engine registered through
# another index process is seen up to this much later, while it holds next to nothing; one
# that left is harmless (its row says "gone").
ENGINE_LIST_TTL_S = 1.0
# Stats of every engine (a router's discovery, every second or so from each router) costs a
# script per registered engine: one answer serves every caller for this long (a Register here
# makes it anew), and one computation serves the callers that ask while it runs, finishing
# even when the first caller's deadline passes, so at the engine quota the next call is cheap.
ALL_STATS_TTL_S = 0.5


def _match(engine_id: str, row: list, model_identity: str) -> EngineMatch | None:
    """lookup.lua's row for one engine as a match; None: it holds none of the chain, or serves
    another model."""
    _epoch, model, num_blocks, held, evictable, matched = row
    if int(matched) == 0 or (model_identity and model.decode() != model_identity):
        return None
    return EngineMatch(engine_id, int(matched), int(num_blocks), int(held), int(evictable))


def _best_first(found: list[EngineMatch | None]) -> list[EngineMatch]:
    return sorted((m for m in found if m is not None),
                  key=lambda m: (-m.matched_blocks, m.engine_id))


def _script_error(exc: ResponseError, engine_id: str) -> Exception:
    message = str(exc)
    code, _, rest = message.partition(" ")
    kind = _SCRIPT_ERRORS.get(code)
    if kind is None:
        return exc
    # Lua appends "script: <sha>, on @user_script:..." to error replies on some versions.
    rest = rest.split(" script: ")[0]
    return kind(f"engine_id {engine_id!r}: {rest}")


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def encode_ops(ops: Sequence[Op]) -> list[bytes | str | int]:
    """Flatten ops into the ARGV layout apply.lua reads."""
    args: list[bytes | str | int] = []
    for op in ops:
        match op:
            case Acquire(chain=chain, kind=kind):
                args += ["A", int(kind == AcquireKind.ADMISSION), len(chain), *chain]
            case Commit(hash=h, parent=parent, block_id=block_id):
                args += ["C", h, parent, block_id]
            case Release(hashes=hashes):
                args += ["R", len(hashes), *hashes]
            case Evict(k=k):
                args += ["E", k]
            case Pin(chain=chain, automatic=True):
                args += ["H", len(chain), *chain]
            case Pin(chain=chain, ttl_s=ttl_s):
                # Whole milliseconds, at least 1: the script reads 0 as "until unpinned".
                ttl_ms = max(1, round(ttl_s * 1000)) if ttl_s > 0 else 0
                args += ["P", ttl_ms, len(chain), *chain]
            case Unpin(chain=chain, automatic_only=True):
                args += ["W", len(chain), *chain]
            case Unpin(chain=chain):
                args += ["U", len(chain), *chain]
            case Forget(hash=h, block_id=block_id):
                args += ["F", h, block_id]
            case SetPinBudget(blocks=blocks):
                args += ["B", blocks]
            case _:
                raise TypeError(f"not an op: {op!r}")
    return args


def ops_digest(args: Sequence[bytes | str | int]) -> str:
    """Tells a retried Apply (same ops) from another one carrying the same sequence number."""
    digest = hashlib.blake2b(digest_size=16)
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        digest.update(len(data).to_bytes(4, "little"))
        digest.update(data)
    return digest.hexdigest()


def decode_pin_changes(flat: list) -> list[PinChange]:
    changes = [PinChange(bytes(flat[i]), int(flat[i + 2]), _PIN_STATES[bytes(flat[i + 1])])
               for i in range(0, len(flat), 3)]
    return sorted(changes, key=lambda c: c.hash)  # Redis hash order is no order at all


def decode_result(raw: list) -> OpResult:
    status, detail, block_ids, evicted_flat, count = raw
    evicted = [EvictedBlock(bytes(evicted_flat[i]), int(evicted_flat[i + 1]))
               for i in range(0, len(evicted_flat), 2)]
    return OpResult(OpStatus(int(status)), detail.decode() if isinstance(detail, bytes) else
                    str(detail), [int(b) for b in block_ids], evicted, int(count))



def _subscription_client(redis: Redis | RedisCluster) -> Redis | RedisCluster:
    """The client WatchResidency subscribes through: on a single server, the same settings over
    a pool of its own (MAX_WATCHERS connections), so watchers, each holding a connection while
    it watches, never take the connections the RPCs need (a burst of watchers made Lookups and
    the health probe fail with "Too many connections", whose pool reset then cut every
    watcher), and the pool reset after a failed probe leaves the subscriptions, which notice a
    dead Redis by themselves, alone. A cluster client keeps one pool per node: shared."""
    from prefix_index.server.residency import MAX_WATCHERS

    pool = getattr(redis, "connection_pool", None)
    if pool is None:
        return redis
    own = type(pool)(connection_class=pool.connection_class, max_connections=MAX_WATCHERS,
                     **pool.connection_kwargs)
    return Redis(connection_pool=own)

class IndexStore:
    """Async access to the index in Redis. Connection errors propagate (the caller maps them)."""

    def __init__(self, redis: Redis | RedisCluster, pin_policy: PinPolicy,
                 view_ttl_s: float = 3600.0) -> None:
        self.redis = redis
        self.pin_policy = pin_policy
        self.view_ttl_ms = round(view_ttl_s * 1000)
        # A cluster has one database; a single server's URL may name any of them.
        pool = getattr(redis, "connection_pool", None)
        db = int(pool.connection_kwargs.get("db", 0) or 0) if pool is not None else 0
        self.residency_channel = residency_channel(db)
        self._scripts = load_scripts(self.residency_channel)
        self.subscriber = _subscription_client(redis)
        self.view_write_errors = 0  # view writes that failed after their Apply succeeded
        self._engine_list: list[str] = []  # the directory as Lookup last read it
        self._engine_list_read_at = -ENGINE_LIST_TTL_S  # time.monotonic() of that read
        # Registers through this process: a directory read is kept only while no Register
        # started after it began (it may lack the engine that just registered).
        self._registrations = 0
        self._engine_list_registrations = -1  # the count when that read began
        self._live: dict[str, str] = {}  # live_engines()'s last answer
        self._live_read_at = float("-inf")
        # Stats(""): the last answer, when it was computed and the Register count then.
        self._all_stats: list[EngineStats] = []
        self._all_stats_at = -ALL_STATS_TTL_S
        self._all_stats_registrations = -1
        self._all_stats_task: asyncio.Task | None = None

    async def _run(self, name: str, engine_id: str, args: list) -> object:
        try:
            return await self._scripts[name].run(self.redis, engine_keys(engine_id), args)
        except ResponseError as exc:
            raise _script_error(exc, engine_id) from None

    def _hot_args(self) -> list:
        policy = self.pin_policy
        return [policy.hot_threshold, round(policy.window_s * 1000)]

    async def _each(self, engine_ids: list[str], script: str, args: list) -> list:
        """`script` for every engine: on a single server _PIPELINED_SCRIPTS calls a round trip
        (Stats over the index's whole engine quota stays within a router's discovery deadline);
        on a cluster at most _MAX_CONCURRENT_SCRIPTS at a time: a gather over hundreds of
        engines would ask the connection pool for as many connections at once (and fail with
        'Too many connections') when routers call Stats every second."""
        rows: list = []
        if not isinstance(self.redis, RedisCluster):
            for start in range(0, len(engine_ids), _PIPELINED_SCRIPTS):
                chunk = engine_ids[start:start + _PIPELINED_SCRIPTS]
                rows += await self._scripts[script].run_pipelined(
                    self.redis, [engine_keys(e) for e in chunk], args)
            return rows
        for start in range(0, len(engine_ids), _MAX_CONCURRENT_SCRIPTS):
            chunk = engine_ids[start:start + _MAX_CONCURRENT_SCRIPTS]
            rows += await asyncio.gather(*(self._run(script, e, args) for e in chunk))
        return rows

    async def ping(self) -> bool:
        return bool(await self.redis.ping())

    async def close(self) -> None:
        if self._all_stats_task is not None:
            self._all_stats_task.cancel()
        if self.subscriber is not self.redis:
            await self.subscriber.aclose()
        await self.redis.aclose()

    async def reset_connections(self) -> None:
        """Drop pooled connections to a server that went away, so the next call dials anew.
        (A cluster client re-discovers its nodes by itself.) The idle ones only: a call in
        flight ends by its own timeout or error, or succeeds if Redis answers in time; closing
        its connection under it made it fail 'Connection closed by server', which Redis had
        not done. (redis-py drops a connection that failed a call.)"""
        pool = getattr(self.redis, "connection_pool", None)
        if pool is not None:
            await pool.disconnect(inuse_connections=False)

    async def register(self, engine_id: str, model_identity: str, block_size: int,
                       num_blocks: int, lease_s: float, nonce: str = "",
                       serving_address: str = "", instance_id: str = "",
                       replaces: str = "") -> Registration:
        """A new epoch for engine_id. `replaces`: the instance id of a holder the caller found
        gone (servicer.Register probes it); the lease is taken over only from that holder."""
        policy = self.pin_policy
        budget = policy.budget(num_blocks)
        # The directory lives in another slot, so it cannot join the script's transaction. It
        # is added before (stats never misses a live engine) and again after; heartbeats
        # re-add it, which heals a prune that raced this registration.
        await self.redis.sadd(ENGINES_KEY, engine_id)
        reply = await self._run("register", engine_id, [
            model_identity, block_size, num_blocks, round(lease_s * 1000), budget, nonce,
            policy.history_cap(num_blocks), serving_address, engine_id, instance_id, replaces])
        if int(reply[0]) == 0:
            remaining_s = max(int(reply[1]), 0) / 1000.0
            until = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + remaining_s))
            raise EngineIdTakenError(
                f"engine_id {engine_id!r} is held by another live process (another nonce); "
                f"its lease expires in {remaining_s:.1f}s (at {until}) unless it heartbeats. "
                "Stop the other process, or give this one another engine id",
                holder_address=_text(reply[2]), holder_instance=_text(reply[3]))
        await self.redis.sadd(ENGINES_KEY, engine_id)
        self._registrations += 1  # Lookup reads the directory anew from now on
        self._live[engine_id] = nonce
        return Registration(int(reply[0]), lease_s, budget)

    async def registration_nonce(self, engine_id: str, epoch: int) -> str | None:
        """The nonce engine_id is registered under, if `epoch` is its current epoch."""
        current, nonce = await self.redis.hmget(engine_keys(engine_id, ("meta",))[0],
                                                ["epoch", "nonce"])
        if current is None or int(current) != epoch:
            return None
        return _text(nonce or b"")

    async def heartbeat(self, engine_id: str, epoch: int) -> float:
        lease_ms = await self._run("heartbeat", engine_id, [str(epoch)])
        try:
            await self.redis.sadd(ENGINES_KEY, engine_id)
        except OutOfMemoryError:
            # Redis full (maxmemory): the lease is extended (the script only reset TTLs,
            # which a full Redis allows) and the id is in the set since its Register; this
            # re-adds it only after a lost write. Refusing the heartbeat for it would drop
            # a live engine's entries once its lease ran out, freeing memory the wrong way.
            log.debug("engine %s: heartbeat kept without re-adding it to %s (redis full)",
                      engine_id, ENGINES_KEY)
        return int(lease_ms) / 1000.0

    async def apply(self, engine_id: str, epoch: int, ops: Sequence[Op], seq: int = 0
                    ) -> ApplyResult:
        args = encode_ops(ops)
        digest = ops_digest(args) if seq else ""
        raw_results, raw_changes, replayed, view_writes = await self._run(
            "apply", engine_id, [str(epoch), str(seq), digest, *self._hot_args(),
                                 self.view_ttl_ms // 2, engine_id, *args])
        result = ApplyResult([decode_result(r) for r in raw_results],
                             decode_pin_changes(raw_changes), bool(replayed))
        await self._write_view(engine_id, epoch, view_writes)
        return result

    async def _write_view(self, engine_id: str, epoch: int, writes: list) -> None:
        """Lookup's view after an Apply, in the order the script made the changes: '+' adds
        (or renews) the engine's entry for a hash, '-' removes it. Best effort: it runs after
        the Apply happened (other slots, so not in its script); Lookup checks what it reads
        against each engine's own state, and the next commit or hit repairs a lost write."""
        if not writes:
            return
        member = view_member(engine_id, epoch)
        pipe = self.redis.pipeline(transaction=False)
        for i in range(0, len(writes), 2):
            key = view_key(bytes(writes[i + 1]))
            if writes[i] == b"+":
                pipe.sadd(key, member)
                pipe.pexpire(key, self.view_ttl_ms)
            else:
                pipe.srem(key, member)
        try:
            await pipe.execute()
        except (RedisError, OSError) as exc:
            self.view_write_errors += 1
            log.warning("engine %s: lookup view not updated (%s); it heals on the next "
                        "commit or hit", engine_id, exc)

    async def sweep(self, engine_id: str) -> int | None:
        """Cools automatic pins, drops expired explicit pins and decayed history; None when
        the engine is gone (then it leaves the directory)."""
        policy = self.pin_policy
        cooled = int(await self._run("cool", engine_id,
                                     [*self._hot_args(), policy.cool_fraction]))
        if cooled < 0:
            await self._prune_engine(engine_id)
            return None
        return cooled

    async def resident(self, engine_id: str) -> tuple[int, str, list[bytes]] | None:
        """(epoch, model identity, resident block hashes) of the engine; None when gone."""
        row = await self._run("residency", engine_id, [])
        if not row:
            return None
        epoch, model, hashes = row
        return int(epoch), model.decode(), [bytes(h) for h in hashes]

    async def engine_ids(self) -> list[str]:
        return sorted(m.decode() for m in await self.redis.smembers(ENGINES_KEY))

    async def pool_size(self, engine_id: str) -> int | None:
        """The pool size engine_id registered with; None when it is not registered."""
        num_blocks = await self.redis.hget(engine_keys(engine_id, ("meta",))[0], "num_blocks")
        return None if num_blocks is None else int(num_blocks)

    async def is_live(self, engine_id: str) -> bool:
        return bool(await self.redis.exists(engine_keys(engine_id, ("meta",))[0]))

    async def live_engines(self, max_age_s: float = 0.0) -> dict[str, str]:
        """Every engine id with a live registration -> the nonce it is held under (the quotas
        count them): one read of the directory and one pipeline of reads, or the last answer
        if younger than `max_age_s` (with the registrations made here since added to it)."""
        if time.monotonic() - self._live_read_at < max_age_s:
            return self._live
        started = time.monotonic()
        engine_ids = await self.engine_ids()
        pipe = self.redis.pipeline(transaction=False)
        for engine_id in engine_ids:
            pipe.hget(engine_keys(engine_id, ("meta",))[0], "nonce")
        nonces = await pipe.execute() if engine_ids else []
        self._live = {engine_id: _text(nonce)
                      for engine_id, nonce in zip(engine_ids, nonces, strict=True)
                      if nonce is not None}
        self._live_read_at = started
        return self._live

    async def _lookup_engine_ids(self) -> list[str]:
        now = time.monotonic()
        if (self._engine_list_registrations == self._registrations
                and now - self._engine_list_read_at < ENGINE_LIST_TTL_S):
            return self._engine_list
        registrations = self._registrations
        engine_ids = await self.engine_ids()
        self._engine_list, self._engine_list_read_at = engine_ids, now
        self._engine_list_registrations = registrations
        return engine_ids

    async def _lookup_rows(self, engine_ids: list[str], chain: Sequence[bytes]) -> list:
        """lookup.lua's row for each engine: one call per SCAN_MAX_ENGINES engines on a single
        server, one per engine on a cluster (at most _MAX_CONCURRENT_SCRIPTS at a time)."""
        script = self._scripts["lookup"]
        if not isinstance(self.redis, RedisCluster):
            # At most SCAN_MAX_ENGINES engines a call: a script holds Redis for its whole run,
            # and many holders of a long chain would keep every engine's Apply waiting.
            rows = []
            for start in range(0, len(engine_ids), SCAN_MAX_ENGINES):
                keys = [key for engine_id in engine_ids[start:start + SCAN_MAX_ENGINES]
                        for key in lookup_keys(engine_id)]
                rows += await script.run(self.redis, keys, list(chain))
            return rows
        rows: list = []
        for start in range(0, len(engine_ids), _MAX_CONCURRENT_SCRIPTS):
            chunk = engine_ids[start:start + _MAX_CONCURRENT_SCRIPTS]
            replies = await asyncio.gather(*(script.run(self.redis, lookup_keys(e), list(chain))
                                             for e in chunk))
            rows += [reply[0] for reply in replies]
        return rows

    async def _prune_engine(self, engine_id: str) -> None:
        # Only when the engine is really gone: a register racing this re-adds itself.
        if not await self.redis.exists(engine_keys(engine_id)[0]):
            await self.redis.srem(ENGINES_KEY, engine_id)

    async def _view_claims(self, chain: Sequence[bytes]) -> dict[bytes, int]:
        """view member -> how many leading hashes of the chain the view says it holds."""
        claims: dict[bytes, int] = {}
        active: set[bytes] | None = None
        for start in range(0, len(chain), _VIEW_CHUNK):
            pipe = self.redis.pipeline(transaction=False)
            for h in chain[start:start + _VIEW_CHUNK]:
                pipe.smembers(view_key(h))
            for members in await pipe.execute():
                active = set(members) if active is None else active & set(members)
                if not active:
                    return claims
                for member in active:
                    claims[member] = claims.get(member, 0) + 1
        return claims

    async def lookup(self, chain: Sequence[bytes], model_identity: str = "") -> list[EngineMatch]:
        """Engines holding a prefix of the chain, from the view (cost: the chain and the
        engines holding it, not the engines registered), each checked against that engine's
        own state: the answer is exact even when a view write was lost."""
        engine_ids = await self._lookup_engine_ids() if chain else []
        if len(engine_ids) <= SCAN_MAX_ENGINES:
            rows = await self._lookup_rows(engine_ids, chain)
            found = [_match(engine_id, row, model_identity)
                     for engine_id, row in zip(engine_ids, rows, strict=True) if row]
            return _best_first(found)
        claims = await self._view_claims(chain)
        candidates = [(member, *parse_view_member(member)) for member in claims]
        rows = await self._lookup_rows([engine_id for _, engine_id, _ in candidates], chain)
        found = []
        stale: list[bytes] = []
        for (member, engine_id, epoch), row in zip(candidates, rows, strict=True):
            if not row or int(row[0]) != epoch:
                stale.append(member)  # the engine is gone or registered again since
                continue
            found.append(_match(engine_id, row, model_identity))
        if stale:
            await self._drop_stale(chain, claims, stale)
        return _best_first(found)

    async def _drop_stale(self, chain: Sequence[bytes], claims: dict[bytes, int],
                          stale: list[bytes]) -> None:
        # Entries of an old epoch are never written again, so removing them races nothing.
        pipe = self.redis.pipeline(transaction=False)
        for member in stale:
            for h in chain[: claims[member]]:
                pipe.srem(view_key(h), member)
        try:
            await pipe.execute()
        except (RedisError, OSError) as exc:
            log.debug("stale view entries kept for now: %s", exc)

    async def stats(self, engine_id: str = "") -> list[EngineStats]:
        """Stats of `engine_id`, or of every engine ("": see ALL_STATS_TTL_S)."""
        if engine_id:
            return await self._stats(engine_id)
        if (self._all_stats_registrations == self._registrations
                and time.monotonic() - self._all_stats_at < ALL_STATS_TTL_S):
            return self._all_stats
        if self._all_stats_task is None or self._all_stats_task.done():
            self._all_stats_task = asyncio.create_task(self._stats_of_all())
            # Its error reaches the callers waiting; with none left, it is dropped here.
            self._all_stats_task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return await asyncio.shield(self._all_stats_task)

    async def _stats_of_all(self) -> list[EngineStats]:
        registrations, started = self._registrations, time.monotonic()
        stats = await self._stats("")
        self._all_stats, self._all_stats_at = stats, started
        self._all_stats_registrations = registrations
        return stats

    async def _stats(self, engine_id: str) -> list[EngineStats]:
        ids = [engine_id] if engine_id else await self.engine_ids()
        rows = await self._each(ids, "stats", [])
        out = []
        for eid, row in zip(ids, rows, strict=True):
            if not row:
                if engine_id:
                    raise EngineNotFoundError(
                        f"engine_id {engine_id!r}: engine is not registered or its lease expired")
                await self._prune_engine(eid)
                continue
            (epoch, model, block_size, num_blocks, blocks, evictable, pinned, auto, budget,
             queries, hits, evictions, pttl, forgets, history, address) = row
            out.append(EngineStats(eid, int(epoch), model.decode(), int(block_size),
                                   int(num_blocks), int(blocks), int(evictable), int(pinned),
                                   int(auto), int(budget), int(queries), int(hits),
                                   int(evictions), max(int(pttl), 0) / 1000.0, int(forgets),
                                   int(history), address.decode()))
        return out
