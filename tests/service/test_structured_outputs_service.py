"""Structured outputs in the served engine: the core compiles a grammar in a process of its own
while it steps the other requests, a request aborted or cancelled while its grammar compiles
ends cleanly (an abort output, nothing left live), and a cancelled compilation is stopped."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import time
from pathlib import Path

import grpc

from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from tests.service.test_cancel import wait_all_free
from tests.service.test_grammar_process import alive, very_slow_schema

_schemas = itertools.count()


def slow_schema() -> str:
    """A schema whose compilation takes seconds (each string `pattern` is a rule xgrammar
    precomputes token masks for), new each call: the engine's cache of compiled grammars
    never has it."""
    salt = next(_schemas)
    properties = {f"field_{i}": {"type": "string", "pattern": f"[a-z]{{1,{20 + i}}}-{salt}"}
                  for i in range(25)}
    return json.dumps({"type": "object", "properties": properties,
                       "required": list(properties)})


def constrained(schema: str, max_tokens: int = 16) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0, max_tokens=max_tokens,
                             structured_outputs=pb.StructuredOutputs(json=schema))


def test_other_requests_run_while_a_grammar_compiles(engine_server, stub):
    """A plain request sent just after a constrained one whose grammar takes seconds to
    compile ends before the constrained one's first token (a core that compiled on its step
    loop would run it only after the compilation)."""
    async def body():
        async with engine_server.aio_channel() as channel:
            astub = pb_grpc.GenerationStub(channel)
            slow = astub.GenerateStream(pb.GenerateRequest(
                text="A record:", sampling=constrained(slow_schema())), timeout=120)
            first = asyncio.ensure_future(slow.read())
            await asyncio.sleep(0.05)  # the core has the constrained request first
            plain = await astub.Generate(pb.GenerateRequest(
                text="Meanwhile", sampling=pb.SamplingParams(temperature=0, max_tokens=8)),
                timeout=120)
            token_came_first = first.done()
            messages = [await first]
            while (message := await slow.read()) is not grpc.aio.EOF:
                messages.append(message)
            return plain, token_came_first, messages

    plain, token_came_first, messages = asyncio.run(body())
    assert plain.completions[0].finish_reason == pb.FINISH_REASON_LENGTH
    assert not token_came_first
    text = "".join(m.choices[0].text for m in messages)
    assert text.startswith('{"field_0": "'), text
    wait_all_free(stub)


def test_abort_and_cancel_while_the_grammar_compiles(engine_server, stub):
    async def body():
        async with engine_server.aio_channel() as channel:
            astub = pb_grpc.GenerationStub(channel)
            aborted = astub.GenerateStream(pb.GenerateRequest(
                request_id="compiling-abort", text="A record:",
                sampling=constrained(slow_schema())), timeout=120)
            cancelled = astub.GenerateStream(pb.GenerateRequest(
                text="Another record:", sampling=constrained(slow_schema())), timeout=120)
            await asyncio.sleep(0.3)
            stats = await astub.EngineStats(pb.EngineStatsRequest())
            found = await astub.Abort(pb.AbortRequest(request_id="compiling-abort"))
            messages = [m async for m in aborted]
            cancelled.cancel()
            return stats, found, messages, await aborted.code(), await cancelled.code()

    stats, found, messages, code, cancelled_code = asyncio.run(body())
    assert stats.num_live_requests == 2 and stats.num_running == 0  # both still compiling
    assert stats.num_waiting == 2  # counted as waiting, where a router balancing looks
    assert found.found and code == grpc.StatusCode.OK
    assert messages[-1].finished
    assert [c.finish_reason for c in messages[-1].choices] == [pb.FINISH_REASON_ABORT]
    assert messages[-1].usage.completion_tokens == 0
    assert cancelled_code == grpc.StatusCode.CANCELLED
    wait_all_free(stub)
    # The engine goes on: a constrained request after them runs as usual.
    reply = stub.Generate(pb.GenerateRequest(text="Again", sampling=pb.SamplingParams(
        temperature=0, max_tokens=8,
        structured_outputs=pb.StructuredOutputs(choice=pb.Choices(values=["up", "down"])))),
        timeout=60)
    assert reply.completions[0].text in ("up", "down")


def test_invalid_constraints_over_grpc_name_the_field(stub):
    for sampling, words in (
        (pb.SamplingParams(structured_outputs=pb.StructuredOutputs(regex="[z-a]")),
         "sampling.structured_outputs.regex must be a valid regular expression, got one that "
         "does not compile: "),
        (pb.SamplingParams(structured_outputs=pb.StructuredOutputs()),
         "sampling.structured_outputs must set one of json, json_object, regex, choice, "
         "grammar, got none of them"),
        (pb.SamplingParams(beam_width=2, structured_outputs=pb.StructuredOutputs(regex="a")),
         "sampling.structured_outputs must be left unset with beam search"),
    ):
        try:
            stub.Generate(pb.GenerateRequest(text="Hi", sampling=sampling), timeout=30)
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert error.details().startswith(words), error.details()
        else:
            raise AssertionError(f"accepted {sampling}")


def grammar_workers(engine_pid: int) -> list[int]:
    """The grammar compiler processes under the engine (the core's children)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            parents[int(entry.name)] = (int(stat.rsplit(")", 1)[1].split()[1]), cmdline)
    found = []
    for pid, (parent, cmdline) in parents.items():
        if b"engine_service.serving.grammar_worker" in cmdline:
            while parent in parents and parent != engine_pid:
                parent = parents[parent][0]
            if parent == engine_pid:
                found.append(pid)
    return found


def test_a_cancelled_compilation_is_stopped(engine_server, stub):
    """A constrained request whose schema takes tens of seconds to compile, cancelled: its
    compilation is stopped (the compiler process killed, where a thread's would have run to
    its end, holding every other constrained request back), and the next one is served."""
    engine_pid = engine_server.process.proc.pid

    async def body():
        async with engine_server.aio_channel() as channel:
            astub = pb_grpc.GenerationStub(channel)
            stream = astub.GenerateStream(pb.GenerateRequest(
                text="A record:", sampling=constrained(very_slow_schema(f"cancel-{os.getpid()}"))),
                timeout=120)
            deadline = time.monotonic() + 60
            while not (workers := grammar_workers(engine_pid)):
                assert time.monotonic() < deadline, "no grammar compiler process started"
                await asyncio.sleep(0.1)
            await asyncio.sleep(0.5)
            stats = await astub.EngineStats(pb.EngineStatsRequest())
            stream.cancel()
            return workers, stats

    workers, stats = asyncio.run(body())
    assert stats.num_live_requests == 1 and stats.num_waiting == 1  # compiling when cancelled
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in workers):
        assert time.monotonic() < deadline, f"the compiler process {workers} was not stopped"
        time.sleep(0.1)
    wait_all_free(stub)
    reply = stub.Generate(pb.GenerateRequest(text="Again", sampling=pb.SamplingParams(
        temperature=0, max_tokens=8,
        structured_outputs=pb.StructuredOutputs(regex="(up|down)"))), timeout=60)
    assert reply.completions[0].text in ("up", "down")
