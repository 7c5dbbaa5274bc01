"""Which replica takes a request: the five policies, as pure choices over a snapshot of the
replicas (no I/O here).

- kv-aware (default): the least cost, cost = prefill_weight * uncached prompt blocks
  * (1 + hot_replica_weight * the replica's share of the recent requests past 1.5x an even
  one) + prefill_weight * room_weight * the blocks of other recent prefixes they would evict
  there (router/recent_prefixes.py) + load
  (- home_weight at the prefix's rendezvous home while no replica holds more of it than the
  home); the uncached blocks from the index's exact per-replica longest prefix (and what the
  router routed there moments ago, router/pending.py).
- round-robin, least-load (load alone), prefix-hash (stateless rendezvous hashing of the
  prompt's first blocks: a router that knows neither caches nor load): the baselines.
- prefix-hash-bounded: prefix-hash under the bounded-load cap (consistent hashing with
  bounded loads), what kv-aware falls back to while the index is down; selectable too, as the
  strongest router that needs no index.
kv-aware, least-load and prefix-hash-bounded only pick among replicas under the bounded-load
cap.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from router.config import POLICIES, RouterConfig
from router.replicas import Replica


@dataclass(frozen=True, slots=True)
class RouteInput:
    """What is known of a request when it is routed."""

    num_prompt_tokens: int | None  # None: the router could not tokenize it
    prefix_key: bytes | None  # hash of the prompt's first blocks (prefix-hash); None: unknown
    # engine id -> leading prompt blocks it holds (absent: none); None: no index answer
    matches: dict[str, int] | None
    # replica name -> its share of the router's recent requests (router/recent_routes.py)
    shares: dict[str, float] | None = None
    # replica name -> blocks of the other prefixes recently sent there (recent_prefixes.py)
    others_blocks: dict[str, int] | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    replica: Replica
    policy: str  # the policy that chose (prefix-hash-bounded when kv-aware fell back)
    matched_blocks: int  # prompt blocks the index says the replica holds (kv-aware only)
    fallback: bool  # kv-aware had no index answer (or no index)


# A replica counts as hot only past (1 + this) times an even share: over the 32 requests of
# the share window an even split already varies by about 0.25 of a share, and that noise
# alone must not outweigh the home bonus (home_weight) of a new prefix.
EVEN_SHARE_SLACK = 0.5


def load_cap(replicas: Sequence[Replica], load_bound: float, load_slack: int = 0) -> int:
    """The most active requests a replica may have after taking this one."""
    total = sum(r.active_requests for r in replicas)
    return math.ceil(load_bound * (total + 1) / len(replicas)) + load_slack


def under_cap(replicas: Sequence[Replica], load_bound: float, load_slack: int = 0
              ) -> list[Replica]:
    cap = load_cap(replicas, load_bound, load_slack)
    # Never empty: the least loaded replica is at or below the mean, hence under the cap.
    return [r for r in replicas if r.active_requests + 1 <= cap]


def load(replica: Replica, block_size: int, config: RouterConfig) -> float:
    """Work ahead of a new request on `replica`, in blocks of prefill."""
    return (replica.queued_prefill_tokens / block_size
            + config.running_weight * replica.active_requests
            + config.kv_weight * replica.reported.kv_usage)


def rendezvous_order(key: bytes, replicas: Sequence[Replica]) -> list[Replica]:
    """Highest-random-weight order: every router ranks replicas the same way for a key, and
    removing a replica moves only the keys it was first for."""
    return sorted(replicas, key=lambda r: xxhash.xxh64_intdigest(key + r.name.encode()),
                  reverse=True)


class Policies:
    """The router's choice; holds only the round-robin position."""

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self._turn = 0

    def _next_turn(self) -> int:
        self._turn += 1
        return self._turn

    def choose(self, policy: str, replicas: Sequence[Replica], route: RouteInput,
               block_size: int) -> Decision:
        """`replicas`: the routable ones, in a stable order, at least one."""
        if policy == "kv-aware":
            if route.matches is None:
                return self._prefix_hash(replicas, route, block_size, fallback=True)
            return self._kv_aware(replicas, route, block_size)
        if policy == "round-robin":
            return self._round_robin(replicas, policy)
        if policy == "least-load":
            return self._least(replicas, lambda r: load(r, block_size, self.config), policy)
        if policy == "prefix-hash":
            return self._stateless_hash(replicas, route)
        if policy == "prefix-hash-bounded":
            return self._prefix_hash(replicas, route, block_size, fallback=False)
        raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")

    def _round_robin(self, replicas: Sequence[Replica], policy: str) -> Decision:
        return Decision(replicas[self._next_turn() % len(replicas)], policy, 0, False)

    def _eligible(self, replicas: Sequence[Replica]) -> list[Replica]:
        return under_cap(replicas, self.config.load_bound, self.config.load_slack)

    def _home(self, replicas: Sequence[Replica], prefix_key: bytes) -> Replica:
        """Where prefix-hash-bounded sends the prefix (and kv-aware's home): first in its
        rendezvous order under the cap."""
        return rendezvous_order(prefix_key, self._eligible(replicas))[0]

    def _least(self, replicas: Sequence[Replica], cost, policy: str,
               matches: dict[str, int] | None = None) -> Decision:
        eligible = self._eligible(replicas)
        turn = self._next_turn()
        n = len(eligible)
        # Ties: fewer active requests, then rotate, so equal replicas share the work.
        best_index, best = min(enumerate(eligible), key=lambda item: (
            cost(item[1]), item[1].active_requests, (item[0] - turn) % n))
        matched = (matches or {}).get(best.engine_id, 0)
        return Decision(best, policy, matched, False)

    def _kv_aware(self, replicas: Sequence[Replica], route: RouteInput,
                  block_size: int) -> Decision:
        # An unread prompt (the engine will refuse or read it) costs the same everywhere.
        prompt_blocks = math.ceil((route.num_prompt_tokens or 0) / block_size)
        matches = route.matches
        config = self.config
        home = None
        if route.prefix_key is not None:
            home = self._home(replicas, route.prefix_key)
            if matches.get(home.engine_id, 0) < max(matches.values(), default=0):
                home = None  # another replica holds more of it: affinity decides, not hash

        shares = route.shares or {}
        others = route.others_blocks or {}
        num_replicas = len(replicas)

        def evicted(replica: Replica, uncached: int) -> int:
            """Blocks of other recent prefixes the uncached ones would push out of the pool."""
            pool = replica.reported.num_blocks
            if not pool or not uncached:
                return 0
            room = max(0, pool - others.get(replica.name, 0))
            return min(uncached, max(0, prompt_blocks - room))

        def cost(replica: Replica) -> float:
            uncached = prompt_blocks - min(matches.get(replica.engine_id, 0), prompt_blocks)
            # A replica taking well over an even share serves traffic that waits behind
            # whatever prefill it starts: a new prefix costs more there.
            excess = max(0.0, num_replicas * shares.get(replica.name, 0.0) - 1.0
                         - EVEN_SHARE_SLACK)
            prefill = config.prefill_weight * uncached * (1.0 + config.hot_replica_weight * excess)
            prefill += config.prefill_weight * config.room_weight * evicted(replica, uncached)
            return (prefill + load(replica, block_size, config)
                    - (config.home_weight if replica is home else 0.0))

        return self._least(replicas, cost, "kv-aware", matches)

    def _stateless_hash(self, replicas: Sequence[Replica], route: RouteInput) -> Decision:
        """The prefix's first replica in rendezvous order, whatever the load: a router that
        knows neither caches nor load (an unread prompt goes round-robin)."""
        if route.prefix_key is None:
            return self._round_robin(replicas, "prefix-hash")
        return Decision(rendezvous_order(route.prefix_key, replicas)[0], "prefix-hash", 0, False)

    def _prefix_hash(self, replicas: Sequence[Replica], route: RouteInput, block_size: int,
                     fallback: bool) -> Decision:
        if route.prefix_key is None:  # nothing to hash (not tokenized): spread by load
            decision = self._least(replicas, lambda r: load(r, block_size, self.config),
                                   "prefix-hash-bounded")
            return Decision(decision.replica, "prefix-hash-bounded", 0, fallback)
        return Decision(self._home(replicas, route.prefix_key), "prefix-hash-bounded", 0,
                        fallback)
