"""Prometheus metrics of the index server, on their own registry (no module-global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from prefix_index.api.ops import AcquireKind, Op, OpResult


class IndexMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.rpc_seconds = Histogram(
            "pagedgen_prefix_index_rpc_seconds", "Server-side latency of index RPCs.",
            ["method"], registry=r,
            buckets=(0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1, 5))
        self.rpcs = Counter("pagedgen_prefix_index_rpcs", "Index RPCs by method and status code.",
                            ["method", "code"], registry=r)
        self.ops = Counter("pagedgen_prefix_index_ops", "Batched ops by kind and outcome.",
                           ["op", "status"], registry=r)
        self.queried_blocks = Counter("pagedgen_prefix_index_queried_blocks",
                                      "Blocks asked for by acquire.", registry=r)
        self.hit_blocks = Counter("pagedgen_prefix_index_hit_blocks",
                                  "Blocks found held by acquire.", registry=r)
        self.evicted_blocks = Counter("pagedgen_prefix_index_evicted_blocks",
                                      "Blocks evicted.", registry=r)
        self.cooled_pins = Counter("pagedgen_prefix_index_cooled_pins",
                                   "Automatic pins dropped because the block cooled.", registry=r)
        self.pruned_engines = Counter("pagedgen_prefix_index_pruned_engines",
                                      "Engines whose lease ran out, pruned from the directory.",
                                      registry=r)
        self.forgotten_blocks = Counter("pagedgen_prefix_index_forgotten_blocks",
                                        "Blocks dropped because their engine evicted them "
                                        "on its own (forget).", registry=r)
        self.lease_takeovers = Counter("pagedgen_prefix_index_lease_takeovers",
                                       "Registrations that took an engine id's lease over "
                                       "from a holder found gone.", registry=r)
        self.replayed_applies = Counter("pagedgen_prefix_index_replayed_applies",
                                        "Retried Applies answered from the stored result.",
                                        registry=r)
        self.redis_up = Gauge("pagedgen_prefix_index_redis_up",
                              "1 while Redis answers; 0 from the first probe or call that "
                              "failed to reach it until a probe answers again.", registry=r)

    def record_ops(self, ops: list[Op], results: list[OpResult]) -> None:
        for op, result in zip(ops, results, strict=True):
            kind = type(op).__name__.lower()
            self.ops.labels(kind, result.status.name).inc()
            if kind == "acquire" and op.kind == AcquireKind.ADMISSION:  # as Stats counts
                self.queried_blocks.inc(len(op.chain))
                self.hit_blocks.inc(len(result.block_ids))
            elif kind == "evict":
                self.evicted_blocks.inc(len(result.evicted))
            elif kind == "forget":
                self.forgotten_blocks.inc(result.count)
