"""The serving core's grammar compiler process (serving/grammar_process.py): a compilation past
its time limit is refused naming the field and the limit, one interrupted is stopped, and in
both cases the process is killed and the next constraint compiles in a new one. The grammars
it hands back drive a matcher as an in-process compilation's do. The core's queue
(serving/grammar_queue.py) stops a compilation once no waiting request wants it."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from engine_service.core.errors import InvalidRequestError
from engine_service.model.config import load_model_config
from engine_service.model.grammar import GrammarCompiler, new_matcher
from engine_service.model.sampling_params import SamplingParams
from engine_service.model.structured_outputs import StructuredOutputsParams
from engine_service.serving.grammar_process import CompileInterrupted, GrammarProcess
from engine_service.serving.grammar_queue import GrammarQueue
from engine_service.serving.grammar_worker import (
    FRAME_LENGTH,
    FrameTimedOut,
    read_frame_by,
    write_frame,
)
from tests.support.tiny_models import SMOLLM2_EOS_TOKEN_ID


def very_slow_schema(salt: str, fields: int = 60) -> str:
    """Tens of seconds of compilation on this machine (60 string patterns; 25 take a few)."""
    properties = {f"field_{i}": {"type": "string", "pattern": f"[a-z]{{1,{40 + i}}}-{salt}"}
                  for i in range(fields)}
    return json.dumps({"type": "object", "properties": properties,
                       "required": list(properties)})


FIELDS_FOR_A_SECOND = 12  # (a schema of this many patterns compiles in about a second)


@pytest.fixture
def compiler(tiny_llama_dir):
    config = load_model_config(str(tiny_llama_dir))
    process = GrammarProcess(config, config.vocab_size, [SMOLLM2_EOS_TOKEN_ID], timeout_s=60)
    yield process
    process.close()


def worker(process: GrammarProcess) -> int:
    return process._proc.pid


def alive(pid: int) -> bool:
    """Whether the process runs (the compiler reaps the workers it kills)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_grammars_from_the_process_match_the_in_process_ones(compiler, tiny_llama_dir):
    config = load_model_config(str(tiny_llama_dir))
    local = GrammarCompiler(config, config.vocab_size, [SMOLLM2_EOS_TOKEN_ID])
    spec = StructuredOutputsParams(regex="(yes|no)[0-9]{2}")
    ours, theirs = new_matcher(compiler.compile(spec)), new_matcher(local.compile(spec))
    assert compiler.compile(spec) is compiler.compile(spec)  # cached by constraint
    from transformers import AutoTokenizer

    tokens = AutoTokenizer.from_pretrained(tiny_llama_dir).encode("no42")
    for token in tokens:
        assert ours.accept_token(token) == theirs.accept_token(token) is True
    assert ours.is_terminated() == theirs.is_terminated()
    assert not ours.accept_token(tokens[0])  # past the end: both refuse
    with pytest.raises(InvalidRequestError, match=r"structured_outputs\.regex must be a valid "
                                                  r"regular expression, got one that does not "
                                                  r"compile: .*parenthesis"):
        compiler.compile(StructuredOutputsParams(regex="(ab"))
    assert compiler.num_started == 1  # a refusal leaves the process as it was


def test_a_compilation_past_the_limit_is_refused_and_stopped(compiler):
    compiler.compile(StructuredOutputsParams(json_object=True))  # started, vocabulary loaded
    slow = worker(compiler)
    compiler.timeout_s = 1.0
    start = time.monotonic()
    with pytest.raises(InvalidRequestError) as refused:
        compiler.compile(StructuredOutputsParams(json=very_slow_schema("limit")))
    assert time.monotonic() - start < 10
    assert refused.value.field == "structured_outputs"
    assert str(refused.value).startswith(
        "structured_outputs.json must compile within 1 s (--grammar-compile-timeout-s), got "
        "one still compiling after 1.")
    assert not alive(slow)  # killed, not left to compile on
    compiler.timeout_s = 60
    assert compiler.compile(StructuredOutputsParams(regex="[0-9]+")) is not None
    assert compiler.num_started == 2


def test_an_interrupted_compilation_is_stopped_and_the_next_compiles(compiler):
    compiler.compile(StructuredOutputsParams(json_object=True))
    slow = worker(compiler)
    stopped = []
    threading.Timer(0.5, lambda: stopped.append(compiler.interrupt())).start()
    with pytest.raises(CompileInterrupted):
        compiler.compile(StructuredOutputsParams(json=very_slow_schema("interrupt")))
    assert stopped == [True]
    assert not alive(slow)
    assert compiler.compile(StructuredOutputsParams(choice=("a", "b"))) is not None
    assert compiler.num_started == 2
    idle = worker(compiler)
    assert compiler.interrupt()  # an idle process is killed too, and started again on need
    assert not alive(idle)  # reaped at once, not a zombie until the next compile
    assert compiler.compile(StructuredOutputsParams(choice=("c", "d"))) is not None
    assert compiler.num_started == 3


def test_a_worker_that_dies_mid_compile_is_started_again_and_asked_once_more(compiler):
    """Killed from outside (the OOM killer, an operator): not the request's doing. Before,
    the request failed INTERNAL."""
    compiler.compile(StructuredOutputsParams(json_object=True))
    first = worker(compiler)
    threading.Timer(0.3, os.kill, (first, signal.SIGKILL)).start()
    spec = StructuredOutputsParams(json=very_slow_schema("died", fields=FIELDS_FOR_A_SECOND))
    assert compiler.compile(spec) is not None
    assert not alive(first)
    assert compiler.num_started == 2  # (an idle worker killed would not be started again yet)


def test_an_interrupt_between_a_dead_worker_and_its_restart_is_kept(compiler, monkeypatch):
    """The request is cancelled just as the first worker's death is seen: nothing runs to
    kill, and before, the retry compiled the constraint nobody wanted on a new worker."""
    compiler.compile(StructuredOutputsParams(json_object=True))
    stop = GrammarProcess._stop
    said = []

    def stop_then_interrupt(self, proc):
        stopped = stop(self, proc)
        said.append(self.interrupt())  # (in the window: no process)
        return stopped

    monkeypatch.setattr(GrammarProcess, "_stop", stop_then_interrupt)
    threading.Timer(0.3, os.kill, (worker(compiler), signal.SIGKILL)).start()
    with pytest.raises(CompileInterrupted):
        compiler.compile(StructuredOutputsParams(
            json=very_slow_schema("lost", fields=FIELDS_FOR_A_SECOND)))
    assert said == [True]
    assert compiler.num_started == 1  # no worker started for it


def test_a_worker_dead_near_the_deadline_is_not_started_again_for_it(compiler):
    """Less time left than a restart takes: the request fails at once (INTERNAL), with no
    worker started and then killed for a compilation it had no time for."""
    compiler.compile(StructuredOutputsParams(json_object=True))
    compiler.timeout_s = 1.5
    threading.Timer(0.5, os.kill, (worker(compiler), signal.SIGKILL)).start()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="ended compiling this constraint"):
        compiler.compile(StructuredOutputsParams(json=very_slow_schema("late", fields=20)))
    assert time.monotonic() - started < 1.5
    assert compiler.num_started == 1


def test_a_frame_is_read_whole_by_its_deadline_or_not_at_all():
    read_fd, write_fd = os.pipe()
    try:
        big = "x" * (3 << 20)  # past a pipe's buffer: read in many chunks

        def send() -> None:
            with os.fdopen(os.dup(write_fd), "wb") as out:
                write_frame(out, ("ok", big))

        writer = threading.Thread(target=send)
        writer.start()
        assert read_frame_by(read_fd, time.monotonic() + 10) == ("ok", big)
        writer.join()
        # A worker stopped mid-frame (SIGSTOP): before, the read past its first byte waited
        # for good, holding the compile thread.
        os.write(write_fd, FRAME_LENGTH.pack(100) + b"x" * 10)
        started = time.monotonic()
        with pytest.raises(FrameTimedOut):
            read_frame_by(read_fd, started + 0.5)
        assert time.monotonic() - started < 5
        os.close(write_fd)
        write_fd = -1
        assert read_frame_by(read_fd, time.monotonic() + 5) is None  # the writer gone
    finally:
        os.close(read_fd)
        if write_fd >= 0:
            os.close(write_fd)


def test_close_ends_the_process(compiler):
    compiler.compile(StructuredOutputsParams(json_object=True))
    process = worker(compiler)
    compiler.close()
    assert not alive(process)
    with pytest.raises(RuntimeError, match="closed"):
        compiler.compile(StructuredOutputsParams(regex="x+"))


def test_close_during_a_compilation_stops_it(compiler):
    """The core stopping while a constraint compiles on its compile thread: the compilation
    ends as interrupted, its worker is gone, and the thread closes the pipe it was reading."""
    compiler.compile(StructuredOutputsParams(json_object=True))
    process = worker(compiler)
    pipe = compiler._proc.stdout
    outcome = []

    def run() -> None:
        try:
            compiler.compile(StructuredOutputsParams(json=very_slow_schema("close")))
            outcome.append("compiled")
        except CompileInterrupted:
            outcome.append("interrupted")

    compiling = threading.Thread(target=run)
    compiling.start()
    time.sleep(0.5)
    compiler.close()
    compiling.join(timeout=10)
    assert outcome == ["interrupted"]
    assert not alive(process) and pipe.closed


def queued(request_id: str, schema: str) -> tuple:
    params = SamplingParams(max_tokens=4, structured_outputs={"json": schema})
    return ("add", request_id, [1, 2, 3], params, None, 0, False)


def wait_for(predicate, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_the_queue_stops_a_compilation_when_its_last_waiter_leaves(compiler):
    """Two requests for one slow constraint: the first aborted while it compiles leaves it
    running (the second still wants it); the second aborted before its own job started stops
    it too (before, its job's cancel stopped nothing, and the compilation ran on to its time
    limit, holding every constrained request behind it)."""
    compiler.compile(StructuredOutputsParams(json_object=True))
    slow = worker(compiler)
    woken = threading.Event()
    queue = GrammarQueue(compiler.compile, woken.set, compiler.interrupt)
    try:
        schema = very_slow_schema("queue")
        for request_id in ("first", "second"):
            command = queued(request_id, schema)
            queue.submit(request_id, command, command[3])
        wait_for(lambda: queue._compiling is not None, "the compilation never started")
        time.sleep(0.3)
        assert queue.abort("first").finished
        time.sleep(0.3)
        assert alive(slow)  # the second waits for the same grammar
        assert queue.abort("second").finished
        wait_for(lambda: not alive(slow), "the abandoned compilation was not stopped", 10)
        command = queued("third", '{"type": "object", "properties": {"n": {"type": "integer"}}}')
        queue.submit("third", command, command[3])
        items = []
        wait_for(lambda: items.extend(queue.ready()) or items, "the next one never compiled")
        assert [item.command[1] for item in items] == ["third"]
        assert items[0].future.result() is not None
        assert len(queue) == 0 and not queue._wanted
    finally:
        queue.close()
