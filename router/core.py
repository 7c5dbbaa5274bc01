"""The router's state and its one decision: replicas, the index view, the policies, the prompt
reader and the requests running, all changed on the router's event loop only.

Background tasks keep the replicas' load fresh (EngineStats every `stats_interval_s`) and the
replica list in step with the index's registrations (every `discovery_interval_s`, which also
probes a down index until it answers again).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import xxhash

from engine_service.serving.send_stall import SendStallWatch
from router.config import RouterConfig
from router.index_view import IndexView
from router.metrics import RouterMetrics
from router.pending import PendingPrefixes
from router.policies import Decision, Policies, RouteInput
from router.prompt import PromptReader
from router.recent_prefixes import RecentPrefixes
from router.recent_routes import RecentRoutes
from router.replicas import Replica, ReplicaSet
from trust.credentials import TlsMaterial

if TYPE_CHECKING:
    from router.proxy import RoutedRequest

log = logging.getLogger("router.core")
MAX_LOOKUP_BLOCKS = 16384  # the index's limit on one chain
REFUSALS_LOG_INTERVAL_S = 30.0  # the most often refusals for want of a replica are logged


class NoReplicaError(Exception):
    """No replica can take the request now."""


class RefusalLog:
    """The router's log of requests no replica could take: one WARNING when that starts or
    its cause changes (other replicas down), then at most one line every `interval_s`: a
    WARNING with the count refused meanwhile while refusals go on, an INFO with that count once
    requests are routed again. An outage refuses every request: one line each would bury the
    log (each is counted in requests_failed_total{code="UNAVAILABLE"} already); a partial one
    routes and refuses by turns, which must not log a pair of lines a refusal either."""

    def __init__(self, interval_s: float = REFUSALS_LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.unlogged = 0  # refused since the last line
        self._cause: frozenset[str] | None = None  # replicas down at the last line; None: none
        self._logged_at = 0.0

    def refused(self, down: frozenset[str], describe: Callable[[], str]) -> None:
        """A request refused while the replicas named in `down` are not routable;
        `describe()`: why, for the log line."""
        now = time.monotonic()
        if down == self._cause and now - self._logged_at < self.interval_s:
            self.unlogged += 1
            return
        meanwhile = (f" ({self.unlogged} more refused since the last such line)"
                     if self.unlogged else "")
        log.warning("no replica can take a request: %s%s", describe(), meanwhile)
        self._cause, self._logged_at, self.unlogged = down, now, 0

    def routed(self) -> None:
        """A request was routed: a run of refusals, if any, has ended, said once the interval
        since the last line has passed (refusals in between carry the run on)."""
        if self._cause is None or time.monotonic() - self._logged_at < self.interval_s:
            return
        if self.unlogged:
            log.info("routing requests again; %d more refused for want of a replica since the "
                     "last such line", self.unlogged)
        else:
            log.info("routing requests again")
        self._cause, self.unlogged = None, 0


@dataclass(frozen=True, slots=True)
class Route:
    decision: Decision
    num_prompt_tokens: int | None
    # Prompt blocks the index says the replica holds: the predicted cached tokens of the
    # metrics (a chain credited only as routed there moments ago is prefilled again when the
    # replica admits both requests in one step, so that credit is no prediction).
    index_matched_blocks: int = 0
    chain: tuple[bytes, ...] = ()  # the prompt's block hashes (empty: not hashed)


class Router:
    def __init__(self, config: RouterConfig, engines: list[str], index_target: str | None,
                 tokenizer_path: str | None = None, metrics: RouterMetrics | None = None,
                 tls: TlsMaterial | None = None) -> None:
        """`tls`: mutual TLS to the index and to every replica (only engines' certificates
        accepted); None: plain text."""
        config.check()
        if not engines and not index_target:
            raise ValueError("engines: give --engines host:port,... or --prefix-index HOST:PORT "
                             "(replicas are then the engines registered there)")
        self.config = config
        self.static_engines = list(engines)
        self.metrics = metrics or RouterMetrics()
        self.replicas = ReplicaSet(config.rpc_timeout_s, on_restart=self._replica_restarted,
                                   tls=tls)
        self.index = (IndexView(index_target, config.lookup_timeout_s, tls) if index_target
                      else None)
        self.policies = Policies(config)
        self.prompts = PromptReader(tokenizer_path, config.rpc_timeout_s)
        # request id, scoped by tenant (tenancy/request_ids.py) -> the request
        # (router/proxy.py RoutedRequest): its replica, if it runs
        self.live: dict[str, RoutedRequest] = {}
        # (replica address, engine id) -> chains just routed there, not in the index yet
        # (kv-aware); keyed by both so an engine restarted at the address inherits nothing
        self.pending: dict[tuple[str, str], PendingPrefixes] = {}
        self.recent = RecentRoutes(config.share_window)  # where the last requests went
        self.recent_prefixes = RecentPrefixes(config.prefix_window)  # and with what prefix
        self._tasks: list[asyncio.Task] = []
        self.refusals = RefusalLog()
        # Client streams that take nothing for --send-stall-timeout-s are ended (proxy.py,
        # the HTTP API through the servicer).
        self.send_stalls = SendStallWatch(config.send_stall_timeout_s, "the router's",
                                          self.metrics.send_stalls.inc)
        if self.index is not None:
            self.metrics.index_up.set_function(lambda: 1.0 if self.index.up else 0.0)
        else:  # no index to be up or down: a 0 would read as an outage ("index down" alerts)
            self.metrics.without_index()
        self.metrics.replicas_routable.set_function(lambda: len(self.replicas.routable()))

    def _replica_restarted(self, replica: Replica) -> None:
        """A process the router has not seen answers as `replica` (ReplicaSet._adopt): its pool
        is empty, so neither the chains just routed there nor the recent prefixes counted
        under its name are held any more (the index's own view follows the engine's new
        epoch)."""
        self.pending.pop((replica.address, replica.engine_id), None)
        self.recent_prefixes.forget(replica.name)

    # ---- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        if self.static_engines:
            await self.replicas.set_members({address: "" for address in self.static_engines})
        await self._discover()
        await self._poll(wait=True)
        self._tasks = [asyncio.ensure_future(self._every(self.config.stats_interval_s,
                                                         self._poll))]
        if self.index is not None:
            self._tasks.append(asyncio.ensure_future(
                self._every(self.config.discovery_interval_s, self._discover)))
            self._tasks.append(asyncio.ensure_future(self.index.watch()))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.replicas.close()
        self.prompts.close()
        if self.index is not None:
            await self.index.close()

    async def _every(self, interval_s: float, work) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await work()
            except Exception:  # noqa: BLE001 - a loop that dies would freeze the router's view
                log.exception("background %s failed; retrying", work.__name__)

    async def _poll(self, wait: bool = False) -> None:
        await self.replicas.poll_all(wait)
        routable = self.replicas.routable()
        if routable:
            self.prompts.prepare(routable[0])

    async def _discover(self) -> None:
        if self.index is None:
            return
        registered = await self.index.engines()
        if registered is not None and not self.static_engines:
            await self.replicas.set_members(registered)
        members = {(r.address, r.engine_id) for r in self.replicas.replicas.values()}
        for key in [k for k in self.pending if k not in members]:
            del self.pending[key]

    # ---- state for health and stats -----------------------------------------------------------
    @property
    def serving(self) -> bool:
        return bool(self.replicas.routable())

    def details(self) -> dict[str, str]:
        details = {
            "policy": self.config.policy,
            "replicas": str(len(self.replicas.replicas)),
            "replicas_routable": str(len(self.replicas.routable())),
            "tokenizer": self.prompts.source,
        }
        if self.index is None:
            details["index"] = "none"
            if self.config.policy == "kv-aware":
                details["routing"] = "prefix-hash-bounded (no prefix index configured)"
        else:
            details["index"] = self.index.target
            details["index_up"] = str(self.index.up).lower()
            # How routes read the index: its pushed residency copy, or a Lookup each.
            details["index_residency"] = "synced" if self.index.mirror.synced else "lookup"
            if not self.index.up:
                details["index_error"] = self.index.last_error
                if self.config.policy == "kv-aware":
                    details["routing"] = "prefix-hash-bounded (fallback while the index is down)"
        for replica in self.replicas.replicas.values():
            state = ("up" if replica.routable
                     else f"down: {self.replicas.why_not_routed(replica)}")
            details[f"replica.{replica.name}"] = f"{replica.address} {state}"
        return details

    # ---- routing ------------------------------------------------------------------------
    async def route(self, token_ids: list[int] | None, cache_salt: str,
                    exclude: set[str], record: bool = True) -> Route:
        """Chooses a replica for a prompt; `exclude`: addresses that already failed it;
        `record`: counted in the routing metrics (False: not a generation request, e.g. the
        replica a PinPrefix goes to)."""
        replicas = [r for r in self.replicas.routable() if r.address not in exclude]
        hasher = self.replicas.hasher
        if not replicas or hasher is None:
            raise NoReplicaError(self._no_replica_message(exclude))
        # Only what one Lookup can use: a prompt of millions of tokens (which the engine will
        # refuse) must not stall the router's loop hashing it.
        hashed = token_ids[:MAX_LOOKUP_BLOCKS * hasher.block_size] if token_ids else []
        chain = hasher.chain(hashed, cache_salt or None)
        policy = self.config.policy
        index_matches: dict[str, int] | None = None
        matches: dict[str, int] | None = None
        if policy == "kv-aware" and self.index is not None:
            index_matches = self.index.held_prefixes_now(chain, hasher.identity)
            if index_matches is None:  # (no copy to read: ask)
                index_matches = await self.index.longest_prefixes(chain, hasher.identity)
            if index_matches is not None:
                # The index's answer may have raced a replica's failure: re-read who is up.
                replicas = [r for r in self.replicas.routable() if r.address not in exclude]
                if not replicas:
                    raise NoReplicaError(self._no_replica_message(exclude))
                matches = self._with_pending(index_matches, replicas, chain)
        now = time.monotonic()  # (one clock reading: the decision is one moment)
        # (Shares only where they are read: kv-aware with a hot-replica weight.)
        shares = (self.recent.shares(now)
                  if matches is not None and self.config.hot_replica_weight > 0 else None)
        prefix_key = self._prefix_key(chain, token_ids, cache_salt)
        others = (self.recent_prefixes.blocks_of_others(prefix_key, now)
                  if matches is not None and self.config.room_weight > 0 else None)
        route = RouteInput(len(token_ids) if token_ids is not None else None, prefix_key,
                           matches, shares, others)
        decision = self.policies.choose(policy, replicas, route, hasher.block_size)
        replica = decision.replica
        if matches is not None and record and replica.engine_id:  # (a PinPrefix prefills
            key = (replica.address, replica.engine_id)          # nothing)
            if key not in self.pending:
                self.pending[key] = PendingPrefixes(self.config.pending_s)
            self.pending[key].add(chain, now)
        if record:  # (a retry or resumed attempt counts too: it is traffic there)
            self.recent.add(replica.name, now)
            if prefix_key is not None and route.num_prompt_tokens:
                # At most the pool: a prompt the engine refuses as too long must not make
                # the replica look full for a minute.
                blocks = -(-route.num_prompt_tokens // hasher.block_size)
                if replica.reported.num_blocks:
                    blocks = min(blocks, replica.reported.num_blocks)
                self.recent_prefixes.add(replica.name, prefix_key, blocks, now)
            self.metrics.decisions.labels(decision.policy, replica.name).inc()
            if decision.fallback and self.index is not None:
                self.metrics.fallbacks.inc()
        held = (index_matches or {}).get(replica.engine_id, 0)
        self.refusals.routed()
        return Route(decision, route.num_prompt_tokens, min(held, decision.matched_blocks),
                     tuple(chain))

    def forget_pending(self, route: Route) -> None:
        """The replica failed or refused the routed request: its chain is no longer on the
        way there."""
        replica = route.decision.replica
        pending = self.pending.get((replica.address, replica.engine_id))
        if pending is not None:
            pending.forget(route.chain)

    def _with_pending(self, matches: dict[str, int], replicas: list[Replica],
                      chain: list[bytes]) -> dict[str, int]:
        """The index's matches, raised by what was routed to each replica moments ago."""
        now = time.monotonic()
        merged = dict(matches)
        for replica in replicas:
            pending = self.pending.get((replica.address, replica.engine_id))
            if pending is not None:
                held = pending.matched(chain, now)
                if held > merged.get(replica.engine_id, 0):
                    merged[replica.engine_id] = held
        return merged

    def _prefix_key(self, chain: list[bytes], token_ids: list[int] | None,
                    cache_salt: str) -> bytes | None:
        if chain:
            # The chain hash of block k covers blocks 0..k and the salt.
            return chain[min(self.config.prefix_hash_blocks, len(chain)) - 1]
        if token_ids:  # shorter than one block: its tokens and salt
            packed = struct.pack(f"<{len(token_ids)}i", *token_ids) + cache_salt.encode()
            return xxhash.xxh3_128_digest(packed)
        return None

    def _no_replica_message(self, exclude: set[str]) -> str:
        """Why no replica can take a request, for its client: counts only (replicas' names,
        addresses and errors are the deployment's, and go to this router's log)."""
        known = len(self.replicas.replicas)
        if not known:
            return "no engine replica is known yet (none registered with the prefix index)"
        downs = [r for r in self.replicas.replicas.values() if not r.routable]
        if downs or exclude:
            self.refusals.refused(
                frozenset(r.address for r in downs),
                lambda: "down {}; failed it {}".format(
                    "; ".join(f"{r.name} at {r.address}: {self.replicas.why_not_routed(r)}"
                              for r in downs) or "none", ", ".join(sorted(exclude)) or "none"))
        parts = [f"{known} known"]
        if downs:
            parts.append(f"{len(downs)} unavailable")
        if exclude:
            parts.append(f"{len(exclude)} tried for this request")
        return f"no engine replica can take the request ({', '.join(parts)})"
