"""pagedgen-prefix-index: the prefix index gRPC server (grpc.aio), with health and reflection.

    pagedgen-prefix-index --redis-url redis://127.0.0.1:6379/0 --port 50061 \
        --tls-cert certs/index.pem --tls-key certs/index-key.pem --tls-ca certs/ca.pem

No TLS files (flags or PAGEDGEN_TLS_*): refused at start; plain text only with --insecure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import signal
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from redis.asyncio import Redis, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from pagedgen_api import prefix_index_pb2 as pb
from pagedgen_api import prefix_index_pb2_grpc as pb_grpc
from prefix_index.api.ops import HASH_BYTES
from prefix_index.server.config import IndexConfig, Limits, PinPolicy, Quotas
from prefix_index.server.health import RedisHealth
from prefix_index.server.metrics import IndexMetrics
from prefix_index.server.redis_url import EXPECTED, REDIS_URL_ENV, redacted_url, url_problem
from prefix_index.server.servicer import PrefixIndexServicer
from prefix_index.server.store import IndexStore
from prefix_index.server.sweeper import run_sweeper
from prefix_index.tools.addresses import join_host_port
from prefix_index.tools.bind_error import BindError, bind_grpc, serve_metrics
from prefix_index.tools.metrics_args import add_metrics_args, resolve_metrics_host
from prefix_index.tools.metrics_server import MetricsServer
from prefix_index.tools.server_options import (
    DEFAULT_MAX_CONNECTION_IDLE_S,
    ConnectionLimits,
    add_connection_args,
    apply_message_bytes,
    default_max_connections,
    resolve_connection_args,
)
from trust.cli_args import add_tls_args, resolve_tls_args, warn_if_plain_text
from trust.credentials import TlsMaterial

log = logging.getLogger("prefix_index.server.main")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["PrefixIndex"].full_name


def connect_redis(url: str, timeout_s: float, cluster: bool = False) -> Redis | RedisCluster:
    """Short socket timeouts and no retries: a dead Redis shows up as an error at once; the
    caller retries, not us (a blind retry of a script whose reply was lost would apply it
    twice; the engine retries with its Apply sequence number, which makes that safe)."""
    if cluster:
        # Every script touches one engine's keys, which share a hash tag: one slot, one node.
        # redis>=6: this `retry` (0 retries) is also what the cluster client's command loop
        # obeys on a timeout or a lost connection (pinned in pyproject.toml).
        return RedisCluster.from_url(url, socket_connect_timeout=timeout_s,
                                     socket_timeout=timeout_s, retry=Retry(NoBackoff(), 0))
    return Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s,
                          retry=Retry(NoBackoff(), 0), health_check_interval=0)


class IndexServer:
    """The gRPC server, its Redis, its health probe and its sweeper, started and stopped
    together. Usable in-process (tests) or from main()."""

    def __init__(self, config: IndexConfig, host: str = "127.0.0.1", port: int = 0,
                 metrics_port: int = 0, metrics_host: str = "127.0.0.1",
                 tls: TlsMaterial | None = None) -> None:
        self.config = config
        self.tls = tls  # None: plain text, every caller allowed everything
        self.host = host
        self.requested_port = port
        self.metrics_port = metrics_port
        self.metrics_host = metrics_host
        self.port = 0
        self.metrics = IndexMetrics()
        self.redis = connect_redis(config.redis_url, config.redis_timeout_s,
                                   config.redis_cluster)
        self.store = IndexStore(self.redis, config.pin_policy, config.view_ttl_s)
        self.health_servicer = health_aio.HealthServicer()
        self.health = RedisHealth(self.store, self.health_servicer, ["", SERVICE_NAME],
                                  self.metrics, config.probe_interval_s, config.redis_timeout_s)
        # Pings to clients on idle connections: a router whose host vanished without a TCP
        # reset would otherwise hold its residency watcher (a slot and a Redis connection)
        # until the kernel's keepalive, hours later.
        self.server = grpc.aio.server(options=connection_limits(
            config.limits, config.max_connections, config.max_connection_idle_s).options())
        self._tasks: list[asyncio.Task] = []
        self._metrics_server: MetricsServer | None = None  # stopped by stop()

    async def start(self) -> int:
        servicer = PrefixIndexServicer(self.store, self.config, self.health, self.metrics,
                                       self.tls)
        pb_grpc.add_PrefixIndexServicer_to_server(servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health_servicer, self.server)
        reflection.enable_server_reflection(
            [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME], self.server)
        # Mutual TLS: every caller is an engine or a router with a certificate (authorize.py).
        credentials = self.tls.server_credentials(require_client_cert=True) if self.tls else None
        self.port = bind_grpc(self.server, join_host_port(self.host, self.requested_port),
                              credentials)
        if self.metrics_port:  # first: a port in use fails with nothing running to stop
            self._metrics_server = serve_metrics(self.metrics.registry, self.metrics_port,
                                                 self.metrics_host)
        await self.health.drain_off()
        await self.health.probe_once()
        await self.server.start()
        self._tasks = [asyncio.create_task(self.health.run()),
                       asyncio.create_task(run_sweeper(
                           self.store, self.metrics, self.config.pin_policy.sweep_interval_s))]
        log.info("prefix index serving on %s (%s, redis %s)",
                 join_host_port(self.host, self.port),
                 "mutual TLS" if self.tls else "plain text", redacted_url(self.config.redis_url))
        return self.port

    async def stop(self, grace_s: float = 5.0) -> None:
        """Health NOT_SERVING first (load balancers stop sending), then drain with grace."""
        await self.health.drain()
        await self.server.stop(grace_s)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.store.close()
        if self._metrics_server is not None:  # its port and threads, back for the next server
            await asyncio.to_thread(self._metrics_server.stop)
            self._metrics_server = None

    async def wait(self) -> None:
        await self.server.wait_for_termination()


def connection_limits(limits: Limits, max_connections: int | None = None,
                      max_connection_idle_s: float = DEFAULT_MAX_CONNECTION_IDLE_S,
                      ) -> ConnectionLimits:
    """Requests up to the largest Apply or Lookup `limits` allow (an engine's full re-sync
    comes in Applies of at most that size); replies unbounded here: each answers a bounded
    request (results per op, victims among the engine's own blocks), and its reader sets its
    own receive limit. Keepalive every 30 s (a second index on our port fails to bind).
    `max_connections` (None: by the open-file limit), `max_connection_idle_s`: the server's
    --max-connections and --max-connection-idle-s (0: no limit)."""
    return ConnectionLimits(
        max_receive_bytes=apply_message_bytes(limits.max_ops, limits.max_hashes,
                                              limits.max_chain, HASH_BYTES),
        max_send_bytes=-1, keepalive_time_ms=30_000,
        max_connections=(default_max_connections() if max_connections is None
                         else max_connections),
        max_connection_idle_s=max_connection_idle_s)


MAX_PORT = 65535


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults, policy, limits, quotas = IndexConfig(), PinPolicy(), Limits(), Quotas()
    p = argparse.ArgumentParser(prog="pagedgen-prefix-index", description=__doc__.split("\n")[0])
    p.add_argument("--redis-url", default=os.environ.get(REDIS_URL_ENV) or defaults.redis_url,
                   help=f"default ${REDIS_URL_ENV}, else {defaults.redis_url} (the variable keeps "
                        "a password off the command line, where any process can read it)")
    p.add_argument("--redis-cluster", action="store_true",
                   help="--redis-url names one node of a Redis Cluster")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=50061, help="gRPC port (0 = any free port)")
    p.add_argument("--lease-s", type=float, default=defaults.default_lease_s,
                   help="lease granted when Register asks for 0")
    p.add_argument("--hot-threshold", type=int, default=policy.hot_threshold,
                   help="hits within a window that pin a block automatically (0 = off)")
    p.add_argument("--hot-window-s", type=float, default=policy.window_s)
    p.add_argument("--cool-fraction", type=float, default=policy.cool_fraction,
                   help="unpin an automatic pin below threshold * this")
    p.add_argument("--pin-budget-fraction", type=float, default=policy.budget_fraction,
                   help="pins allowed per engine, as a share of its pool")
    p.add_argument("--sweep-interval-s", type=float, default=policy.sweep_interval_s,
                   help="how often pins cool, TTLs expire and gone engines are pruned")
    p.add_argument("--history-per-block", type=float, default=policy.history_per_block,
                   help="hit history kept per engine, in block hashes per pool block")
    p.add_argument("--view-ttl-s", type=float, default=defaults.view_ttl_s,
                   help="Lookup's view forgets a block not committed or hit for this long")
    p.add_argument("--redis-timeout-s", type=float, default=defaults.redis_timeout_s)
    p.add_argument("--probe-interval-s", type=float, default=defaults.probe_interval_s)
    p.add_argument("--holder-probe-timeout-s", type=float,
                   default=defaults.holder_probe_timeout_s,
                   help="when another process registers under a held engine id, how long to "
                        "wait for the holder's ModelInfo at its serving address before "
                        "refusing (0 = never ask: the holder's lease must lapse)")
    p.add_argument("--max-ops", type=int, default=limits.max_ops)
    p.add_argument("--max-chain", type=int, default=limits.max_chain)
    q = p.add_argument_group("quotas (a caller past one gets RESOURCE_EXHAUSTED or "
                             "INVALID_ARGUMENT; the others are served as before)")
    q.add_argument("--max-num-blocks", type=int, default=limits.max_num_blocks,
                   help="largest pool an engine may register")
    q.add_argument("--max-lease-s", type=float, default=limits.max_lease_s,
                   help="longest lease an engine may ask for")
    q.add_argument("--max-engines", type=int, default=quotas.max_engines,
                   help="engines registered at once, all callers together")
    q.add_argument("--max-engines-per-identity", type=int,
                   default=quotas.max_engines_per_identity,
                   help="engines registered at once under one engine certificate")
    q.add_argument("--apply-ops-per-s", type=float, default=quotas.apply_ops_per_s,
                   help="Apply ops per second per engine (a token bucket that holds one full "
                        "re-sync of the engine's pool plus one largest Apply)")
    q.add_argument("--max-watchers-per-identity", type=int,
                   default=quotas.max_watchers_per_identity,
                   help="WatchResidency streams one router certificate holds at once")
    q.add_argument("--max-watchers-per-connection", type=int,
                   default=quotas.max_watchers_per_connection,
                   help="WatchResidency streams one connection holds at once")
    add_metrics_args(p)
    add_connection_args(p)
    p.add_argument("--grace-s", type=float, default=5.0, help="drain time on SIGTERM")
    p.add_argument("--log-level", default="INFO",
                   choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    add_tls_args(p)
    args = p.parse_args(argv)
    resolve_metrics_host(args)
    resolve_connection_args(p, args)
    resolve_tls_args(p, args)
    problem = url_problem(args.redis_url)
    if problem:  # (the URL itself is not shown: it may hold a password)
        p.error(f"--redis-url (or ${REDIS_URL_ENV}): {problem}; expected {EXPECTED}")
    if not 0 < args.hot_window_s < math.inf:
        p.error(f"--hot-window-s: {args.hot_window_s} is not allowed; expected a finite "
                "number > 0")
    if not 0 <= args.pin_budget_fraction <= 1:
        p.error(f"--pin-budget-fraction: {args.pin_budget_fraction} is not allowed; "
                "expected 0..1")
    if not 0 <= args.cool_fraction <= 1:
        p.error(f"--cool-fraction: {args.cool_fraction} is not allowed; expected 0..1")
    if not 0 <= args.holder_probe_timeout_s <= 60:
        p.error(f"--holder-probe-timeout-s: {args.holder_probe_timeout_s} is not allowed; "
                "expected 0..60")
    for name in ("lease_s", "sweep_interval_s", "redis_timeout_s", "probe_interval_s",
                 "history_per_block", "view_ttl_s", "max_num_blocks", "max_lease_s",
                 "max_engines", "max_engines_per_identity", "apply_ops_per_s",
                 "max_watchers_per_identity", "max_watchers_per_connection", "max_ops",
                 "max_chain"):
        # (written so that a NaN fails it too)
        if not 0 < getattr(args, name) < math.inf:
            p.error(f"--{name.replace('_', '-')}: {getattr(args, name)} is not allowed; "
                    "expected a finite number > 0")
    for name in ("hot_threshold", "grace_s"):
        if not 0 <= getattr(args, name) < math.inf:
            p.error(f"--{name.replace('_', '-')}: {getattr(args, name)} is not allowed; "
                    "expected a finite number >= 0")
    # The kernel takes a port modulo 65536: --port 70000 would serve on 4464.
    for name in ("port", "metrics_port"):
        if not 0 <= getattr(args, name) <= MAX_PORT:
            p.error(f"--{name.replace('_', '-')}: {getattr(args, name)} is not allowed; "
                    f"expected 0..{MAX_PORT} (0 = {'any free port' if name == 'port' else 'off'})")
    if args.lease_s > args.max_lease_s:  # else every Register asking for the default fails
        p.error(f"--lease-s: {args.lease_s} is not allowed; expected at most --max-lease-s "
                f"({args.max_lease_s})")
    return args


def config_from_args(args: argparse.Namespace) -> IndexConfig:
    return IndexConfig(
        redis_url=args.redis_url, redis_cluster=args.redis_cluster,
        default_lease_s=args.lease_s,
        redis_timeout_s=args.redis_timeout_s, probe_interval_s=args.probe_interval_s,
        holder_probe_timeout_s=args.holder_probe_timeout_s,
        view_ttl_s=args.view_ttl_s,
        max_connections=args.max_connections,
        max_connection_idle_s=args.max_connection_idle_s,
        pin_policy=PinPolicy(hot_threshold=args.hot_threshold, window_s=args.hot_window_s,
                             cool_fraction=args.cool_fraction,
                             budget_fraction=args.pin_budget_fraction,
                             sweep_interval_s=args.sweep_interval_s,
                             history_per_block=args.history_per_block),
        limits=Limits(max_ops=args.max_ops, max_chain=args.max_chain,
                      max_num_blocks=args.max_num_blocks, max_lease_s=args.max_lease_s),
        quotas=Quotas(max_engines=args.max_engines,
                      max_engines_per_identity=args.max_engines_per_identity,
                      apply_ops_per_s=args.apply_ops_per_s,
                      max_watchers_per_identity=args.max_watchers_per_identity,
                      max_watchers_per_connection=args.max_watchers_per_connection))


async def serve(args: argparse.Namespace) -> None:
    warn_if_plain_text("pagedgen-prefix-index", args.tls)
    server = IndexServer(config_from_args(args), args.host, args.port, args.metrics_port,
                         args.metrics_host, args.tls)
    port = await server.start()
    # One line on stdout that launchers read to learn the port (--port 0).
    print(f"prefix-index listening on {join_host_port(args.host, port)}", flush=True)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await stopping.wait()
    log.info("draining (grace %.1fs)", args.grace_s)
    await server.stop(args.grace_s)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level, stream=sys.stderr,
        format="%(asctime)s level=%(levelname)s logger=%(name)s msg=%(message)s")
    try:
        asyncio.run(serve(args))
    except BindError as error:  # a port in use
        log.error("cannot serve: %s", error)
        sys.exit(1)


if __name__ == "__main__":
    main()
