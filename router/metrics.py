"""Prometheus metrics of the router, on their own registry (no module-global state)."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "pagedgen_router_"
# Routing is tokenize + hash + one index Lookup: tens of microseconds to a few milliseconds.
# Fine from 1 to 5 ms: where routing with an index Lookup lands, and the target (2 ms) lies.
ROUTE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0015, 0.002, 0.0025, 0.003, 0.004, 0.005,
                 0.0075, 0.01, 0.025, 0.05, 0.1, 0.25, 1)


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.decisions = Counter(
            PREFIX + "decisions",
            "Routing decisions, by the policy that chose and the replica: a request's first "
            "attempt, and each retry and resumed stream again.", ["policy", "replica"],
            registry=r)
        self.predicted_cached_tokens = Counter(
            PREFIX + "predicted_cached_tokens",
            "Prompt tokens the index said the chosen replica holds, by replica.",
            ["replica"], registry=r)
        self.actual_cached_tokens = Counter(
            PREFIX + "actual_cached_tokens",
            "Prompt tokens the replica served from its cache (usage.cached_tokens).",
            ["replica"], registry=r)
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens",
            "Prompt tokens of requests finished OK, by the replica first routed to.",
            ["replica"], registry=r)
        self.fallbacks = Counter(
            PREFIX + "fallbacks",
            "kv-aware requests routed by prefix-hash-bounded because the index gave no answer.",
            registry=r)
        self.retries = Counter(
            PREFIX + "retries",
            "Requests sent again to another replica before any output, by status code.",
            ["code"], registry=r)
        self.resumed_streams = Counter(
            PREFIX + "resumed_streams",
            "Streams continued on another replica after theirs failed mid-stream.", registry=r)
        self.requests = Counter(
            PREFIX + "requests",
            "Generation requests routed (gRPC and HTTP), once each as the client's call ended, "
            "by code: OK, the error status, CANCELLED when the client went away first "
            "(DEADLINE_EXCEEDED when its deadline ended it).",
            ["code"], registry=r)
        self.send_stalls = Counter(
            PREFIX + "send_stalls",
            "Generation streams ended because their client took nothing for "
            "--send-stall-timeout-s (its request stopped at its replica).", registry=r)
        self.failed = Counter(
            PREFIX + "requests_failed",
            "Requests ended with an error status, by code (a client's cancel not counted; one "
            "at its deadline counts DEADLINE_EXCEEDED).",
            ["code"], registry=r)
        self.route_seconds = Histogram(
            PREFIX + "route_seconds",
            "Arrival to the upstream call (tokenize, hash, index lookup, choice).",
            buckets=ROUTE_BUCKETS, registry=r)
        self.index_up = Gauge(
            PREFIX + "prefix_index_up",
            "1 while the prefix index answers (kv-aware routes by it), 0 while falling back; "
            "not exported by a router without one.",
            registry=r)
        self.replicas_routable = Gauge(
            PREFIX + "replicas_routable", "Replicas healthy, compatible and not draining.",
            registry=r)
        self.in_flight = Gauge(
            PREFIX + "in_flight_requests", "Requests this router is running, by replica.",
            ["replica"], registry=r)

    def without_index(self) -> None:
        """A router with no prefix index exports no prefix_index_up: a constant 0 would read
        as an index that is down."""
        with contextlib.suppress(KeyError):  # (unregistered already)
            self.registry.unregister(self.index_up)
