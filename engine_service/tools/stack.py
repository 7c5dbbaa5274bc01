"""pagedgen-stack: the whole stack on this machine, no Docker.

Redis, the prefix index and the engine on the default model, each a real process on a free
loopback port (the OpenAI-compatible HTTP API on port 8000); then one chat prompt streamed
through the generated gRPC stubs, printed as the deltas arrive; then a clean shutdown: the
router, the engines (drained), the index, then Redis. SIGTERM, a terminal's Ctrl-C or its
closing (SIGHUP) at any point stops what it started in that order (each service runs in a
session of its own, which the terminal's signals do not reach); a SIGKILLed stack takes its
services with it (Linux).

    pagedgen-stack [--prompt TEXT] [--max-tokens N] [--keep-running]
    pagedgen-stack --replicas 3    # three engines behind pagedgen-router; streamed through it

Secure by default: a development CA and a certificate per service (trust/certs.py) under the log
folder's certs/; the index and the engines talk mutual TLS, the front door serves TLS, and the
stack prints the CA file clients verify it with. --insecure runs everything in plain text.
Without --log-dir, all of it (keys included) lives in a temporary folder removed on exit; a
failed run keeps its logs there, its keys and certificates removed; the folder of a stack
that was killed (SIGKILL) is removed by the next stack this user starts (a live stack holds a
lock on its own, seen from any pid namespace sharing /tmp), and its Redis's work folder
(pagedgen-redis-*, no secrets) by the next Redis started, a stack's or a test's.

The front door takes API keys: a key file of the stack's own (one tenant allowed everything,
its key printed) unless --api-key-file names yours (then --api-key is the one the stack's own
request sends); every engine and the router share one --tenant-secret-file. Redis asks for a
random password, which the index alone is given, in its environment (not on a command line).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import secrets
import signal
import sys
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import TypeVar

import grpc

from engine_service.serving.torch_threads import usable_cpus
from engine_service.tools.launch import EngineProcess
from engine_service.tools.off_main_thread import run_off_main_thread
from openai_api.reasoning_parsers import PARSERS as REASONING_PARSERS
from openai_api.tool_parsers import PARSERS
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from prefix_index.server.redis_url import redacted_url
from prefix_index.tools.launch import IndexProcess
from prefix_index.tools.locked_folders import (
    make_temporary,
    remove_abandoned_folders,
    remove_temporary,
)
from prefix_index.tools.redis_process import (
    RedisProcess,
    find_redis_server,
    free_port,
    is_free,
)
from prefix_index.tools.server_process import ServerProcess
from router.tools.launch import RouterProcess
from tenancy.client import with_api_key
from tenancy.keys_tool import add_key
from trust.certs import ensure_ca, ensure_leaf
from trust.credentials import TlsFiles, end_client_channel

log = logging.getLogger("engine_service.tools.stack")
DEFAULT_HTTP_PORT = 8000  # vLLM's: OpenAI clients and examples expect it
DEFAULT_PROMPT = "What is a KV cache in a language model? Answer in two sentences."
T = TypeVar("T")
START_TIMEOUT_S = 120.0  # for one engine to load its model and serve
FAILED = 1  # a service failed: a temporary log folder keeps its logs


class Stopped(Exception):
    """SIGINT, SIGTERM or SIGHUP: raised in the main thread so that run() unwinds, stopping what it
    started (a signal's default action would leave every child running, orphaned)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# Ctrl-C, SIGTERM, and SIGHUP (the terminal closed): each stops the services in order. The
# services run in sessions of their own, so a terminal's signals reach the stack alone.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StopSignals:
    """The stack's handlers of STOP_SIGNALS, and what they need of the terminal it started in.

    After a hang-up a terminal's writes fail (EIO), and the kernel makes them fail before it
    sends SIGHUP: isatty() is already False in the handler, so which of fds 1 and 2 were the
    terminal is recorded at start-up. On SIGHUP /dev/null is put under those fds (dup2), so
    that what the stack says while it stops the services goes nowhere instead of ending it
    half way; print() and logging handlers holding the old stream objects write to it too."""

    def __init__(self) -> None:
        self.terminal_fds = [fd for fd in (1, 2) if os.isatty(fd)]
        # Opened now: the handler then needs no free descriptor, nor a file system, to do it.
        self._devnull = (os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
                         if self.terminal_fds else None)

    def raise_stopped(self, signum: int, _frame) -> None:
        if signum == signal.SIGHUP:
            self.leave_closed_terminal()
        raise Stopped(signum)

    def note_second_signal(self, signum: int, _frame) -> None:
        # Raised here, it would cut a child's drain short and leave that child running.
        if signum == signal.SIGHUP:
            self.leave_closed_terminal()
        print(f"{signal.Signals(signum).name}: already stopping, waiting for the services to "
              f"exit", file=sys.stderr, flush=True)

    def leave_closed_terminal(self) -> None:
        if self._devnull is None:
            return
        for fd in self.terminal_fds:
            os.dup2(self._devnull, fd)

    def close(self) -> None:
        if self._devnull is not None:
            os.close(self._devnull)
            self._devnull = None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pagedgen-stack", description=__doc__.split("\n\n")[0],
                                epilog="Ctrl-C or SIGTERM stops every service it started, "
                                       "at any point.")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="the user message to complete")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--model", default=None,
                   help="local HF directory or GGUF file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--replicas", type=int, default=1,
                   help="engines; more than 1 puts pagedgen-router in front of them")
    p.add_argument("--engine-port", type=int, default=0,
                   help="0 = a free port (with --replicas > 1: the router's port)")
    p.add_argument("--index-port", type=int, default=0, help="0 = a free port")
    p.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT,
                   help="the OpenAI-compatible HTTP API of the stack's front door (the router "
                        "with --replicas > 1, else the engine); 0 = a free port, -1 = off")
    p.add_argument("--tool-call-parser", choices=PARSERS, default=None,
                   help="the front door's tool-call parser for chat's tool_choice \"auto\" "
                        "(as pagedgen-engine's: hermes, llama3_json, mistral or pythonic); "
                        "default: none")
    p.add_argument("--reasoning-parser", choices=REASONING_PARSERS, default=None,
                   help="the front door's reasoning parser: chat replies' thinking apart, in "
                        "reasoning_content (as pagedgen-engine's: qwen3 or deepseek_r1); "
                        "default: none")
    p.add_argument("--metrics-port", type=int, default=0, help="engine Prometheus port (0 = off)")
    p.add_argument("--keep-running", action="store_true",
                   help="after the completion, serve until Ctrl-C / SIGTERM")
    p.add_argument("--log-dir", type=Path, default=None,
                   help="where the logs, certificates and keys go (default: a temporary folder, "
                        "removed on exit; a failed run keeps its logs there)")
    p.add_argument("--api-key-file", type=Path, default=None,
                   help="the front door's keys and tenants (pagedgen-keys add); default: a "
                        "file of one new key, printed, in the log folder")
    p.add_argument("--api-key", default=None,
                   help="with --api-key-file: a key of it, for the stack's own request")
    p.add_argument("--insecure", action="store_true",
                   help="plain text everywhere, no certificates (logs a warning)")
    p.add_argument("--tenant-secret-file", type=Path, default=None,
                   help="the secret tenants' cache salts are derived with, for every engine "
                        "and the router (default: a new one in the log folder)")
    args = p.parse_args(argv)
    if (args.api_key_file is None) != (args.api_key is None):
        p.error("give --api-key-file and --api-key (a key of that file, for the stack's own "
                "request) together, or neither (the stack makes a key)")
    if args.max_tokens < 1:
        p.error(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if not 1 <= args.replicas <= 16:
        p.error(f"--replicas must be in 1..16, got {args.replicas}")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        p.error(f"--temperature must be a finite number >= 0 (0 = greedy), got "
                f"{args.temperature}")
    if not -1 <= args.http_port <= 65535:
        p.error(f"--http-port must be in [-1, 65535] (0 = a free port, -1 = off), got "
                f"{args.http_port}")
    for flag, port in (("--engine-port", args.engine_port), ("--index-port", args.index_port)):
        if not 0 <= port <= 65535:
            p.error(f"{flag} must be in [0, 65535] (0 = a free port), got {port}")
    if args.metrics_port and not 1 <= args.metrics_port <= 65536 - args.replicas:
        p.error(f"--metrics-port must be in [1, {65536 - args.replicas}] (engine i serves on "
                f"it + i; 0 = off), got {args.metrics_port}")
    if args.model is not None and not Path(args.model).exists():
        p.error(f"--model must be a local HF directory or GGUF file; {args.model!r} does not "
                f"exist (leave it out for the default model)")
    check_ports_free(p, args)
    return args


def check_ports_free(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Each port asked for by number is free now, else exit 2 naming its flag before anything
    starts (a taken one failed a service's start, its log naming no flag of ours). The default
    --http-port 8000 is the one a second stack on this machine finds taken."""
    asked = [("--engine-port", args.engine_port, "0 = a free port"),
             ("--index-port", args.index_port, "0 = a free port"),
             ("--http-port", args.http_port, "0 = a free port, -1 = off")]
    if args.metrics_port:
        asked += [("--metrics-port", args.metrics_port + i, "0 = off")
                  for i in range(args.replicas)]
    for flag, port, allowed in asked:
        if port > 0 and not is_free("127.0.0.1", port):
            p.error(f"{flag} {port}: 127.0.0.1:{port} is in use (another pagedgen-stack?); "
                    f"give a free port ({allowed})")


def replica_threads(device: str, replicas: int, environ) -> list[str]:
    """--torch-threads for each of `replicas` CPU engines on this machine: its CPUs shared out
    (each engine alone would compute on all of them, and several spinning on the same cores
    wait at every op for each other). Nothing for one engine, on CUDA, or with OMP_NUM_THREADS
    set (the engines honour it)."""
    if device != "cpu" or replicas <= 1 or environ.get("OMP_NUM_THREADS"):
        return []
    return ["--torch-threads", str(max(1, usable_cpus() // replicas))]


def stream_completion(target: str, prompt: str, max_tokens: int, temperature: float,
                      out=sys.stdout, api_key: str | None = None,
                      ca: bytes | None = None) -> pb.Usage:
    """One chat prompt through GenerateStream; deltas printed as they arrive."""
    request = pb.GenerateRequest(
        chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=prompt)]),
        sampling=pb.SamplingParams(temperature=temperature, max_tokens=max_tokens),
    )
    calls: list[grpc.Future] = []  # the stream's call, once made
    stopping = False

    def stream() -> pb.Usage:
        usage = pb.Usage()
        with with_api_key(end_client_channel(target, ca), api_key) as channel:
            call = pb_grpc.GenerationStub(channel).GenerateStream(request, timeout=600)
            calls.append(call)
            if stopping:  # (stopped while the call was being made)
                call.cancel()
            for chunk in call:
                for choice in chunk.choices:
                    out.write(choice.text)
                    out.flush()
                usage = chunk.usage
        out.write("\n")
        return usage

    def stop() -> None:  # the call is cancelled, its thread closes the channel
        nonlocal stopping
        stopping = True
        for call in calls:
            call.cancel()

    # A stop signal mid-stream must not land inside grpc's code (off_main_thread.py says why).
    return run_off_main_thread(stream, stop, "stack-completion")


def off_main_thread(wait: Callable[[threading.Event], T], name: str) -> T:
    """wait(stopped) run on a thread of its own, `stopped` set when a stop signal interrupts
    it: the service waits poll with gRPC calls, which a stop signal must not cut half way
    (off_main_thread.py)."""
    stopped = threading.Event()
    return run_off_main_thread(lambda: wait(stopped), stopped.set, name)


def wait_all_serving(processes: list[ServerProcess], stopped: threading.Event) -> None:
    """Until every process serves, each waited for on a thread of its own: the first to fail
    (exited, or not serving in its time) stops the others' waits and is raised, at once, not
    after those started before it have loaded."""
    failures: list[BaseException] = []
    failed = threading.Event()

    def wait(process: ServerProcess) -> None:
        try:
            process.wait_serving(failed)
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            failures.append(error)
            failed.set()

    threads = [threading.Thread(target=wait, args=(p,), name=f"wait-{p.name}", daemon=True)
               for p in processes]
    for thread in threads:
        thread.start()
    while any(t.is_alive() for t in threads):
        if stopped.is_set():
            failed.set()  # (a stop: every wait returns)
        for thread in threads:
            thread.join(0.05)
    if failures:
        raise failures[0]


def wait_for_replicas(target: str, count: int, api_key: str, ca: bytes | None,
                      stopped: threading.Event, timeout_s: float = 30.0) -> None:
    """Until the router routes to all `count` engines (it learns them from the index), or
    `stopped` is set. Read from EngineStats, which a key of the operator's reads
    (may_read_stats, as the stack's own key); with a tenant's key that may not, the router
    serving (one replica) is enough."""
    deadline = time.monotonic() + timeout_s
    with with_api_key(end_client_channel(target, ca), api_key) as channel:
        stub = pb_grpc.GenerationStub(channel)
        while not stopped.is_set():
            try:
                details = stub.EngineStats(pb.EngineStatsRequest(), timeout=5).index_details
            except grpc.RpcError as error:
                if error.code() != grpc.StatusCode.PERMISSION_DENIED:
                    raise
                log.warning("the --api-key may not read EngineStats (may_read_stats): not "
                            "waiting for all %d replicas to be routed to", count)
                return  # the router was started serving: it routes to one replica at least
            if int(details.get("replicas_routable", "0")) >= count:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"router at {target}: {count} replicas expected, "
                                   f"got {dict(details)}")
            stopped.wait(0.1)


def print_how_to_connect(target: str, certs: Path | None, api_key: str) -> None:
    if certs is None:
        print(f"tls           off (--insecure): grpcurl -plaintext -H 'authorization: Bearer "
              f"{api_key}' {target} list", flush=True)
        return
    print(f"tls           CA {certs / 'ca.pem'}  (clients verify the stack with it; services' "
          f"certificates and keys beside it)", flush=True)
    print(f"grpcurl       grpcurl -cacert {certs / 'ca.pem'} -H 'authorization: Bearer "
          f"{api_key}' {target} list", flush=True)


def wait_for_signal() -> None:
    """Until a stop signal: run() has them raise Stopped, which ends this."""
    while True:
        # Not signal.pause(): a signal landing just before it would be handled only at the
        # next one. A sleep is cut short by the signal, or ends and runs the handler.
        time.sleep(0.5)


def run(args: argparse.Namespace) -> int:
    """Start, stream, (serve,) stop; the exit code. SIGINT / SIGTERM / SIGHUP stop every service,
    newest first, at any point (before the completion: 128 + the signal's number)."""
    remove_abandoned_folders()
    try:  # before anything starts or is written: none found is a set-up problem
        redis_binary = find_redis_server()
    except FileNotFoundError as error:
        raise RuntimeError(f"{error} (bash scripts/setup.sh installs one)") from None
    handlers = StopSignals()
    previous = {sig: signal.signal(sig, handlers.raise_stopped) for sig in STOP_SIGNALS}
    temporary = args.log_dir is None
    if temporary:
        log_dir, lock_fd = make_temporary()
    else:
        log_dir = args.log_dir
    code = FAILED
    try:
        code = _run(args, log_dir, redis_binary, handlers)
    except Stopped as stopped:
        print(f"\nstopped by {stopped} before the stack was done; every service stopped",
              file=sys.stderr, flush=True)
        code = 128 + stopped.signum
    finally:
        for sig in previous:
            signal.signal(sig, handlers.note_second_signal)
        if temporary:
            remove_temporary(log_dir, lock_fd,
                              keep_logs=code == FAILED and any(log_dir.glob("*.log")))
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        handlers.close()
    return code


def _run(args: argparse.Namespace, log_dir: Path, redis_binary: str,
         handlers: StopSignals) -> int:
    model = args.model
    if model is None:
        from engine_service.tools.prepare_model import ensure_default_model

        print("preparing the default model (converted once, then cached) ...", flush=True)
        model = str(ensure_default_model(quiet=False))
    log_dir.mkdir(parents=True, exist_ok=True)
    key_file, api_key = args.api_key_file, args.api_key
    if key_file is None:
        key_file = log_dir / "api-keys.toml"
        key_file.unlink(missing_ok=True)  # (a log folder used before: one key, this run's)
        api_key = add_key(key_file, "stack", "pagedgen-stack", {
            "may_set_priority": True, "max_live_requests": -1, "max_pins": -1,
            "may_read_stats": True})
    secret_file = args.tenant_secret_file
    if secret_file is None:
        secret_file = log_dir / "tenant-secret"
        secret_file.touch(mode=0o600)
        secret_file.write_text(secrets.token_hex(32))
    tenancy_args = ["--tenant-secret-file", str(secret_file)]
    door_args = ["--api-key-file", str(key_file)]  # the front door's: the router, or the engine
    certs = None if args.insecure else log_dir / "certs"
    # Plain text is asked for by name, each service told so (and each logs its warning).
    plain = ["--insecure"] if certs is None else []
    if certs is None:
        log.warning("pagedgen-stack --insecure: every service in PLAIN TEXT")
    stack_id = free_port()
    engine_ids = [f"stack-{stack_id}-{i}" for i in range(args.replicas)]

    def tls_files(role: str, engine_id: str | None = None) -> TlsFiles | None:
        if certs is None:
            return None
        issued = ensure_leaf(certs, role, engine_id)
        return TlsFiles(issued.cert, issued.key, certs / "ca.pem")

    ca = None if certs is None else ensure_ca(certs).cert.read_bytes()
    started = time.monotonic()
    with ExitStack() as stack:
        # Each stop is registered before its start: a signal during a start still stops it.
        # Any local user reaches loopback: without a password, the index's state was theirs
        # to read and rewrite. On stdin, as the index's URL goes in its environment: `ps`
        # shows every user each process's command line.
        redis = RedisProcess(binary=redis_binary, password=secrets.token_urlsafe(32),
                             password_on_stdin=True, own_session=True)
        stack.callback(redis.stop)
        redis.start()
        print(f"redis         {redacted_url(redis.url)}", flush=True)
        index = IndexProcess(redis.url, ["--log-level", "WARNING", *plain],
                             port=args.index_port or None, tls=tls_files("index"),
                             redis_url_in_env=True)
        index.own_session = True
        stack.push(index)
        index.launch()
        off_main_thread(index.wait_serving, "wait-index")
        print(f"prefix index  {index.target}", flush=True)
        engines = []
        http_port = None if args.http_port < 0 else (args.http_port or free_port())
        http_args = [] if http_port is None else ["--http-port", str(http_port)]
        if http_port is not None and args.tool_call_parser:
            http_args += ["--tool-call-parser", args.tool_call_parser]
        if http_port is not None and args.reasoning_parser:
            http_args += ["--reasoning-parser", args.reasoning_parser]
        for i in range(args.replicas):
            engine_args = ["--device", args.device, "--prefix-index", index.target,
                           "--engine-id", engine_ids[i], *tenancy_args, *plain]
            if args.metrics_port:
                engine_args += ["--metrics-port", str(args.metrics_port + i)]
            engine_args += replica_threads(args.device, args.replicas, os.environ)
            if args.replicas == 1:  # the front door: clients bring keys, not certificates
                engine_args += http_args + door_args + ([] if certs is None
                                                        else ["--tls-server-only"])
            port = (args.engine_port or None) if args.replicas == 1 else None
            log_path = log_dir / f"engine-{i}.log"
            # The replicas load their models at once, sharing the machine: each is given
            # the time one alone has, times their number.
            engine = EngineProcess(model, engine_args, port=port, log_path=log_path,
                                   tls=tls_files("engine", engine_ids[i]),
                                   start_timeout_s=START_TIMEOUT_S * args.replicas)
            engine.own_session = True
            if args.replicas > 1:
                engine.name = f"engine {i} (log {log_path})"
            stack.push(engine)
            engine.launch()
            engines.append(engine)
        off_main_thread(lambda stopped: wait_all_serving(engines, stopped), "wait-engines")
        for engine in engines:
            print(f"engine        {engine.target}  (model {model}, log {engine.log_path})",
                  flush=True)
        target = engines[0].target
        if args.replicas > 1:
            # Replicas found through the index, where each engine registered its address.
            router = RouterProcess(["--prefix-index", index.target, "--log-level", "WARNING",
                                    *http_args, *tenancy_args, *door_args, *plain],
                                   port=args.engine_port or None,
                                   log_path=log_dir / "router.log", tls=tls_files("router"))
            router.own_session = True
            stack.push(router)
            router.launch()
            off_main_thread(router.wait_serving, "wait-router")
            off_main_thread(lambda stopped: wait_for_replicas(
                router.target, args.replicas, api_key, ca, stopped), "wait-replicas")
            target = router.target
            print(f"router        {target}  (kv-aware over {args.replicas} engines, log "
                  f"{log_dir / 'router.log'})", flush=True)
        scheme = "http" if certs is None else "https"
        if http_port is not None:
            print(f"http          {scheme}://127.0.0.1:{http_port}  (OpenAI API: "
                  f"/v1/completions, /v1/chat/completions, /v1/models)", flush=True)
        shown = api_key if args.api_key_file is None else "(--api-key)"  # (not yours: ours)
        print(f"api key       {shown}  (authorization: Bearer KEY on gRPC; the OpenAI "
              f"client's api_key; keys in {key_file})", flush=True)
        print_how_to_connect(target, certs, shown)
        print(f"stack up in {time.monotonic() - started:.1f}s\n", flush=True)
        print(f"user: {args.prompt}\nassistant: ", end="", flush=True)
        usage = stream_completion(target, args.prompt, args.max_tokens, args.temperature,
                                  api_key=api_key, ca=ca)
        print(f"\n[usage: {usage.prompt_tokens} prompt tokens ({usage.cached_tokens} cached), "
              f"{usage.completion_tokens} completion tokens]", flush=True)
        try:  # the completion is done: a signal from here on is the ordinary way to stop
            if args.keep_running:
                http = "" if http_port is None else f" and {scheme}://127.0.0.1:{http_port}"
                print(f"serving on {target}{http}; Ctrl-C to stop", flush=True)
                wait_for_signal()
        except Stopped:
            pass
        for sig in STOP_SIGNALS:  # from here on, nothing cuts a drain short
            signal.signal(sig, handlers.note_second_signal)
        print("shutting down ...", flush=True)
        # ExitStack stops the rest in reverse: the router, the engines (each drained), the
        # index, then Redis.
        if args.replicas > 1:
            router.terminate()
        for i, engine in enumerate(engines):
            code = engine.terminate()
            if code != 0:
                print(f"engine {i} exited with {code}; see {log_dir / f'engine-{i}.log'}",
                      file=sys.stderr)
                return FAILED
    print("stopped cleanly", flush=True)
    return 0


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        sys.exit(run(args))
    except (RuntimeError, TimeoutError, grpc.RpcError) as error:
        print(f"pagedgen-stack failed: {error}", file=sys.stderr)
        sys.exit(FAILED)


if __name__ == "__main__":
    main()
