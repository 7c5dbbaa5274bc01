"""The router's settings: which policy routes, and the weights of its cost."""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine_service.serving.send_stall import DEFAULT_SEND_STALL_TIMEOUT_S

# The longest context among the replicas a router fronts, until they say theirs: it sizes the
# largest request the router takes (--max-context-tokens); 128K tokens is 16 MiB of text.
DEFAULT_CONTEXT_TOKENS = 1 << 17
POLICIES = ("kv-aware", "round-robin", "least-load", "prefix-hash", "prefix-hash-bounded")


@dataclass(slots=True)
class RouterConfig:
    policy: str = "kv-aware"
    # kv-aware cost of a replica, in blocks of prefill work:
    #   prefill_weight * uncached prompt blocks + load
    #   load = queued prefill blocks + running_weight * running sequences
    #          + kv_weight * KV usage (0..1)
    prefill_weight: float = 1.0
    # A prefix's home (the first replica of its rendezvous order under the load cap, where
    # prefix-hash-bounded would send it) costs this many blocks less while no other replica
    # holds more of the prefix:
    # prefixes nobody holds yet spread over the replicas by hash, so each replica caches its
    # share of them, instead of all going to whichever replica was idle at the moment; a home
    # more loaded than that by this much is passed by.
    home_weight: float = 8.0
    # Chains routed to a replica count as held there for this long, until the index has them
    # (router/pending.py).
    pending_s: float = 5.0
    # Uncached prompt blocks cost (1 + hot_replica_weight * excess) on a replica that took
    # well over an even share of the last `share_window` requests, excess = replicas * its
    # share - 1.5 (0 below 1.5x an even share): a long prefill there stalls the traffic its
    # cache draws (one hot prefix), so new prefixes go where fewer requests wait behind them.
    # (A prompt whose uncached part costs more there than its whole prefill elsewhere goes
    # elsewhere too: at 70% of the traffic on 3 replicas, one with less than about half of it
    # cached.) Off by default: against weight 0 in the router bench's hot scenario (same
    # workloads, alternating) weight 2 won nothing (README, issue #11).
    hot_replica_weight: float = 0.0
    share_window: int = 32
    # Uncached prompt blocks that would evict the prefixes recently sent to a replica (those
    # past the room its pool has beside them, router/recent_prefixes.py) cost this many
    # blocks more each: the evicted prefix is prefilled again when its traffic returns, and
    # that traffic waits for it; the running requests' own blocks, not counted in the room,
    # evict some more. So more than 1, and more than home_weight's pull for a whole prefix
    # past the room by a few blocks. 0: off.
    room_weight: float = 2.0
    prefix_window: int = 64  # recent decisions the replicas' prefixes are counted over
    running_weight: float = 0.5
    kv_weight: float = 8.0
    # Bounded load (consistent hashing with bounded loads): a replica may take a request only
    # while its active requests + 1 <= ceil(load_bound * (all active + 1) / replicas), so one
    # hot prefix cannot pile every request onto the replica that caches it.
    load_bound: float = 1.25
    # ... plus this many requests: with a handful running, the bound alone forbids a second
    # request on the replica that holds a prefix (1 running of 1: cap ceil(1.25 * 2 / 3) = 1),
    # and sends it to one that must prefill it and evict another prefix for it; a replica
    # batches a few more requests at little cost.
    load_slack: int = 2
    # prefix-hash (and -bounded) key a request by the hash of its first blocks (at most this
    # many).
    prefix_hash_blocks: int = 4
    lookup_timeout_s: float = 0.25  # a slow index costs at most this, then prefix-hash-bounded
    stats_interval_s: float = 0.1  # each replica's EngineStats poll
    discovery_interval_s: float = 1.0  # replicas from the index; also the index's recovery probe
    rpc_timeout_s: float = 2.0  # the router's own calls to replicas (not generation)
    # What may wait for a client that does not read its stream, in tokens (each top logprob
    # one more), before its request is stopped with RESOURCE_EXHAUSTED (router/relay_buffer.py;
    # the engine's --max-unsent-tokens, the same default); 0: no bound.
    max_unsent_tokens: int = 1 << 16
    # A client that takes nothing from its stream this long while a message waits has the
    # stream ended (DEADLINE_EXCEEDED; HTTP: the connection closed) and its request stopped
    # (engine_service/serving/send_stall.py, the engine's default); 0: never.
    send_stall_timeout_s: float = DEFAULT_SEND_STALL_TIMEOUT_S

    def check(self) -> None:
        """Raises ValueError naming a setting outside what is allowed."""
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        for name in ("prefill_weight", "home_weight", "hot_replica_weight", "room_weight",
                     "running_weight", "kv_weight", "pending_s"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):  # (inf * 0 is a NaN cost)
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        if not self.load_bound >= 1:
            raise ValueError(f"load_bound must be >= 1 (1 = perfectly even), got "
                             f"{self.load_bound}")
        if self.load_slack < 0:
            raise ValueError(f"load_slack must be >= 0 requests, got {self.load_slack}")
        if self.share_window < 1:
            raise ValueError(f"share_window must be >= 1 requests, got {self.share_window}")
        if self.prefix_window < 1:
            raise ValueError(f"prefix_window must be >= 1 requests, got {self.prefix_window}")
        if self.max_unsent_tokens < 0:
            raise ValueError(f"max_unsent_tokens must be >= 0 (0: no bound), got "
                             f"{self.max_unsent_tokens}")
        if not 0 <= self.send_stall_timeout_s <= 86400:
            raise ValueError(f"send_stall_timeout_s must be in [0, 86400] seconds (0: never), "
                             f"got {self.send_stall_timeout_s}")
        if self.prefix_hash_blocks < 1:
            raise ValueError(f"prefix_hash_blocks must be >= 1, got {self.prefix_hash_blocks}")
        for name in ("lookup_timeout_s", "stats_interval_s", "discovery_interval_s",
                     "rpc_timeout_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
