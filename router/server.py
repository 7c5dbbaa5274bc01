"""pagedgen-router: one pagedgen.generation.v1.Generation address in front of many engine
replicas, each request routed by the prefix index's exact view of their caches and their load.

    pagedgen-router --prefix-index 127.0.0.1:50061 --port 50050          # replicas from the index
    pagedgen-router --engines 127.0.0.1:50051,127.0.0.1:50052 --prefix-index 127.0.0.1:50061
    pagedgen-router --engines ... --policy round-robin|least-load|prefix-hash   # the baselines
    pagedgen-router --engines ... --policy prefix-hash-bounded   # kv-aware's rule without an index

each with its TLS files (--tls-cert certs/router.pem --tls-key certs/router-key.pem --tls-ca
certs/ca.pem, or PAGEDGEN_TLS_*; pagedgen-certs makes them): refused at start without them,
plain text only with --insecure.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from engine_service.serving.connection_limits import generation_limits
from engine_service.serving.send_stall import add_send_stall_arg
from engine_service.serving.wire_errors import WireErrorInterceptor
from openai_api.cli_args import add_http_args, resolve_http_args
from openai_api.server import HttpServer
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from pagedgen_api import prefix_index_pb2
from prefix_index.tools.addresses import join_host_port
from prefix_index.tools.bind_error import BindError, bind_grpc, serve_metrics
from prefix_index.tools.metrics_args import add_metrics_args, resolve_metrics_host
from prefix_index.tools.metrics_server import MetricsServer
from prefix_index.tools.server_options import (
    DEFAULT_MAX_CONNECTION_IDLE_S,
    add_connection_args,
    resolve_connection_args,
)
from router.config import DEFAULT_CONTEXT_TOKENS, POLICIES, RouterConfig
from router.core import Router
from router.http_backend import router_backend
from router.metrics import RouterMetrics
from router.servicer import RouterServicer
from tenancy.cli_args import add_tenancy_args, door_from_args, resolve_tenancy_args
from tenancy.door import TenantDoor
from tenancy.gate import GateInterceptor
from trust.cli_args import add_tls_args, resolve_tls_args, warn_if_plain_text
from trust.credentials import TlsMaterial

log = logging.getLogger("router.server")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
# Reported in health too: SERVING while kv-aware routing has the index, NOT_SERVING while it
# falls back to prefix-hash with bounded load.
INDEX_SERVICE_NAME = prefix_index_pb2.DESCRIPTOR.services_by_name["PrefixIndex"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
HEALTH_INTERVAL_S = 0.2
# After the drain's grace, how long the cut streams get to send their status before the
# server stops (the server's own stop gives 0.5 s more).
CUT_SEND_S = 1.0
DEFAULT_STREAMS_PER_CONNECTION = 1024  # calls one client connection may hold open at once


class RouterServer:
    """The gRPC server around a Router: health follows whether any replica can take work."""

    def __init__(self, router: Router, host: str = "127.0.0.1", port: int = 50050,
                 metrics_port: int = 0, metrics_host: str = "127.0.0.1",
                 http: HttpServer | None = None, door: TenantDoor | None = None,
                 tls: TlsMaterial | None = None,
                 max_context_tokens: int = DEFAULT_CONTEXT_TOKENS,
                 max_streams_per_connection: int = DEFAULT_STREAMS_PER_CONNECTION,
                 max_connections: int | None = None,
                 max_connection_idle_s: float = DEFAULT_MAX_CONNECTION_IDLE_S) -> None:
        self.router = router
        # The front door: server-authenticated TLS (clients bring API keys, not certificates).
        self.credentials = tls.server_credentials(require_client_cert=False) if tls else None
        self.host, self.requested_port = host, port
        self.metrics_port, self.metrics_host = metrics_port, metrics_host
        door = door or TenantDoor()  # who may call (tenancy/); the HTTP API's gate is its gate
        self.servicer = RouterServicer(router, door, max_context_tokens)
        self.health = health_aio.HealthServicer()
        # Message sizes for the longest context it fronts, streams per connection, keepalive,
        # connections at once (None: by the open-file limit) and how long an idle one stays
        # (no SO_REUSEPORT: a taken port fails).
        connection = generation_limits(max_context_tokens, max_streams_per_connection,
                                       max_connections, max_connection_idle_s)
        # The key check first, then requests that do not decode are the client's error
        # (INVALID_ARGUMENT), not UNKNOWN with a traceback logged per call (wire_errors.py).
        # Both tell the servicer what they refuse: requests_total counts those too.
        refused = self.servicer.count_refused_call
        gate = [GateInterceptor(door.gate, refused)] if door.gate.takes_keys else []
        self.server = grpc.aio.server(options=connection.options(),
                                      interceptors=[*gate, WireErrorInterceptor(refused)])
        self.port = 0
        self.http = http  # the OpenAI-compatible HTTP API, when served
        self._health_task: asyncio.Task | None = None
        self._metrics_server: MetricsServer | None = None  # stopped by stop()

    async def start(self) -> int:
        pb_grpc.add_GenerationServicer_to_server(self.servicer, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME], self.server)
        address = join_host_port(self.host, self.requested_port)
        self.port = bind_grpc(self.server, address, self.credentials)
        if self.http is not None:  # bound now, served once the router runs
            self.http.bind()
        if self.metrics_port:
            # Before the router's tasks and the server start: a port in use fails here, with
            # nothing running yet to stop (after them, the process died of SIGSEGV).
            self._metrics_server = serve_metrics(self.router.metrics.registry,
                                                 self.metrics_port, self.metrics_host)
        await self.router.start()
        await self._update_health()
        await self.server.start()
        if self.http is not None:
            await self.http.start(router_backend(self.router, self.servicer))
        self._health_task = asyncio.ensure_future(self._follow_health())
        log.info("router serving on %s:%d (policy %s, %s)", self.host, self.port,
                 self.router.config.policy, "TLS" if self.credentials else "plain text")
        return self.port

    async def _update_health(self) -> None:
        serving = self.router.serving and not self.servicer.draining
        for name in ("", SERVICE_NAME):
            await self.health.set(name, SERVING if serving else NOT_SERVING)
        if self.router.index is not None:
            await self.health.set(INDEX_SERVICE_NAME,
                                  SERVING if self.router.index.up else NOT_SERVING)

    async def _follow_health(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_INTERVAL_S)
            await self._update_health()

    async def stop(self, grace_s: float = 30.0) -> None:
        """NOT_SERVING and new requests refused first; running streams get grace_s."""
        self.servicer.draining = True
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        await self._update_health()
        # Both fronts' running streams get the same grace, together.
        deadline = time.monotonic() + grace_s
        live = self.router.live
        while live and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if live:
            log.warning("%d requests still live after %.1fs: cancelling them", len(live),
                        grace_s)
            # Each ends with a status that says why (grpc.aio's own stop would say only
            # "Cancelling all calls"), its replica's call cancelled; a moment to send it.
            reason = (f"the router is shutting down: this request was still running when its "
                      f"drain (--grace-s {grace_s:g}) ended, and was stopped; retry it")
            for routed in list(live.values()):
                routed.cut(reason)
            cut_until = time.monotonic() + CUT_SEND_S
            while live and time.monotonic() < cut_until:
                await asyncio.sleep(0.02)
        left_s = max(0.5, deadline - time.monotonic())  # (other calls: PinPrefix, Tokenize)
        await asyncio.gather(self.server.stop(left_s),
                             self.http.stop(left_s) if self.http is not None else _nothing())
        await self.router.stop()
        if self._metrics_server is not None:  # its port and threads, back for the next server
            await asyncio.to_thread(self._metrics_server.stop)
            self._metrics_server = None


async def _nothing() -> None:
    return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = RouterConfig()
    p = argparse.ArgumentParser(prog="pagedgen-router", description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=50050, help="gRPC port (0 = any free port)")
    p.add_argument("--engines", default="",
                   help="host:port,... of the replicas (default: those registered with the "
                        "prefix index)")
    p.add_argument("--prefix-index", default="none",
                   help="HOST:PORT of the prefix index, or none (then only the baselines route "
                        "well, and --engines is needed)")
    p.add_argument("--policy", default=d.policy, choices=POLICIES,
                   help="kv-aware: least cost by the index's view of each cache and load; "
                        "round-robin, least-load, prefix-hash (a prefix's rendezvous home, "
                        "load ignored): the baselines; prefix-hash-bounded: prefix-hash under "
                        "--load-bound, kv-aware's fallback while the index is down")
    p.add_argument("--prefill-weight", type=float, default=d.prefill_weight,
                   help="kv-aware: cost of one uncached prompt block")
    p.add_argument("--home-weight", type=float, default=d.home_weight,
                   help="kv-aware: blocks of cost spared at a prefix's rendezvous home")
    p.add_argument("--hot-replica-weight", type=float, default=d.hot_replica_weight,
                   help="kv-aware: extra cost of an uncached block on a replica per share of "
                        "the recent requests it took past 1.5x an even split (0: off)")
    p.add_argument("--room-weight", type=float, default=d.room_weight,
                   help="kv-aware: extra cost of an uncached block that would evict a prefix "
                        "recently sent to the replica (one its pool has no room beside) (0: off)")
    p.add_argument("--prefix-window", type=int, default=d.prefix_window,
                   help="kv-aware: how many recent requests (of the last minute) the replicas' "
                        "prefixes count")
    p.add_argument("--share-window", type=int, default=d.share_window,
                   help="kv-aware: how many recent requests the replicas' shares count")
    p.add_argument("--pending-s", type=float, default=d.pending_s,
                   help="kv-aware: seconds a prefix routed to a replica counts as held there "
                        "before the index shows it")
    p.add_argument("--running-weight", type=float, default=d.running_weight,
                   help="load: cost of one running request, in blocks of prefill")
    p.add_argument("--kv-weight", type=float, default=d.kv_weight,
                   help="load: cost of a full KV cache, in blocks of prefill")
    p.add_argument("--load-bound", type=float, default=d.load_bound,
                   help="kv-aware, least-load and prefix-hash-bounded: no replica takes more "
                        "than this times the mean active requests (plus --load-slack)")
    p.add_argument("--load-slack", type=int, default=d.load_slack,
                   help="requests a replica may take past --load-bound's share")
    p.add_argument("--prefix-hash-blocks", type=int, default=d.prefix_hash_blocks,
                   help="prefix-hash and -bounded key a prompt by its first this many blocks")
    p.add_argument("--lookup-timeout-s", type=float, default=d.lookup_timeout_s)
    p.add_argument("--stats-interval-s", type=float, default=d.stats_interval_s)
    p.add_argument("--discovery-interval-s", type=float, default=d.discovery_interval_s)
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory (default: the replicas' model directory when it "
                        "is on this machine, else a replica tokenizes)")
    p.add_argument("--max-unsent-tokens", type=int, default=d.max_unsent_tokens,
                   help="a client that does not read its stream has its request stopped "
                        "(RESOURCE_EXHAUSTED) once this many tokens, each top logprob one "
                        "more, wait unsent for it (0: no bound)")
    add_send_stall_arg(p)
    p.add_argument("--max-context-tokens", type=int, default=DEFAULT_CONTEXT_TOKENS,
                   help="the longest context of the replicas: sizes the largest request "
                        "message taken (a whole context of text), past which gRPC answers "
                        "RESOURCE_EXHAUSTED")
    p.add_argument("--max-streams-per-connection", type=int,
                   default=DEFAULT_STREAMS_PER_CONNECTION,
                   help="calls one client connection may have open at once (more wait)")
    add_http_args(p, routed=True)
    add_tenancy_args(p)
    add_tls_args(p)
    add_metrics_args(p)
    add_connection_args(p)
    p.add_argument("--grace-s", type=float, default=30.0, help="drain time on SIGTERM")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = p.parse_args(argv)
    resolve_metrics_host(args)
    resolve_connection_args(p, args)
    args.engine_list = [e.strip() for e in args.engines.split(",") if e.strip()]
    if not args.engine_list and args.prefix_index == "none":
        p.error("give --engines host:port,... or --prefix-index HOST:PORT")
    if args.max_context_tokens < 1:
        p.error(f"--max-context-tokens must be >= 1, got {args.max_context_tokens}")
    if args.max_streams_per_connection < 1:
        p.error(f"--max-streams-per-connection must be >= 1, got "
                f"{args.max_streams_per_connection}")
    resolve_http_args(p, args)
    resolve_tenancy_args(p, args)
    resolve_tls_args(p, args)
    return args


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    return RouterConfig(
        policy=args.policy, prefill_weight=args.prefill_weight,
        home_weight=args.home_weight, pending_s=args.pending_s,
        hot_replica_weight=args.hot_replica_weight, share_window=args.share_window,
        room_weight=args.room_weight, prefix_window=args.prefix_window,
        running_weight=args.running_weight, kv_weight=args.kv_weight,
        load_bound=args.load_bound, load_slack=args.load_slack,
        prefix_hash_blocks=args.prefix_hash_blocks,
        lookup_timeout_s=args.lookup_timeout_s, stats_interval_s=args.stats_interval_s,
        discovery_interval_s=args.discovery_interval_s,
        max_unsent_tokens=args.max_unsent_tokens,
        send_stall_timeout_s=args.send_stall_timeout_s)


async def serve(args: argparse.Namespace) -> None:
    index = None if args.prefix_index == "none" else args.prefix_index
    warn_if_plain_text("pagedgen-router", args.tls)
    router = Router(config_from_args(args), args.engine_list, index, args.tokenizer,
                    RouterMetrics(), args.tls)
    door = door_from_args(args)
    http = (HttpServer(args.http_host, args.http_port, door.gate, args.tls,
                       send_stall_timeout_s=args.send_stall_timeout_s,
                       tool_call_parser=args.tool_call_parser,
                       reasoning_parser=args.reasoning_parser) if args.http_port
            else None)
    server = RouterServer(router, args.host, args.port, args.metrics_port, args.metrics_host,
                          http, door, args.tls, args.max_context_tokens,
                          args.max_streams_per_connection, args.max_connections,
                          args.max_connection_idle_s)
    port = await server.start()
    # One line on stdout that launchers read to learn the port (--port 0).
    print(f"router listening on {join_host_port(args.host, port)}", flush=True)
    if http is not None:
        print(f"router HTTP API on {http.scheme}://{join_host_port(args.http_host, http.port)}",
              flush=True)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    if args.keyring is not None:
        args.keyring.reload_on_sighup(loop)
    await stopping.wait()
    log.info("draining (grace %.1fs)", args.grace_s)
    await server.stop(args.grace_s)
    log.info("stopped")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level, stream=sys.stderr,
        format="%(asctime)s level=%(levelname)s logger=%(name)s msg=%(message)s")
    try:
        asyncio.run(serve(args))
    except ValueError as error:  # a bad setting: say it, no traceback
        log.error("%s", error)
        sys.exit(2)
    except BindError as error:  # a port in use
        log.error("cannot serve: %s", error)
        sys.exit(1)


if __name__ == "__main__":
    main()
