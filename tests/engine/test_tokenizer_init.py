"""A model directory without tokenizer files: a clear error, or token-ids-only serving with
skip_tokenizer_init (as vLLM has)."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys

import grpc
import pytest

from engine_service import LLM, SamplingParams
from engine_service.core.config import EngineConfig
from engine_service.core.engine import LLMEngine
from engine_service.serving.server import EngineServer, ServerOptions
from engine_service.tools.launch import EngineProcess
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from trust.cli_args import tls_argv

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def no_tokenizer_dir(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("no_tokenizer")
    for path in tiny_llama_dir.iterdir():
        if "token" not in path.name and path.name != "special_tokens_map.json":
            shutil.copy(path, out / path.name)
    return out


def test_missing_tokenizer_names_the_directory_and_the_files(no_tokenizer_dir):
    with pytest.raises(ValueError) as caught:
        LLM(str(no_tokenizer_dir), num_blocks=32)
    message = str(caught.value)
    assert str(no_tokenizer_dir) in message
    assert "tokenizer.json" in message and "skip_tokenizer_init" in message
    assert "sentencepiece" not in message


def test_skip_tokenizer_init_serves_token_ids(no_tokenizer_dir, tiny_llama_dir, make_llm):
    ids_only = make_llm(no_tokenizer_dir, num_blocks=32, skip_tokenizer_init=True,
                        dtype="float32")
    [out] = ids_only.generate({"prompt_token_ids": [5, 6, 7, 8]}, GREEDY)
    reference = make_llm(tiny_llama_dir, num_blocks=32, dtype="float32")
    [want] = reference.generate({"prompt_token_ids": [5, 6, 7, 8]}, GREEDY)
    assert out.outputs[0].token_ids == want.outputs[0].token_ids
    assert out.outputs[0].text == ""
    with pytest.raises(ValueError, match="prompt must be token ids .* got text"):
        ids_only.generate("some text", GREEDY)
    with pytest.raises(ValueError, match="stop must be empty when the engine has no tokenizer"):
        ids_only.generate({"prompt_token_ids": [5, 6]}, SamplingParams(stop=["x"]))


def test_skip_tokenizer_init_over_grpc(no_tokenizer_dir, test_certs):
    engine = LLMEngine(EngineConfig(model=str(no_tokenizer_dir), num_blocks=32,
                                    skip_tokenizer_init=True))

    async def body():
        server = EngineServer(engine, ServerOptions(port=0, tls=test_certs.material("engine")))
        port = await server.start()
        try:
            async with test_certs.aio_channel(f"127.0.0.1:{port}") as channel:
                stub = pb_grpc.GenerationStub(channel)
                reply = await stub.Generate(pb.GenerateRequest(
                    token_ids=pb.TokenIds(ids=[5, 6, 7]),
                    sampling=pb.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)))
                refused = []
                for request in (pb.GenerateRequest(text="hello"),
                                pb.GenerateRequest(chat=pb.ChatMessages(messages=[
                                    pb.ChatMessage(role="user", content="hi")]))):
                    try:
                        await stub.Generate(request)
                    except grpc.aio.AioRpcError as error:
                        refused.append((error.code(), error.details()))
                return reply, refused
        finally:
            await server.stop(1.0)

    reply, refused = asyncio.run(body())
    assert len(reply.completions[0].token_ids) == 4 and reply.completions[0].text == ""
    assert [code for code, _ in refused] == [grpc.StatusCode.INVALID_ARGUMENT] * 2
    assert all("serves token ids only" in details for _, details in refused)


# pagedgen-engine: the core loads the model while the front loads its tokenizers (both read
# the same directory); the core's error is the one said, and --skip-tokenizer-init loads none.
def test_pagedgen_engine_without_tokenizer_files_exits_naming_them(no_tokenizer_dir,
                                                                   test_certs):
    tls = test_certs.files("engine")
    done = subprocess.run(
        [sys.executable, "-m", "engine_service.serving.server", "--model", str(no_tokenizer_dir),
         "--port", "0", "--num-blocks", "32", *tls_argv(tls)],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "the engine core could not start: TokenizerNotFoundError" in done.stderr
    assert str(no_tokenizer_dir) in done.stderr and "--skip-tokenizer-init" in done.stderr
    assert "Traceback" not in done.stderr and "never retrieved" not in done.stderr


def test_pagedgen_engine_with_skip_tokenizer_init_serves_token_ids(no_tokenizer_dir, tmp_path,
                                                                   test_certs):
    with EngineProcess(no_tokenizer_dir, ["--num-blocks", "32", "--skip-tokenizer-init"],
                       log_path=tmp_path / "engine.log", tls=test_certs.files("engine")) as engine:
        with test_certs.channel(engine.target) as channel:
            stub = pb_grpc.GenerationStub(channel)
            reply = stub.Generate(pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=[5, 6, 7]),
                sampling=pb.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)),
                timeout=60)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Generate(pb.GenerateRequest(text="hello"), timeout=60)
    assert len(reply.completions[0].token_ids) == 4 and reply.completions[0].text == ""
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "serves token ids only" in refused.value.details()
