"""Settings of the index server (flags of pagedgen-prefix-index)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from prefix_index.tools.server_options import DEFAULT_MAX_CONNECTION_IDLE_S


@dataclass(frozen=True, slots=True)
class PinPolicy:
    """Automatic pinning of hot blocks: hits in a sliding window against a threshold."""

    hot_threshold: int = 8         # hits within one window that pin a block; 0 = never
    window_s: float = 60.0         # sliding window length
    cool_fraction: float = 0.5     # unpin when the estimate falls below threshold * this
    budget_fraction: float = 0.1   # pins (explicit + automatic) allowed, as a share of the pool
    sweep_interval_s: float = 5.0  # how often auto pins are re-checked for cooling
    # Hit history per engine, in block hashes per pool block: it must outlast the cold blocks
    # that pass through the pool between two visits of a hot prefix.
    history_per_block: float = 4.0

    def budget(self, num_blocks: int) -> int:
        # The epsilon keeps 0.29 * 100 at 29, not 28.999... -> 28.
        return int(math.floor(self.budget_fraction * num_blocks + 1e-9))

    def history_cap(self, num_blocks: int) -> int:
        return max(1, int(math.floor(self.history_per_block * num_blocks + 1e-9)))


@dataclass(frozen=True, slots=True)
class Limits:
    """Input bounds; a request past one is refused with INVALID_ARGUMENT."""

    max_ops: int = 4096            # ops in one Apply
    max_chain: int = 16384         # hashes in one chain / release list
    max_hashes: int = 65536        # hashes in one Apply: bounds how long one script holds Redis
    # What an engine may ask for at Register: a pool of 4M blocks is ~1 TiB of KV even for a
    # small model, and a lease that long keeps a crashed engine's entries an hour at most.
    max_num_blocks: int = 1 << 22
    max_lease_s: float = 3600.0
    max_pin_ttl_s: float = 30 * 86400.0


@dataclass(frozen=True, slots=True)
class Quotas:
    """What one caller may hold or do (quotas.py); past one it gets RESOURCE_EXHAUSTED, and the
    others are served as before."""

    max_engines: int = 1024               # registered engines, all callers together
    # Per identity: a certificate (per-pod engine certificates hold one id each; a shared
    # engine certificate is one identity), so one identity cannot take every slot.
    max_engines_per_identity: int = 256
    # Each engine's token bucket for Apply ops: it refills at this rate and holds one full
    # re-sync of the engine's pool (2 ops per block: a commit, a pin) plus one largest Apply,
    # so a re-sync after Register always passes, and a flood past the rate is refused until
    # it refills.
    apply_ops_per_s: float = 20000.0
    # WatchResidency streams held at once by one identity (a router certificate) and by one
    # connection, below the process's total (residency.MAX_WATCHERS): a squatter cannot take
    # every slot. Plain text (--insecure) knows no identities: per connection only.
    max_watchers_per_identity: int = 16
    max_watchers_per_connection: int = 4


@dataclass(frozen=True, slots=True)
class IndexConfig:
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_cluster: bool = False        # redis_url names one node of a Redis Cluster
    default_lease_s: float = 30.0
    redis_timeout_s: float = 1.0       # socket connect/read timeout: fail fast when Redis is gone
    probe_interval_s: float = 0.5      # health probe of Redis
    # How long Register waits for a lease holder's ModelInfo when another process registers
    # under its engine id (holder_probe.py); 0: never probe, the lease must lapse.
    holder_probe_timeout_s: float = 1.0
    # Lookup's block hash -> engines view: an entry not refreshed (commit or admission hit) for
    # this long leaves the view, so the entries of engines that died do not pile up.
    view_ttl_s: float = 3600.0
    pin_policy: PinPolicy = PinPolicy()
    limits: Limits = Limits()
    quotas: Quotas = Quotas()
    # gRPC connections open at once (None: by the open-file limit) and how long one with no
    # call stays (prefix_index/tools/server_options.py); 0: no limit.
    max_connections: int | None = None
    max_connection_idle_s: float = DEFAULT_MAX_CONNECTION_IDLE_S
