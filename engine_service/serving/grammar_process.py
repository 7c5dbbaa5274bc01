"""Structured outputs compiled in a process of their own (serving/grammar_worker.py), for the
serving core: a compilation that runs past its time limit, or whose request is cancelled, is
stopped by killing the process, where a thread's would run to its end holding the queue (a
crafted schema can take minutes). Compiled grammars come back as xgrammar's JSON, which loads
in a fraction of the compile time, and are cached here by constraint.

compile() runs on one thread at a time (GrammarQueue's); interrupt() and close() may come from
any other.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import threading
import time

from engine_service.core.errors import InvalidRequestError
from engine_service.model.config import ModelConfig
from engine_service.model.grammar import GRAMMAR_CACHE_BYTES, compile_error
from engine_service.model.structured_outputs import StructuredOutputsParams
from engine_service.serving.grammar_worker import FrameTimedOut, read_frame_by, write_frame

DEFAULT_COMPILE_TIMEOUT_S = 30.0
# Loading the tokenizer and its vocabulary into xgrammar: a GGUF file's tokenizer is converted
# on load, seconds for a large vocabulary.
START_TIMEOUT_S = 300.0
RESTART_TIMEOUT_S = 60.0  # a worker started again: imports only, the vocabulary handed over
# A worker that died mid-compile is started again (~3 s: xgrammar imports torch) only with at
# least this much of the compile's time left.
MIN_RETRY_S = 3.0


class CompileInterrupted(Exception):
    """The compilation was stopped by interrupt() (its request was cancelled)."""


class GrammarProcess:
    def __init__(self, model_config: ModelConfig, vocab_size: int, eos_token_ids,
                 timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S) -> None:
        self._init = ("init", model_config, vocab_size, sorted(eos_token_ids))
        self.timeout_s = timeout_s
        self._proc: subprocess.Popen | None = None
        self._tokenizer_info = None  # xgrammar.TokenizerInfo, loaded from the first worker's
        self._info_json: str | None = None  # its JSON, sent to the workers started after it
        self._cache: collections.OrderedDict[tuple, object] = collections.OrderedDict()
        self._cache_bytes = 0
        self._lock = threading.Lock()  # guards _proc and the flags against interrupt(), close()
        self._interrupted = False  # interrupt() killed _proc
        self._compiling = False  # compile() runs (on its one thread)
        self._cancelled = False  # interrupt() or close() came while it ran
        self._closed = False
        self.num_started = 0  # worker processes started (restarts after a kill included)

    def compile(self, spec: StructuredOutputsParams):
        """The compiled grammar (xgrammar.CompiledGrammar); InvalidRequestError when it does not
        compile or takes longer than timeout_s; CompileInterrupted when interrupt() stopped
        it."""
        cached = self._cache.get(spec.key)
        if cached is not None:
            self._cache.move_to_end(spec.key)
            return cached
        return self._compile(spec)

    def _compile(self, spec: StructuredOutputsParams):
        started = time.monotonic()
        deadline = started + self.timeout_s
        with self._lock:
            self._compiling, self._cancelled = True, False
        try:
            return self._compiled(spec, self._ask(spec, started, deadline))
        finally:
            with self._lock:
                self._compiling = False

    def _ask(self, spec: StructuredOutputsParams, started: float, deadline: float):
        """The worker's reply to compiling `spec`. A worker that died on its own (killed from
        outside, out of memory) is started again and asked once more, within the same time
        limit: its death is not the request's fault, unless the constraint kills the second
        one too."""
        for attempt in (1, 2):
            proc = self._running(deadline if attempt == 2 else None)
            try:
                write_frame(proc.stdin, ("compile", spec))
                return self._reply(proc, deadline)
            except (OSError, EOFError, FrameTimedOut) as error:  # (BrokenPipeError: an OSError)
                interrupted = self._stop(proc)
                with self._lock:
                    interrupted = interrupted or self._cancelled
                if interrupted:
                    raise CompileInterrupted() from None
                if isinstance(error, FrameTimedOut):
                    raise InvalidRequestError(
                        "structured_outputs",
                        f"structured_outputs.{spec.kind} must compile within "
                        f"{self.timeout_s:g} s (--grammar-compile-timeout-s), got one still "
                        f"compiling after {time.monotonic() - started:.1f} s: simplify it "
                        f"(fewer patterns, alternatives or nesting levels)") from None
                if attempt == 2 or deadline - time.monotonic() < MIN_RETRY_S:
                    raise RuntimeError(f"the grammar compiler process ended compiling this "
                                       f"constraint ({error!r}){' twice' if attempt == 2 else ''}"
                                       f"; it is started again for the next request") from None
        raise AssertionError("unreachable")

    def _compiled(self, spec: StructuredOutputsParams, reply):
        kind, payload = reply
        if kind == "invalid":
            raise compile_error(spec, payload)
        if kind == "failed":
            raise RuntimeError(f"the grammar compiler failed: {payload}")
        return self._cached(spec.key, self._load(payload))

    def interrupt(self) -> bool:
        """Stops the compilation under way, if any: the process is killed (an idle one too),
        and the next compile starts another. A compilation between two workers (its first
        died) is not asked again. True when a process was killed or a compilation stopped."""
        with self._lock:
            self._cancelled = self._compiling
            proc = self._proc
            if proc is None or proc.poll() is not None:
                return self._compiling
            self._interrupted = True
            proc.kill()
            if not self._compiling:
                proc.wait()  # idle: reaped now, not left a zombie until the next compile
            return True

    def close(self) -> None:
        """Ends the worker. A compilation under way on another thread then reads the end of
        its pipe and closes it: closed here, its descriptor's number could be reused by the
        next file opened, and that thread would read someone else's bytes."""
        with self._lock:
            self._closed = True
            self._cancelled = self._compiling
            proc, self._proc = self._proc, None
            compiling = self._compiling
        if proc is None:
            return
        if compiling:
            proc.kill()
            proc.wait()
        else:
            _end(proc)

    # ---- the worker -----------------------------------------------------------------------
    def _running(self, deadline: float | None = None) -> subprocess.Popen:
        """The worker, started when there is none; one started again for a compilation waits
        for its start no later than that compilation's `deadline`."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the grammar compiler is closed")
            if self._cancelled:  # (interrupted between a worker's death and its restart)
                raise CompileInterrupted()
            if self._proc is not None:
                if self._proc.poll() is None and not self._interrupted:
                    return self._proc
                _end(self._proc)  # killed by interrupt() between two compilations
            # One thread of CPU at most (xgrammar is told max_threads=1; the tokenizer's own
            # pool too): the engine's threads keep the others.
            env = dict(os.environ, OMP_NUM_THREADS="1", RAYON_NUM_THREADS="1",
                       TOKENIZERS_PARALLELISM="false")
            proc = subprocess.Popen([sys.executable, "-m", "engine_service.serving.grammar_worker"],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
            self._proc, self._interrupted = proc, False
            self.num_started += 1
        # A restart is given the vocabulary the first worker loaded: no tokenizer to load.
        init = self._init if self._info_json is None else ("init_info", self._info_json)
        try:
            write_frame(proc.stdin, init)
            limit_s = START_TIMEOUT_S if self._info_json is None else RESTART_TIMEOUT_S
            ready_by = time.monotonic() + limit_s
            kind, payload = self._reply(proc, ready_by if deadline is None
                                        else min(ready_by, deadline))
        except (OSError, EOFError, FrameTimedOut) as error:  # (BrokenPipeError: an OSError)
            if self._stop(proc):
                raise CompileInterrupted() from None
            raise RuntimeError(f"the grammar compiler process did not start ({error!r})") \
                from None
        if kind != "ready":
            self._stop(proc)
            raise RuntimeError(f"the grammar compiler process did not start: {payload}")
        if self._info_json is None:
            import xgrammar

            self._tokenizer_info = xgrammar.TokenizerInfo.deserialize_json(payload)
            self._info_json = payload
        return proc

    def _reply(self, proc: subprocess.Popen, deadline: float):
        """The worker's next frame; FrameTimedOut past `deadline`, EOFError when it died."""
        reply = read_frame_by(proc.stdout.fileno(), deadline)
        if reply is None:
            raise EOFError(f"exit code {proc.wait()}")
        return reply

    def _stop(self, proc: subprocess.Popen) -> bool:
        """Ends a worker that can no longer be trusted to answer in step; True when
        interrupt() had killed it."""
        with self._lock:
            interrupted = self._interrupted and self._proc is proc
            if self._proc is proc:
                self._proc, self._interrupted = None, False
        _end(proc)
        return interrupted

    # ---- compiled grammars ----------------------------------------------------------------
    def _load(self, payload: str):
        import xgrammar

        return xgrammar.CompiledGrammar.deserialize_json(payload, self._tokenizer_info)

    def _cached(self, key: tuple, grammar):
        size = grammar.memory_size_bytes
        self._cache[key] = grammar
        self._cache_bytes += size
        while self._cache_bytes > GRAMMAR_CACHE_BYTES and len(self._cache) > 1:
            _, dropped = self._cache.popitem(last=False)
            self._cache_bytes -= dropped.memory_size_bytes
        return grammar


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        try:
            pipe.close()
        except OSError:
            pass
