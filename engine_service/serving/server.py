"""pagedgen-engine: the generation gRPC server (grpc.aio) with health, reflection and metrics.

    pagedgen-engine --model PATH --port 50051 --device cpu --prefix-index 127.0.0.1:50061 \
        --tls-cert certs/engine.pem --tls-key certs/engine-key.pem --tls-ca certs/ca.pem

No TLS files (flags or PAGEDGEN_TLS_*): refused at start; plain text only with --insecure.

SIGTERM (or SIGINT) drains: health goes NOT_SERVING, new requests get UNAVAILABLE, in-flight
requests finish (up to --grace-s), then the server stops. If the engine thread dies, health
goes NOT_SERVING at once, live streams end with INTERNAL, and the process exits with status 1
(so an orchestrator restarts it).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from engine_service.core.config import BLOCK_SIZES, DEVICES, PREEMPTION_MODES, EngineConfig
from engine_service.core.stats import EngineStats
from engine_service.index.link import IndexLinkOptions
from engine_service.model.config import ModelConfig, load_model_config
from engine_service.model.dtype import DTYPE_CHOICES
from engine_service.model.tokenizer import load_tokenizer
from engine_service.serving.async_engine import AsyncEngine
from engine_service.serving.connection_limits import generation_limits
from engine_service.serving.core_client import (
    DEFAULT_MAX_UNSENT_TOKENS,
    CoreClient,
    default_stall_timeout_s,
)
from engine_service.serving.core_process import (
    CoreOptions,
    CoreTarget,
    run_core,
)
from engine_service.serving.engine_info import EngineInfo
from engine_service.serving.grammar_process import DEFAULT_COMPILE_TIMEOUT_S
from engine_service.serving.http_backend import engine_backend
from engine_service.serving.metrics import EngineMetrics
from engine_service.serving.send_stall import DEFAULT_SEND_STALL_TIMEOUT_S, add_send_stall_arg
from engine_service.serving.servicer import GenerationServicer, IndexLink
from engine_service.serving.status import RequestRejected
from engine_service.serving.text_worker import TextWorker
from engine_service.serving.validation import RequestValidator
from engine_service.serving.wire_errors import GENERATE_METHODS, WireErrorInterceptor
from openai_api.cli_args import add_http_args, resolve_http_args
from openai_api.server import HttpServer
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from prefix_index.tools.addresses import join_host_port
from prefix_index.tools.bind_error import BindError, bind_grpc, serve_metrics
from prefix_index.tools.metrics_args import add_metrics_args, resolve_metrics_host
from prefix_index.tools.metrics_server import MetricsServer
from prefix_index.tools.server_options import (
    DEFAULT_MAX_CONNECTION_IDLE_S,
    ConnectionLimits,
    add_connection_args,
    resolve_connection_args,
)
from tenancy.cli_args import add_tenancy_args, door_from_args, resolve_tenancy_args
from tenancy.door import TenantDoor
from tenancy.gate import GateInterceptor
from trust.cli_args import add_tls_args, resolve_tls_args, warn_if_plain_text
from trust.credentials import TlsMaterial

if TYPE_CHECKING:  # the front imports no torch: the engine is the core's
    from engine_service.core.engine import LLMEngine

T = TypeVar("T")
log = logging.getLogger("engine_service.serving.server")
SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_BYTE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
TP_SIZE_ENV = "PAGEDGEN_TENSOR_PARALLEL_SIZE"
# After the drain's grace, how long the cut streams get to send their status before the
# server stops (one step and a message each; the server's own stop gives 0.5 s more).
CUT_SEND_S = 1.0
# How long health waits, at start, for the index link's first round (a registration, or an
# attempt that failed) before it says SERVING anyway: the Register call's own deadline (3 s)
# and the mirror's re-sync, with room.
FIRST_REGISTRATION_WAIT_S = 5.0


@dataclass(slots=True)
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 50051  # 0 = any free port
    metrics_port: int = 0  # 0 = no metrics endpoint
    metrics_host: str = "127.0.0.1"
    max_live_requests: int = 1024
    engine_id: str = ""
    http_port: int = 0  # the OpenAI-compatible HTTP API (openai_api/); 0 = off
    http_host: str = "127.0.0.1"
    stream_interval: int = 1  # new tokens gathered per streamed message (core_client.py)
    # Who may call, their tenants and limits (tenancy/): every gRPC and HTTP call but health
    # and reflection needs a key when the door's gate takes keys.
    door: TenantDoor = field(default_factory=TenantDoor)
    tls: TlsMaterial | None = None  # None: plain text
    # TLS: require a client certificate (routers, the index's probe, tools with a client
    # certificate); False: server-authenticated TLS for end clients (--tls-server-only).
    tls_client_cert: bool = True
    # Message sizes, streams per connection, keepalive (connection_limits.py); None: computed
    # from the in-process engine's context.
    connection: ConnectionLimits | None = None
    # gRPC connections open at once (None: by the open-file limit) and how long one with no
    # call stays (server_options.py); 0: no limit. Used when `connection` is None.
    max_connections: int | None = None
    max_connection_idle_s: float = DEFAULT_MAX_CONNECTION_IDLE_S
    # What may wait unsent for a stream its client does not read before the request is stopped
    # with RESOURCE_EXHAUSTED, in tokens (core_client.py); 0: no bound.
    max_unsent_tokens: int = DEFAULT_MAX_UNSENT_TOKENS
    # A stream (gRPC or HTTP) whose client takes nothing this long is ended and its request
    # stopped (servicer.py SendStallWatch); 0: never.
    send_stall_timeout_s: float = DEFAULT_SEND_STALL_TIMEOUT_S
    # How the HTTP API reads tool calls out of the model's text (tool_choice "auto";
    # openai_api/tool_parsers.py); None: "auto" with tools is refused.
    tool_call_parser: str | None = None
    # How it tells a chat reply's thinking from its answer (openai_api/reasoning_parsers.py);
    # None: all of it is content.
    reasoning_parser: str | None = None
    # A core silent this long with work to do is taken for hung and killed (core_client.py);
    # None: by the engine's device (60 s on a GPU, 600 s on a CPU).
    core_stall_timeout_s: float | None = None
    # The address routers reach us at, which the index link registers (--advertise-address);
    # "": the bound host and port (advertised_address).
    advertise_address: str = ""


class EngineServer:
    """The gRPC server around one engine: started and drained together.

    Two ways to hold the engine, one servicer for both: `core` (what pagedgen-engine runs) is
    an engine core in a process of its own (core_client.py), with its index link inside it;
    otherwise `engine` runs in this process on a thread of its own (or on the caller's with
    step_on_caller), and `index_link` (with the policy it steers already inside the engine) is
    optional: without it the engine runs on its local LRU."""

    def __init__(
        self,
        engine: LLMEngine | None,
        options: ServerOptions,
        index_link: IndexLink | None = None,
        metrics: EngineMetrics | None = None,
        step_on_caller: bool = False,
        core: CoreClient | None = None,
    ) -> None:
        self.options = options
        self.metrics = metrics or EngineMetrics()
        self.engine = engine
        if core is not None:
            core.on_dead, core.on_stats = self._on_dead, self._on_core_stats
            self.async_engine: AsyncEngine | CoreClient = core
            index_link = core.link
        else:
            # step_on_caller: the engine is stepped by whoever calls async_engine.run().
            self.async_engine = AsyncEngine(engine, on_step=self._on_step,
                                            own_thread=not step_on_caller,
                                            on_dead=self._on_dead)
        self.index_link = index_link
        self.servicer: GenerationServicer | None = None  # once the engine's facts are known
        if core is None:
            self.servicer = self._make_servicer(self.async_engine.info)
        if index_link is not None:
            self.metrics.watch_degraded(lambda: index_link.degraded)
        self.health = health_aio.HealthServicer()
        # No SO_REUSEPORT: a second process on our port must fail to bind, not share it (the
        # index tells a live engine from a crashed one by who answers at its address).
        gate = options.door.gate
        connection = options.connection or generation_limits(
            engine.max_model_len if engine is not None else served_context(core.options.config),
            options.max_live_requests, options.max_connections, options.max_connection_idle_s)
        # The key check first (a caller it refuses learns nothing of its request), then
        # requests that do not decode are refused as the client's error (wire_errors.py).
        # Both tell us what they refuse: requests_total counts those too.
        refused = self._count_refused_call
        interceptors = [GateInterceptor(gate, refused)] if gate.takes_keys else []
        self.server = grpc.aio.server(
            options=connection.options(),
            interceptors=[*interceptors, WireErrorInterceptor(refused)])
        self.port = 0
        self.http = (HttpServer(options.http_host, options.http_port, gate, options.tls,
                                require_client_cert=options.tls_client_cert,
                                send_stall_timeout_s=options.send_stall_timeout_s,
                                tool_call_parser=options.tool_call_parser,
                                reasoning_parser=options.reasoning_parser)
                     if options.http_port else None)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.engine_failed = asyncio.Event()  # set (on the loop) when the engine died
        self.grpc_started = False  # the gRPC server runs: stop() is what ends it
        self._metrics_server: MetricsServer | None = None  # stopped by stop()

    def _count_refused_call(self, method: str, code: grpc.StatusCode) -> None:
        """A generation request the interceptors refused (no valid key, bytes that did not
        decode) before the servicer saw it: counted as the servicer counts its own refusals,
        among the rejected and in requests_total, once."""
        if method in GENERATE_METHODS:
            self.metrics.requests_rejected.labels(code.name).inc()
            self.metrics.requests.labels(code.name).inc()

    def _make_servicer(self, info: EngineInfo,
                       tokenizers: tuple | None = None) -> GenerationServicer:
        """`tokenizers`: front_tokenizers' pair, loaded already (else loaded here)."""
        if tokenizers is None:
            tokenizers = front_tokenizers(info.model_config, info.limits.has_tokenizer)
        tokenizer, text_tokenizer = tokenizers
        self.async_engine.max_unsent_tokens = self.options.max_unsent_tokens
        if isinstance(self.async_engine, CoreClient):
            self.async_engine.tokenizer = tokenizer  # the core makes no text: we do
            stall_s = self.options.core_stall_timeout_s
            self.async_engine.stall_timeout_s = (default_stall_timeout_s(info.device)
                                                 if stall_s is None else stall_s)
            self.async_engine.stream_interval = self.options.stream_interval
        return GenerationServicer(
            self.async_engine,
            RequestValidator(info.limits, tokenizer, self.options.max_live_requests),
            self.metrics,
            self.options.engine_id,
            self.index_link,
            self.options.door,
            TextWorker(RequestValidator(info.limits, text_tokenizer,
                                        self.options.max_live_requests)),
            send_stall_timeout_s=self.options.send_stall_timeout_s,
        )

    def _on_dead(self, error: BaseException) -> None:
        """On the dying engine thread (or the loop, for a core process): NOT_SERVING at once, so
        load balancers stop sending."""
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._mark_failed)
            except RuntimeError:
                pass  # the loop is gone: the process is stopping anyway

    def _mark_failed(self) -> None:
        if self.servicer is not None:
            self.servicer.draining = True
        self.engine_failed.set()
        self._loop.create_task(self._set_health(NOT_SERVING))
        link = self.index_link
        if link is not None and hasattr(link, "close"):
            # Stop heartbeating: the index must not keep crediting blocks nobody can serve.
            self._loop.create_task(asyncio.to_thread(link.close))
        log.error("the engine died: health NOT_SERVING, stopping")

    def _on_step(self, engine: LLMEngine, outputs: list) -> None:
        # On the engine thread, before the step's outputs are delivered: refresh the gauges
        # while busy (throttled), and whenever a request finished or the engine goes idle, so
        # a finished request is never still counted as running by a scrape after its reply.
        self.metrics.refresh(engine.stats,
                             force=not outputs or any(o.finished for o in outputs))

    def _on_core_stats(self, stats: EngineStats, force: bool) -> None:
        # On the loop, as a core process's step arrives (before its outputs are read).
        self.metrics.refresh(lambda: stats, force=force)

    async def start(self) -> int:
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [
                SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ],
            self.server,
        )
        address = join_host_port(self.options.host, self.options.port)
        tls = self.options.tls
        credentials = tls.server_credentials(self.options.tls_client_cert) if tls else None
        self.port = bind_grpc(self.server, address, credentials)
        if self.http is not None:  # bound now, served once the servicer exists
            self.http.bind()
        if self.options.metrics_port:
            # Before the engine thread and the server start: a port in use fails here, with
            # nothing running yet to stop.
            self._metrics_server = serve_metrics(self.metrics.registry,
                                                 self.options.metrics_port,
                                                 self.options.metrics_host)
        self._loop = asyncio.get_running_loop()
        if self.servicer is None:  # a core process: built (model, profile, warm-up) first
            # Our tokenizers load meanwhile, on a thread (about 0.7 s of every start, most of
            # it importing transformers; a GGUF file's take ~10 s): the core's start runs in
            # another process.
            config = self.async_engine.options.config
            loading = _in_daemon_thread(front_tokenizers, config.model,
                                        not config.skip_tokenizer_init)
            # A signal or the core's failure meanwhile is raised at once: the load is left to
            # its daemon thread (what it makes or raises goes unread), so neither the exit
            # nor the core's error waits for it.
            info = await self.async_engine.start()
            self.servicer = self._make_servicer(info, await asyncio.wrap_future(loading))
        else:
            self.async_engine.start()
        pb_grpc.add_GenerationServicer_to_server(self.servicer, self.server)
        # grpc's health servicer says SERVING for "" from the start: not before we do.
        await self._set_health(NOT_SERVING)
        await self.server.start()
        self.grpc_started = True
        # Routers read ModelInfo and EngineStats over gRPC once the index lists us; the HTTP
        # front, whose /health says 200 once it runs, waits with health.
        await self._register_with_the_index()
        if self.engine_failed.is_set():
            return self.port  # the core died meanwhile: NOT_SERVING stays, the caller stops
        if self.http is not None:
            await self.http.start(engine_backend(self.servicer))
        await self._set_health(SERVING)
        log.info("engine serving on %s:%d", self.options.host, self.port)
        return self.port

    async def _register_with_the_index(self) -> None:
        """A core's index link registers the address routers reach us at, now that we serve
        there, and the instance id our ModelInfo answers with. Health says SERVING once its
        first round has ended: the index lists a replica once its health passes, and the first
        requests' prefixes reach the index as they are cached. An index that cannot be reached
        (the link serves on the local LRU, degraded) or answers slowly delays it at most
        FIRST_REGISTRATION_WAIT_S; the core dying ends the wait."""
        link = self.index_link
        if not isinstance(self.async_engine, CoreClient) or link is None:
            return  # an in-process engine's link is started by whoever made it
        address = advertised_address(self.options.advertise_address, self.options.host,
                                     self.port)
        self.async_engine.start_link(address, self.servicer.instance_id)
        until = time.monotonic() + FIRST_REGISTRATION_WAIT_S
        while (link.health_details().get("state") == "starting"
               and not self.engine_failed.is_set()):
            if time.monotonic() >= until:
                log.warning("the prefix index has not answered the engine's registration in "
                            "%.0f s: serving meanwhile; the link keeps trying",
                            FIRST_REGISTRATION_WAIT_S)
                return
            await asyncio.sleep(0.01)

    async def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)

    async def stop(self, grace_s: float = 30.0) -> None:
        """Health NOT_SERVING and new requests refused first; in-flight requests get up to
        grace_s to finish; what is left is cancelled (and aborted in the engine)."""
        deadline = time.monotonic() + grace_s
        if self.servicer is not None:
            self.servicer.draining = True
        await self._set_health(NOT_SERVING)
        while self.async_engine.num_live and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self.async_engine.num_live:
            log.warning("%d requests still live after %.1fs: cancelling them",
                        self.async_engine.num_live, grace_s)
            # Each stream ends with a status that says why (grpc.aio's own stop would say only
            # "Cancelling all calls"), its request stopped in the engine; a moment to send it.
            self.async_engine.cut_live(RequestRejected(
                grpc.StatusCode.UNAVAILABLE,
                f"the engine is shutting down: this request was still running when its drain "
                f"(--grace-s {grace_s:g}) ended, and was stopped; retry it on another engine"))
            cut_until = time.monotonic() + CUT_SEND_S
            while self.async_engine.num_live and time.monotonic() < cut_until:
                await asyncio.sleep(0.02)
        # Both fronts together: each can wait on a client that takes no bytes (gRPC: for the
        # keepalive timeout; STOP_AFTER_DRAIN_S counts one such wait, not two).
        left_s = max(0.5, deadline - time.monotonic())
        fronts = [self.server.stop(left_s)]
        if self.http is not None:
            fronts.append(self.http.stop(left_s))
        await asyncio.gather(*fronts)
        await self.async_engine.stop()
        if self.servicer is not None and self.servicer.text_worker is not None:
            self.servicer.text_worker.close()
        if self._metrics_server is not None:  # its port and threads, back for the next server
            await asyncio.to_thread(self._metrics_server.stop)
            self._metrics_server = None

    async def wait(self) -> None:
        await self.server.wait_for_termination()


def _in_daemon_thread(fn: Callable[..., T], *args) -> concurrent.futures.Future[T]:
    """fn(*args) on a daemon thread of its own: unlike asyncio.to_thread's executor, nothing
    waits for it at exit."""
    done: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        try:
            done.set_result(fn(*args))
        except BaseException as error:  # noqa: BLE001 - handed to whoever awaits it
            done.set_exception(error)

    threading.Thread(target=run, name="front-tokenizers", daemon=True).start()
    return done


def front_tokenizers(model: str | Path | ModelConfig, has_tokenizer: bool) -> tuple:
    """The servicer's tokenizer (prompts; a core's outputs are detokenized with it on the event
    loop) and the text worker's (Tokenize / Detokenize on a thread of their own, text_worker.py):
    one object each, since HF fast tokenizers are not safe across threads; (None, None)
    without one."""
    if not has_tokenizer:
        return None, None
    config = model if isinstance(model, ModelConfig) else load_model_config(model)
    return load_tokenizer(config), load_tokenizer(config)


def advertised_address(advertise_address: str, host: str, port: int) -> str:
    """The address routers reach this engine at: --advertise-address, else the bound host
    (this machine's hostname when bound to every interface, as in a container)."""
    if advertise_address:
        return advertise_address
    if host in ("0.0.0.0", "::", "[::]", ""):
        host = socket.gethostname()
    return join_host_port(host, port)


def parse_bytes(text: str) -> int:
    """'1073741824', '512MiB', '1G' -> bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(?:i?[bB])?\s*", text)
    if not match:
        raise argparse.ArgumentTypeError(f"expected bytes like 1073741824, 512MiB or 1G, "
                                         f"got {text!r}")
    return int(float(match.group(1)) * _BYTE_UNITS[match.group(2).lower()])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    d = EngineConfig(model="")
    p = argparse.ArgumentParser(prog="pagedgen-engine", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None,
                   help="local HF directory or GGUF file (default: SmolLM2-135M-Instruct, "
                        "prepared into the cache)")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients call the model by (ModelInfo, the HTTP API); with a "
                        "fingerprint of the weights it seeds block hashes, so replicas that "
                        "mount one checkpoint at different paths share prefixes (default: the "
                        "model directory's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for all)")
    p.add_argument("--port", type=int, default=50051, help="gRPC port (0 = any free port)")
    p.add_argument("--advertise-address", default="",
                   help="host:port routers reach this engine at, registered with the prefix "
                        "index (default: the bound host, or the hostname when bound to all, "
                        "and the bound port)")
    p.add_argument("--device", default=d.device, choices=DEVICES)
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="auto: bfloat16 on CPUs with native bf16 matmul, else float32; on CUDA "
                        "the checkpoint's dtype")
    p.add_argument("--kernel-backend", default=d.kernel_backend,
                   choices=["auto", "torch", "triton"])
    p.add_argument("--block-size", type=int, default=d.block_size, choices=BLOCK_SIZES)
    p.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks")
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=None,
                   help="KV pool size in bytes (512MiB, 2G, ...)")
    p.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization)
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--no-defer-shared-prefill", action="store_true",
                   help="admit a request whose prefix a running request is computing in the "
                        "same step (it computes the prefix again) instead of a step later")
    p.add_argument("--preemption-mode", default=d.preemption_mode, choices=PREEMPTION_MODES)
    p.add_argument("--swap-space", type=parse_bytes, default=d.swap_space,
                   help="CPU KV bytes for swapped-out sequences (swap mode)")
    p.add_argument("--pin-budget-floor", type=float, default=d.pin_budget_floor,
                   help="pins (explicit and automatic) may always hold this share of the pool")
    p.add_argument("--pin-budget-ceiling", type=float, default=d.pin_budget_ceiling,
                   help="pins never hold more than this share of the pool; between floor and "
                        "ceiling they get what the running requests' peak demand leaves")
    p.add_argument("--pin-budget-window-s", type=float, default=d.pin_budget_window_s,
                   help="how long a peak of demand holds the pin budget down")
    p.add_argument("--tensor-parallel-size", type=int,
                   default=os.environ.get(TP_SIZE_ENV) or d.tensor_parallel_size,
                   help="ranks the model is split over (heads, MLP columns, vocabulary): this "
                        "engine and N-1 worker processes, NCCL on CUDA, gloo on the CPU, one "
                        f"torch thread a rank on the CPU (env {TP_SIZE_ENV})")
    p.add_argument("--tensor-parallel-timeout-s", type=float,
                   default=d.tensor_parallel_timeout_s,
                   help="a collective that does not return within this fails the engine "
                        "(a hung rank): NOT_SERVING and exit, never a hang")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--skip-tokenizer-init", action="store_true",
                   help="load no tokenizer: token-id input and output only")
    p.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: run every step eagerly, without CUDA graphs (decode and "
                        "mixed steps)")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="torch threads in the engine core (default: on the CPU, one a CPU this "
                        "process may use: its affinity and cgroup quota, or OMP_NUM_THREADS; "
                        "on CUDA, torch's choice; 0: torch's choice)")
    p.add_argument("--grammar-compile-timeout-s", type=float,
                   default=DEFAULT_COMPILE_TIMEOUT_S,
                   help="a request's structured outputs (JSON Schema, regex, grammar) that do "
                        "not compile within this are refused with INVALID_ARGUMENT, the "
                        "compilation stopped")
    p.add_argument("--max-live-requests", type=int, default=ServerOptions().max_live_requests,
                   help="requests accepted and unfinished before RESOURCE_EXHAUSTED")
    p.add_argument("--stream-interval", type=int, default=ServerOptions().stream_interval,
                   help="streamed messages carry this many new tokens each (the first tokens "
                        "and the last message go at once): fewer messages, less CPU a token")
    p.add_argument("--max-unsent-tokens", type=int,
                   default=ServerOptions().max_unsent_tokens,
                   help="a stream whose client does not read it is stopped (RESOURCE_EXHAUSTED, "
                        "the request aborted) once this many tokens, each top logprob counted "
                        "as one more, wait unsent for it; a reader that pauses gets them merged "
                        "into one message (0: no bound)")
    add_send_stall_arg(p)
    p.add_argument("--core-stall-timeout-s", type=float, default=None,
                   help="an engine core that sends nothing this long while it has requests "
                        "(one step that never returns) is killed and the server exits 1, as "
                        "when the core dies (default 60 on a GPU, 600 on a CPU; 0: never)")
    p.add_argument("--prefix-index", default="none",
                   help="HOST:PORT of the prefix index, or 'none' for a local LRU only")
    p.add_argument("--index-lease-s", type=float, default=IndexLinkOptions().lease_s,
                   help="the index forgets this engine (and routers stop crediting it) this "
                        "long after its last heartbeat; a restart under the same --engine-id "
                        "waits for it")
    p.add_argument("--engine-id", default=None,
                   help="this engine's id at the prefix index (default: HOSTNAME-PORT, or -PID "
                        "with --port 0)")
    add_http_args(p, routed=False)
    add_tenancy_args(p)
    add_tls_args(p, server_only_option=True)
    add_metrics_args(p)
    add_connection_args(p)
    p.add_argument("--grace-s", type=float, default=30.0,
                   help="on SIGTERM, how long in-flight requests get to finish")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = p.parse_args(argv)
    resolve_metrics_host(args)
    resolve_connection_args(p, args)
    if args.max_live_requests < 1:
        p.error(f"--max-live-requests must be >= 1, got {args.max_live_requests}")
    if not 1 <= args.stream_interval <= 1024:
        p.error(f"--stream-interval must be in [1, 1024] tokens, got {args.stream_interval}")
    if args.max_unsent_tokens < 0:
        p.error(f"--max-unsent-tokens must be >= 0 (0: no bound), got {args.max_unsent_tokens}")
    if not 0 <= args.send_stall_timeout_s <= 86400:
        p.error(f"--send-stall-timeout-s must be in [0, 86400] seconds (0: never), got "
                f"{args.send_stall_timeout_s}")
    if args.core_stall_timeout_s is not None and not 0 <= args.core_stall_timeout_s <= 86400:
        p.error(f"--core-stall-timeout-s must be in [0, 86400] seconds (0: never), got "
                f"{args.core_stall_timeout_s}")
    if args.torch_threads is not None and args.torch_threads < 0:
        p.error(f"--torch-threads must be >= 0 (0: torch's default), got {args.torch_threads}")
    if not 0 < args.grammar_compile_timeout_s <= 3600:
        p.error(f"--grammar-compile-timeout-s must be in (0, 3600] seconds, got "
                f"{args.grammar_compile_timeout_s}")
    if args.grace_s < 0:
        p.error(f"--grace-s must be >= 0, got {args.grace_s}")
    resolve_http_args(p, args)
    resolve_tenancy_args(p, args)
    resolve_tls_args(p, args)
    if args.tls_server_only and args.tls is None:
        p.error("--tls-server-only: needs TLS (--tls-cert, --tls-key, --tls-ca)")
    if args.prefix_index != "none" and not re.fullmatch(r"[^\s:]+:\d{1,5}", args.prefix_index):
        p.error(f"--prefix-index must be HOST:PORT or none, got {args.prefix_index!r}")
    return args


def engine_config_from_args(args: argparse.Namespace, model: str) -> EngineConfig:
    return EngineConfig(
        model=model,
        served_model_name=args.served_model_name,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        device=args.device,
        dtype=args.dtype,
        kernel_backend=args.kernel_backend,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        defer_shared_prefill=not args.no_defer_shared_prefill,
        preemption_mode=args.preemption_mode,
        swap_space=args.swap_space,
        pin_budget_floor=args.pin_budget_floor,
        pin_budget_ceiling=args.pin_budget_ceiling,
        pin_budget_window_s=args.pin_budget_window_s,
        tensor_parallel_size=args.tensor_parallel_size,
        tensor_parallel_timeout_s=args.tensor_parallel_timeout_s,
        seed=args.seed,
        skip_tokenizer_init=args.skip_tokenizer_init,
        enforce_eager=args.enforce_eager,
    )


def served_context(config: EngineConfig) -> int:
    """The context the engine will serve (as LLMEngine computes it), read from the model's
    config now: the server's message size limit is set before the core loads the model."""
    longest = load_model_config(config.model).longest_context()
    return min(config.max_model_len or longest, longest)


async def _serve(args: argparse.Namespace, options: ServerOptions, core_options: CoreOptions,
                 metrics: EngineMetrics, core_target: CoreTarget) -> bool:
    """Serves until SIGTERM / SIGINT has drained the server, or the engine core died (then
    True)."""
    core = CoreClient(core_options, core_target=core_target,
                      on_rpc=lambda method, s: metrics.index_rpc_seconds.labels(method).observe(s))
    server = EngineServer(None, options, metrics=metrics, core=core)
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    if args.keyring is not None:
        args.keyring.reload_on_sighup(loop)
    # A signal during start-up (the model load can take minutes) stops it there.
    starting = asyncio.ensure_future(server.start())
    stop_asked = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait([starting, stop_asked], return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        starting.cancel()
        await core.stop()
        raise
    if not starting.done():
        starting.cancel()
        log.info("stopped during start-up")
        if server.grpc_started:  # (waiting for the index link's first round)
            await server.stop(0.0)
        else:
            await core.stop()
        return False
    stop_asked.cancel()
    try:
        port = starting.result()
    except BaseException:
        await core.stop()
        raise
    if server.engine_failed.is_set():  # the core died during start-up: no port to announce
        await server.stop(0.0)
        return True
    # One line on stdout that launchers read to learn the port (--port 0).
    print(f"engine listening on {join_host_port(args.host, port)}", flush=True)
    if server.http is not None:
        print(f"engine HTTP API on {server.http.scheme}://"
              f"{join_host_port(args.http_host, server.http.port)}", flush=True)
    waiters = [asyncio.ensure_future(stopping.wait()),
               asyncio.ensure_future(server.engine_failed.wait())]
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    for waiter in waiters:
        waiter.cancel()
    log.info("draining (grace %.1fs, %d live requests)", args.grace_s, core.num_live)
    await server.stop(args.grace_s)
    log.info("stopped")
    return core.dead is not None


def serve(args: argparse.Namespace, core_target: CoreTarget = run_core) -> None:
    """Serve gRPC on this process's event loop, with the engine core (the model, the step loop
    and the prefix-index link) in a process of its own, until SIGTERM / SIGINT has drained
    both; exit 1 when the core died."""
    model = args.model
    if model is None:
        from engine_service.tools.prepare_model import ensure_default_model

        model = str(ensure_default_model())
    config = engine_config_from_args(args, model)
    config.detokenize = False  # the front makes the text (serving/output_text.py)
    engine_id = args.engine_id or f"{socket.gethostname()}-{args.port or os.getpid()}"
    # The prefix index link (engine_service/index/link.py) installs its policy in the engine's
    # pool, in the core, and reports `degraded` / `health_details()` with each step; None for
    # --prefix-index none (the local LRU alone).
    core_options = CoreOptions(
        config, None if args.prefix_index == "none" else args.prefix_index, engine_id,
        IndexLinkOptions(lease_s=args.index_lease_s, tls=args.tls), args.log_level,
        args.torch_threads, args.grammar_compile_timeout_s)
    options = ServerOptions(args.host, args.port, args.metrics_port, args.metrics_host,
                            args.max_live_requests, engine_id, args.http_port, args.http_host,
                            args.stream_interval, door=door_from_args(args), tls=args.tls,
                            tls_client_cert=not args.tls_server_only)
    options.max_unsent_tokens = args.max_unsent_tokens
    options.send_stall_timeout_s = args.send_stall_timeout_s
    options.tool_call_parser = args.tool_call_parser
    options.reasoning_parser = args.reasoning_parser
    options.core_stall_timeout_s = args.core_stall_timeout_s
    options.max_connections = args.max_connections
    options.max_connection_idle_s = args.max_connection_idle_s
    options.advertise_address = args.advertise_address
    warn_if_plain_text("pagedgen-engine", args.tls)
    if asyncio.run(_serve(args, options, core_options, EngineMetrics(), core_target)):
        sys.exit(1)


def main(argv: list[str] | None = None, core_target: CoreTarget = run_core) -> None:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level, stream=sys.stderr,
        format="%(asctime)s level=%(levelname)s logger=%(name)s msg=%(message)s")
    try:
        serve(args, core_target)
    except ValueError as error:  # a bad model path or engine setting: say it, no traceback
        log.error("%s", error)
        sys.exit(2)
    except BindError as error:  # a port in use
        log.error("cannot serve: %s", error)
        sys.exit(1)


if __name__ == "__main__":
    main()
