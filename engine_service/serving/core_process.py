"""The engine core in a process of its own: the step loop on its main thread, the prefix-index link
beside it, and one channel to the serving front (engine_service/serving/core_client.py).

Why a process: on a fast device a step takes a few milliseconds, and a gRPC front building a
message per token per stream, in the same process, holds the GIL the step loop needs (measured:
the served engine spent ~6x the offline API's CPU per token). Split, the front and the core each
have an interpreter; they talk in batches:

  front -> core  a list of commands per event-loop turn:
                 ("add", request_id, prompt_token_ids, params, cache_salt, priority,
                  pin_prefill)
                 ("abort", request_id)
                 ("finish_seq", request_id, index, stop_string)  a stop string matched in the
                                                    front ends that sequence
                 ("call", call_id, name, args)     pin_prefix
                 ("start_link", serving_address, instance_id)
                 ("stop",)                          abort what is live, close the link, exit
  core -> front  ("ready", EngineInfo, EngineStats) once the engine is built, or ("failed",
                 message);
                 then one ("step", outputs, errors, stats, link_view, results, rpc_times) per
                 step or state change: the step's RequestOutputs (token id deltas only: the
                 front detokenizes, and knows each request's prompt), requests refused at
                 admission, the engine's stats, the index link's state (when it changed), call
                 results, index RPC latencies.

The core owns every piece of engine state, the index link included (the one writer of the pool's
mirror). It ignores SIGINT and SIGTERM: the front drains and then sends "stop". When the front
goes away (its end of the channel closes) the core exits; when the core dies the front sees its
channel close and its process sentinel fire, and goes NOT_SERVING.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING

from engine_service.core.config import EngineConfig
from engine_service.core.errors import DuplicateRequestError, RequestError
from engine_service.core.outputs import RequestOutput
from engine_service.core.stats import EngineStats
from engine_service.index.link import (
    IndexLinkOptions,
    IndexUnavailableError,
    PinRefusedError,
    connect_prefix_index,
)
from engine_service.serving.engine_info import EngineInfo
from engine_service.serving.grammar_process import DEFAULT_COMPILE_TIMEOUT_S, GrammarProcess
from engine_service.serving.grammar_queue import GrammarQueue
from engine_service.serving.local_pins import check_pin_room, pin_locally
from engine_service.serving.output_wire import pack
from engine_service.serving.parent_death import die_with_parent
from engine_service.serving.torch_threads import core_torch_threads

if TYPE_CHECKING:
    from engine_service.core.engine import LLMEngine

log = logging.getLogger("engine_service.serving.core")

# How often an idle core looks at the index link's state (degraded or not) to publish it.
IDLE_PUBLISH_S = 0.1


@dataclass(frozen=True, slots=True)
class CoreOptions:
    config: EngineConfig
    prefix_index: str | None = None  # HOST:PORT, or None for the local LRU only
    engine_id: str = ""
    link_options: IndexLinkOptions | None = None
    log_level: str = "INFO"
    # --torch-threads: None picks (serving/torch_threads.py), 0 keeps torch's default.
    torch_threads: int | None = None
    grammar_compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S


@dataclass(frozen=True, slots=True)
class CoreChannel:
    """The core's ends of its two pipes to the front."""

    commands: Connection  # front -> core: command batches
    outputs: Connection  # core -> front: one message per step


def _shippable(error: BaseException) -> BaseException:
    """An error the front can unpickle and map: the known kinds as they are, others as text."""
    if isinstance(error, (RequestError, PinRefusedError, IndexUnavailableError)):
        return error
    return RuntimeError(f"{type(error).__name__}: {error}")


def run_core(channel: CoreChannel, options: CoreOptions) -> None:
    """The core process's entry point (multiprocessing spawn target).

    The engine (and with it torch) is imported here, in the core, not where this module is:
    the serving front imports it for this function and CoreOptions and runs no model. After a
    stop it does not return: the process exits 0 at once (_exit_now), atexit hooks unrun."""
    parent = os.getppid()
    # A core outliving its front would hold the model's memory, a GPU's included, for nothing.
    die_with_parent()
    if os.getppid() != parent:  # the front died before the request took effect
        raise SystemExit(1)
    conn = channel.outputs
    # The front owns the lifecycle: a Ctrl-C or SIGTERM to the process group drains through it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(
        level=options.log_level, stream=sys.stderr,
        format="%(asctime)s level=%(levelname)s logger=%(name)s msg=%(message)s")
    import torch

    from engine_service.core.engine import LLMEngine

    threads = core_torch_threads(options.torch_threads, options.config.device,
                                 torch.get_num_threads())
    torch.set_num_threads(threads)
    # Index RPC latencies, appended by the link's thread, shipped to the front's metrics.
    rpc_times: list[tuple[str, float]] = []
    try:
        engine = LLMEngine(options.config)
        # Read back once the engine is made: a CPU tensor-parallel engine's rank 0 (this
        # process) takes PAGEDGEN_TP_THREADS as the model is split, over the count above.
        log.info("the engine core computes with %d torch threads (%s)", torch.get_num_threads(),
                 _threads_origin(options))
        link = connect_prefix_index(engine, options.prefix_index, options.engine_id,
                                    options.link_options, start=False,
                                    on_rpc=lambda method, s: rpc_times.append((method, s)))
    except Exception as error:  # noqa: BLE001 - said to the front, which exits with it
        conn.send(("failed", f"{type(error).__name__}: {error}"))
        raise SystemExit(2) from None
    # Its first stats with it: EngineStats is answered from the moment the front serves.
    conn.send(("ready", EngineInfo.of(engine), engine.snapshot))
    # A tensor-parallel worker that dies while the engine idles (no collective to fail) ends
    # the core as a failed step would: the error is raised on the engine thread.
    engine.watch_ranks(lambda error: engine.post(_raiser(error)))
    try:
        CoreLoop(engine, channel, link, rpc_times, options.grammar_compile_timeout_s).run()
    except BaseException as error:  # the front ends every stream with this and exits non-zero
        log.exception("the engine core failed")
        # Workers first: once the front reads this it exits and kills this process, and a
        # tensor-parallel worker that hangs (or is stopped) would outlive it.
        try:
            engine.close()
        except Exception:  # noqa: BLE001 - the failure is what the front must hear
            log.exception("stopping the tensor-parallel workers failed")
        try:
            conn.send(("died", f"{error!r}"))
        except OSError:
            pass
        raise SystemExit(1) from None
    engine.close()  # the workers of a tensor-parallel engine stop with it
    _exit_now()


def _exit_now() -> None:
    """Exits 0 without the interpreter's teardown: everything is sent, closed and stopped
    by now, and tearing down torch's modules took about 0.5 s of every stop (measured on the
    CPU), time a rolling restart waits for nothing."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # closed or gone: nothing left to lose
    os._exit(0)


def _threads_origin(options: CoreOptions) -> str:
    """Where the core's torch thread count came from, for its log line."""
    if options.config.device == "cpu" and options.config.tensor_parallel_size > 1:
        return "a tensor-parallel rank: PAGEDGEN_TP_THREADS"
    if options.torch_threads is None:
        return "--torch-threads: not given"
    return f"--torch-threads: {options.torch_threads}"


def _raiser(error: Exception) -> Callable[[LLMEngine], None]:
    def command(_engine: LLMEngine) -> None:
        raise error

    return command


class CoreLoop:
    """Receives command batches, steps the engine, sends one message per step."""

    def __init__(self, engine: LLMEngine, channel: CoreChannel, link,
                 rpc_times: list[tuple[str, float]],
                 grammar_compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S) -> None:
        self.engine = engine
        self.commands = channel.commands
        self.conn = channel.outputs
        self.link = link
        self.rpc_times = rpc_times
        # The link posts commands to the engine from its own thread: a byte on this pipe wakes
        # an idle core to run them.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        engine.wake = self._wake
        self._outputs: list[RequestOutput] = []
        self._errors: list[tuple[str, RequestError]] = []
        self._results: list[tuple[int, object, BaseException | None]] = []
        self._pending_calls: list[tuple[int, concurrent.futures.Future]] = []
        self._link_view: tuple | None = None
        self._last_publish = 0.0
        self._compiling_published = 0  # requests compiling when stats were last sent
        self._stopping = False
        # Requests whose structured outputs compile, in a process of their own, while the
        # engine steps the others.
        self.compiler = GrammarProcess(engine.model_config, engine.model_config.vocab_size,
                                       engine.eos_token_ids, grammar_compile_timeout_s)
        self.grammars = GrammarQueue(self.compiler.compile, self._wake, self.compiler.interrupt)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # already awake-pending

    def run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping:
                busy = engine.has_unfinished_requests()
                if not self._receive(0.0 if busy else IDLE_PUBLISH_S):
                    return  # the front is gone
                engine.run_commands()
                if self.grammars:
                    self._admit_compiled()
                if self._stopping:
                    break
                if engine.has_unfinished_requests():
                    outputs = engine.step()
                    self._outputs.extend(outputs)
                    self._send(force=True)
                else:
                    self._send(force=False)
            self._send(force=True)  # the aborts the front sent before "stop"
        except (BrokenPipeError, EOFError, ConnectionResetError):
            log.info("the serving front went away: the core stops")
        finally:
            self.grammars.close()
            self.compiler.close()
            if self.link is not None:
                self.link.close()

    # ---- commands ---------------------------------------------------------------------------
    def _receive(self, timeout: float) -> bool:
        """Applies every command batch that has arrived (waiting up to `timeout` for one);
        False when the front closed the channel."""
        ready = wait([self.commands, self._wake_r], timeout)
        if self._wake_r in ready:
            os.read(self._wake_r, 4096)
        while self.commands in ready or self.commands.poll():
            ready = ()
            try:
                batch = self.commands.recv()
            except EOFError:
                return False
            for command in batch:
                self._apply(command)
            # An abort or a stop string can end the last request with no step to follow:
            # the stats the front reads must show that, not the last step's.
            self.engine.snapshot = self.engine.stats()
        return True

    def _apply(self, command: tuple) -> None:
        kind = command[0]
        engine = self.engine
        if kind == "add":
            _, request_id, prompt_token_ids, params, cache_salt, priority, pin_prefill = command
            if params.structured_outputs is not None:
                self._compile_first(command)
                return
            try:
                engine.add_request(request_id, prompt_token_ids, params,
                                   cache_salt=cache_salt, priority=priority,
                                   pin_prefill=pin_prefill)
            except RequestError as error:
                self._errors.append((request_id, error))
        elif kind == "abort":
            output = engine.abort_request(command[1]) or self.grammars.abort(command[1])
            if output is not None:
                self._outputs.append(output)
        elif kind == "finish_seq":  # a stop string the front matched
            output = engine.finish_sequence(command[1], command[2], command[3])
            if output is not None:
                self._outputs.append(output)
        elif kind == "call":
            self._call(command[1], command[2], command[3])
        elif kind == "start_link":
            if self.link is not None:
                self.link.options.serving_address = command[1]
                self.link.options.instance_id = command[2]
                self.link.start()
        elif kind == "stop":
            self._stopping = True
        else:
            raise ValueError(f"unknown core command {kind!r}")

    def _compile_first(self, command: tuple) -> None:
        """A request with structured outputs: checked now, queued while its grammar
        compiles, admitted by _admit_compiled."""
        request_id, prompt_token_ids, params = command[1:4]
        try:
            if request_id in self.grammars:
                raise DuplicateRequestError("request_id", f"request_id must be unique among "
                                            f"live requests, got {request_id!r}")
            self.engine.validate_request(prompt_token_ids, params)
        except RequestError as error:
            self._errors.append((request_id, error))
            return
        self.grammars.submit(request_id, command, params)

    def _admit_compiled(self) -> None:
        for item in self.grammars.ready():
            _, request_id, prompt_token_ids, params, cache_salt, priority, pin_prefill = (
                item.command)
            try:
                self.engine.add_request(request_id, prompt_token_ids, params,
                                        cache_salt=cache_salt, priority=priority,
                                        pin_prefill=pin_prefill, grammar=item.future.result())
            except RequestError as error:
                self._errors.append((request_id, error))
            except Exception as error:  # noqa: BLE001 - the request fails, not the core
                log.exception("request %s: its structured outputs did not compile", request_id)
                self._errors.append((request_id, _shippable(error)))

    def _call(self, call_id: int, name: str, args: tuple) -> None:
        if name == "pin_check":  # before a pin's prefill (serving/prefix_pins.py)
            try:
                self._results.append((call_id, check_pin_room(self.engine, *args), None))
            except PinRefusedError as error:
                self._results.append((call_id, None, error))
            return
        if name != "pin_prefix":
            self._results.append((call_id, None, ValueError(f"no core call {name!r}")))
            return
        if self.link is None:  # no index: the engine's own policy holds the pins
            try:
                self._results.append((call_id, pin_locally(self.engine, *args), None))
            except PinRefusedError as error:
                self._results.append((call_id, None, error))
            return
        future = self.link.pin_prefix_future(*args)
        future.add_done_callback(lambda _f: self._wake())
        self._pending_calls.append((call_id, future))

    # ---- what goes back -----------------------------------------------------------------------
    def _send(self, force: bool) -> None:
        """One message: the step's outputs, refusals, stats, the link's state when it changed,
        finished calls. Sent after every step (force), else when something is new."""
        still = []
        for call_id, future in self._pending_calls:
            if future.done():
                error = future.exception()
                self._results.append((call_id, None if error else future.result(),
                                      None if error is None else _shippable(error)))
            else:
                still.append((call_id, future))
        self._pending_calls = still
        link_view = None
        if self.link is not None:
            view = (self.link.degraded, self.link.health_details())
            if view != self._link_view:
                self._link_view = link_view = view
        now = time.monotonic()
        fresh = self._outputs or self._errors or self._results or link_view or self.rpc_times
        # Requests entering or leaving the compile queue change num_waiting with no step.
        fresh = fresh or len(self.grammars) != self._compiling_published
        if not (force or fresh or now - self._last_publish > 1.0):
            return
        self._last_publish = now
        self._compiling_published = len(self.grammars)
        for output in self._outputs:  # the front knows each request's prompt
            output.prompt_token_ids = output.prompt = None
        times = self.rpc_times[:]
        del self.rpc_times[:len(times)]
        self.conn.send(("step", pack(self._outputs), self._errors, self._stats(),
                        link_view, self._results, times))
        self._outputs, self._errors, self._results = [], [], []

    def _stats(self) -> EngineStats:
        """The engine's stats, requests whose grammar compiles counted as waiting (a router
        balancing on num_waiting sees them)."""
        stats = self.engine.snapshot
        if not self.grammars:
            return stats
        return dataclasses.replace(
            stats, num_waiting=stats.num_waiting + len(self.grammars),
            num_waiting_prefill_tokens=(stats.num_waiting_prefill_tokens
                                        + self.grammars.num_prompt_tokens))


CoreTarget = Callable[[CoreChannel, CoreOptions], None]
