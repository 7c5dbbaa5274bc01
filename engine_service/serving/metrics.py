"""Prometheus metrics of the engine server, named in the spirit of vLLM's, on their own registry
(no module-global state). Gauges and engine counters are refreshed by the engine thread; latency
histograms are observed by the servicer, which sees a request from arrival to last token."""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from engine_service.core.stats import EngineStats

PREFIX = "pagedgen_engine_"
# Time to first token: from 1 ms (a tiny model, no queue) to 5 minutes (a long CPU prefill behind
# a full queue), so a queue that builds up shows in the quantiles rather than in +Inf.
TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60,
                120, 300)
# Mean gap between output tokens: decode steps take 2 to 50 ms on a GPU and tens of ms on a CPU,
# so the buckets are dense there, where a latency objective lies; past 5 s is a stall.
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
                       0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5)
# A whole request: up to max_tokens decode steps after its prefill, so minutes on a CPU, an hour
# at most (vLLM's go to two hours).
E2E_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600,
               1200, 1800, 3600)
INDEX_RPC_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1, 5)
# Engine-wide gauges cost a pass over the pool: refresh them at most this often while busy.
REFRESH_INTERVAL_S = 0.1


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.kv_cache_usage = Gauge(
            PREFIX + "kv_cache_usage_perc", "Fraction of KV blocks held by running sequences.",
            registry=r)
        self.num_blocks = Gauge(PREFIX + "kv_blocks", "KV blocks in the pool.", registry=r)
        self.tensor_parallel_size = Gauge(
            PREFIX + "tensor_parallel_size", "Ranks the model is split over (1: one device).",
            registry=r)
        self.num_free_blocks = Gauge(
            PREFIX + "kv_free_blocks",
            "KV blocks free to allocate: unused, or cached and evictable (idle pinned blocks "
            "are not free).", registry=r)
        self.num_cached_blocks = Gauge(
            PREFIX + "kv_cached_blocks",
            "KV blocks in the prefix cache (hashed), in use or evictable.", registry=r)
        self.num_pinned_blocks = Gauge(
            PREFIX + "pinned_blocks",
            "KV blocks pinned (explicit and automatic pins), idle or in use: what "
            "pin_budget_blocks bounds.", registry=r)
        self.pin_budget_blocks = Gauge(
            PREFIX + "pin_budget_blocks", "KV blocks pins may hold now: what the pool spares "
            "beside the running requests' peak demand, within the floor and ceiling.",
            registry=r)
        self.num_running = Gauge(
            PREFIX + "num_requests_running",
            "Sequences in the running batch (a request with n > 1 counts n).", registry=r)
        self.num_waiting = Gauge(
            PREFIX + "num_requests_waiting", "Requests waiting for admission.", registry=r)
        self.num_swapped = Gauge(
            PREFIX + "num_requests_swapped", "Requests swapped out to CPU blocks.", registry=r)
        self.num_waiting_prefill_tokens = Gauge(
            PREFIX + "waiting_prefill_tokens",
            "Prompt tokens of waiting and running requests not computed yet: the prefill "
            "queue, in work.", registry=r)
        self.prefix_cache_queries = Counter(
            PREFIX + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
            registry=r)
        self.prefix_cache_hits = Counter(
            PREFIX + "prefix_cache_hits", "Prompt tokens served from the prefix cache.",
            registry=r)
        self.num_preemptions = Counter(
            PREFIX + "num_preemptions", "Sequence groups preempted.", registry=r)
        self.num_prefill_deferrals = Counter(
            PREFIX + "num_prefill_deferrals",
            "Admissions put off a step because a running request was computing the same "
            "prompt blocks.", registry=r)
        self.num_pins_released = Counter(
            PREFIX + "pins_released_blocks",
            "Pinned KV blocks unpinned so that a request that could not run otherwise could.",
            registry=r)
        self.num_steps = Counter(
            PREFIX + "steps", "Engine steps (scheduled batches) run.", registry=r)
        self.time_to_first_token = Histogram(
            PREFIX + "time_to_first_token_seconds", "Arrival to first token.",
            buckets=TTFT_BUCKETS, registry=r)
        self.time_per_output_token = Histogram(
            PREFIX + "time_per_output_token_seconds",
            "Mean time between output tokens after the first, one observation per request "
            "(vLLM's request_time_per_output_token_seconds).",
            buckets=INTER_TOKEN_BUCKETS, registry=r)
        self.e2e_request_latency = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Arrival to last token.",
            buckets=E2E_BUCKETS, registry=r)
        self.requests_finished = Counter(
            PREFIX + "requests_finished",
            "Sequences finished, by finish reason (a request with n > 1 counts n; abort: "
            "cancelled, past its deadline, or failed).", ["finish_reason"], registry=r)
        self.requests = Counter(
            PREFIX + "requests",
            "Generation requests (gRPC and HTTP), once each as the call ended, by code: OK, "
            "the status it ended with (refusals at admission included), CANCELLED when the "
            "client went away first (DEADLINE_EXCEEDED when its deadline ended it).", ["code"],
            registry=r)
        self.send_stalls = Counter(
            PREFIX + "send_stalls",
            "Generation streams ended because their client took nothing for "
            "--send-stall-timeout-s (its request stopped, its slot freed).", registry=r)
        self.requests_rejected = Counter(
            PREFIX + "requests_rejected", "Requests refused before admission, by status code.",
            ["code"], registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens admitted.",
                                     registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.",
                                         registry=r)
        # Observed by the prefix index link (engine_service/index/policy.py) around its RPCs.
        self.index_rpc_seconds = Histogram(
            PREFIX + "index_rpc_seconds", "Latency of calls to the prefix index, by method.",
            ["method"], buckets=INDEX_RPC_BUCKETS, registry=r)
        self.degraded = Gauge(
            PREFIX + "prefix_index_degraded",
            "1 while the prefix index is unreachable and the engine runs on its local LRU.",
            registry=r)
        self._last = EngineStats(0, 0, 0, 0.0, 0, 0, 0, 0, 0, 0, 0)
        self._last_refresh = 0.0

    def watch_degraded(self, is_degraded: Callable[[], bool]) -> None:
        """Read at scrape time from the index link (a plain attribute read: thread-safe)."""
        self.degraded.set_function(lambda: 1.0 if is_degraded() else 0.0)

    def refresh(self, stats_fn: Callable[[], EngineStats], force: bool = False) -> None:
        """Called on the engine thread after a step (force when going idle)."""
        now = time.monotonic()
        if not force and now - self._last_refresh < REFRESH_INTERVAL_S:
            return
        self._last_refresh = now
        self.record(stats_fn())

    def record(self, stats: EngineStats) -> None:
        last = self._last
        self.kv_cache_usage.set(stats.kv_cache_usage)
        self.num_blocks.set(stats.num_blocks)
        self.tensor_parallel_size.set(stats.tensor_parallel_size)
        self.num_free_blocks.set(stats.num_free_blocks)
        self.pin_budget_blocks.set(stats.pin_budget_blocks)
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.num_swapped.set(stats.num_swapped)
        self.num_cached_blocks.set(stats.num_cached_blocks)
        self.num_pinned_blocks.set(stats.num_pinned_in_budget)
        self.num_waiting_prefill_tokens.set(stats.num_waiting_prefill_tokens)
        # The engine keeps running totals; Prometheus counters take the increments.
        queried = stats.prefix_cache_queries - last.prefix_cache_queries
        self.prefix_cache_queries.inc(max(0, queried))
        self.prefix_cache_hits.inc(max(0, stats.prefix_cache_hits - last.prefix_cache_hits))
        self.num_preemptions.inc(max(0, stats.num_preemptions - last.num_preemptions))
        self.num_prefill_deferrals.inc(
            max(0, stats.num_prefill_deferrals - last.num_prefill_deferrals))
        self.num_pins_released.inc(max(0, stats.num_pins_released - last.num_pins_released))
        self.num_steps.inc(max(0, stats.num_steps - last.num_steps))
        self._last = stats
