"""The processes of one router benchmark run: N engine replicas that start empty (fresh
processes, fresh engine ids at a shared prefix index), one torch thread each, and a
pagedgen-router in front of them with one policy; and what they report afterwards (each
engine's EngineStats, the router's Prometheus metrics).

The index (and its Redis) outlive the runs: an engine id is used once, and the index keeps no
state that one engine id's blocks could lend another's.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import grpc
from prometheus_client.parser import text_string_to_metric_families

from engine_service.tools.launch import EngineProcess, wait_engine_serving
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from prefix_index.tools.redis_process import free_port
from router.tools.launch import RouterProcess

ENGINE_STAT_FIELDS = ("num_blocks", "prefix_cache_queries", "prefix_cache_hits",
                      "num_preemptions", "num_steps")


@dataclass(frozen=True, slots=True)
class ReplicaShape:
    num_engines: int
    num_blocks: int  # each replica's KV pool, in blocks
    block_size: int
    torch_threads: int = 1


@contextlib.contextmanager
def _environment(**values: str) -> Iterator[None]:
    """os.environ with `values` while child processes are spawned (they copy it), then as it
    was: OMP_NUM_THREADS for the engines only."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _engine_stats(target: str) -> dict[str, float]:
    with grpc.insecure_channel(target) as channel:
        stats = pb_grpc.GenerationStub(channel).EngineStats(pb.EngineStatsRequest(), timeout=10)
    return {name: getattr(stats, name) for name in ENGINE_STAT_FIELDS}


class PolicyStack:
    """`with PolicyStack(...) as stack:` engines and a router for one policy; stack.target is
    the router's address."""

    def __init__(self, model: str, index_target: str, policy: str, shape: ReplicaShape,
                 run_tag: str, log_dir: Path, router_args: tuple[str, ...] = ()) -> None:
        self.model = model
        self.index_target = index_target
        self.policy = policy
        self.shape = shape
        self.log_dir = log_dir
        self.router_args = list(router_args)
        self.engine_ids = [f"{run_tag}-e{i}" for i in range(shape.num_engines)]
        self.engines: list[EngineProcess] = []
        self.router: RouterProcess | None = None
        self.metrics_port = 0  # picked just before the router starts
        self._stack = ExitStack()

    @property
    def target(self) -> str:
        return self.router.target

    def __enter__(self) -> PolicyStack:
        try:
            self._start_engines()
            self._start_router()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _start_engines(self) -> None:
        s = self.shape
        for engine_id in self.engine_ids:
            args = ["--num-blocks", str(s.num_blocks), "--block-size", str(s.block_size),
                    "--prefix-index", self.index_target, "--engine-id", engine_id,
                    "--grace-s", "2", "--log-level", "WARNING", "--insecure"]
            self.engines.append(EngineProcess(self.model, args,
                                              log_path=self.log_dir / f"{engine_id}.log"))
        self._stack.callback(self._kill_engines)
        # Spawned together, then waited for: the start-up (imports, weights) overlaps.
        with _environment(OMP_NUM_THREADS=str(s.torch_threads)):
            for engine in self.engines:
                engine.spawn(engine.command(), engine.log_path)
        for engine in self.engines:
            wait_engine_serving(engine.target, engine.start_timeout_s, engine.proc,
                                engine.log_path)

    def _kill_engines(self) -> None:
        for engine in self.engines:
            engine.kill()

    def _start_router(self, attempts: int = 3) -> None:
        # A port free_port() found can be taken before the router binds it (the engines'
        # outgoing connections draw from the same ephemeral range): then another port.
        for attempt in range(attempts):
            self.metrics_port = free_port()
            args = ["--engines", ",".join(e.target for e in self.engines),
                    "--prefix-index", self.index_target, "--policy", self.policy,
                    "--metrics-port", str(self.metrics_port), "--metrics-host", "127.0.0.1",
                    "--grace-s", "2", "--log-level", "WARNING", "--insecure",
                    *self.router_args]
            self.router = RouterProcess(args,
                                        log_path=self.log_dir / f"router-{self.policy}.log")
            try:
                self.router.start()
                break
            except RuntimeError as error:
                self.router.kill()
                port_taken = any(text in str(error) for text in ("Address already in use",
                                                                   "could not bind"))
                if not port_taken or attempt == attempts - 1:
                    raise
        self._stack.callback(self.router.kill)
        self._wait_routable()

    def _wait_routable(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        wanted = str(self.shape.num_engines)
        with grpc.insecure_channel(self.target) as channel:
            stub = pb_grpc.GenerationStub(channel)
            while True:
                details = stub.EngineStats(pb.EngineStatsRequest(), timeout=10).index_details
                if details.get("replicas_routable") == wanted and details.get("index_up") == "true":
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(f"router ({self.policy}): {wanted} routable replicas and "
                                       f"the index up expected, got {dict(details)}")
                time.sleep(0.1)

    # ---- what the processes report --------------------------------------------------------
    def engine_stats(self) -> dict[str, dict[str, float]]:
        """engine id -> its EngineStats counters (cumulative since it started)."""
        return {engine_id: _engine_stats(engine.target)
                for engine_id, engine in zip(self.engine_ids, self.engines, strict=True)}

    def router_metrics(self) -> RouterFigures:
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as reply:
            return RouterFigures.parse(reply.read().decode())


@dataclass(slots=True)
class RouterFigures:
    """What the router's /metrics says after a run."""

    decisions: dict[str, float]  # replica -> requests routed there
    fallbacks: float  # kv-aware requests routed without an index answer
    predicted_cached_tokens: float
    actual_cached_tokens: float
    route_buckets: list[tuple[float, float]]  # (upper bound s, cumulative count)
    route_sum_s: float
    route_count: float

    @classmethod
    def parse(cls, text: str) -> RouterFigures:
        samples = [s for family in text_string_to_metric_families(text) for s in family.samples]

        def total(name: str) -> float:
            return sum(s.value for s in samples if s.name == name)

        decisions: dict[str, float] = {}
        for s in samples:
            if s.name == "pagedgen_router_decisions_total":
                replica = s.labels["replica"]
                decisions[replica] = decisions.get(replica, 0.0) + s.value
        buckets = sorted((float(s.labels["le"]), s.value) for s in samples
                         if s.name == "pagedgen_router_route_seconds_bucket")
        return cls(decisions, total("pagedgen_router_fallbacks_total"),
                   total("pagedgen_router_predicted_cached_tokens_total"),
                   total("pagedgen_router_actual_cached_tokens_total"), buckets,
                   total("pagedgen_router_route_seconds_sum"),
                   total("pagedgen_router_route_seconds_count"))

    def since(self, earlier: RouterFigures) -> RouterFigures:
        """What happened between `earlier` and this scrape of the same router."""
        before = dict(earlier.route_buckets)
        return RouterFigures(
            {k: v - earlier.decisions.get(k, 0.0) for k, v in self.decisions.items()},
            self.fallbacks - earlier.fallbacks,
            self.predicted_cached_tokens - earlier.predicted_cached_tokens,
            self.actual_cached_tokens - earlier.actual_cached_tokens,
            [(bound, count - before.get(bound, 0.0)) for bound, count in self.route_buckets],
            self.route_sum_s - earlier.route_sum_s,
            self.route_count - earlier.route_count)

    def route_quantile(self, q: float) -> float:
        """The q-quantile (0..1) of route_seconds, interpolated linearly inside its bucket
        (Prometheus' histogram_quantile): a figure as fine as the buckets, no finer."""
        count = self.route_count
        if not count or not self.route_buckets:
            return math.nan
        rank = q * count
        lower_bound, lower_count = 0.0, 0.0
        for bound, cumulative in self.route_buckets:
            if cumulative >= rank:
                if math.isinf(bound):
                    return lower_bound  # above the last finite bucket: its bound, a floor
                inside = cumulative - lower_count
                fraction = (rank - lower_count) / inside if inside else 1.0
                return lower_bound + (bound - lower_bound) * fraction
            lower_bound, lower_count = bound, cumulative
        return lower_bound
