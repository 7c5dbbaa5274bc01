"""Bytes that are not a well-formed request (a string field that is not UTF-8, a cut or corrupt
message) are the client's error: INVALID_ARGUMENT naming what was wrong, nothing logged as a
server fault (engine_service/serving/wire_errors.py). Before: UNKNOWN ("Unexpected
DecodeError") and a traceback in the engine's log for every such call."""

from __future__ import annotations

import grpc
import pytest

from engine_service.tools.launch import EngineProcess
from pagedgen_api import generation_pb2 as pb

GENERATION = "/pagedgen.generation.v1.Generation/"
GOOD = pb.GenerateRequest(text="hi", request_id="wire-1",
                          sampling=pb.SamplingParams(max_tokens=2)).SerializeToString()
BAD = {
    "text not UTF-8": GOOD.replace(b"hi", b"\xff\xfe"),
    "request_id not UTF-8": GOOD.replace(b"wire-1", b"wire-\xc3"),
    "cut short": GOOD[:-2],
    "corrupt": b"\xff\xff\xff\xff",
}


@pytest.fixture(scope="module")
def engine(tiny_llama_dir, tmp_path_factory, test_certs):
    log_path = tmp_path_factory.mktemp("abuse_wire") / "engine.log"
    process = EngineProcess(
        tiny_llama_dir,
        ["--num-blocks", "64", "--block-size", "16", "--max-model-len", "256",
         "--prefix-index", "none", "--log-level", "WARNING"],
        log_path=log_path, tls=test_certs.files("engine"))
    with process:
        yield process, log_path


def _raw(channel: grpc.Channel, method: str, streaming: bool):
    kind = channel.unary_stream if streaming else channel.unary_unary
    return kind(GENERATION + method, request_serializer=lambda b: b,
                response_deserializer=lambda b: b)


@pytest.mark.parametrize("method, streaming", [("Generate", False), ("GenerateStream", True),
                                               ("Tokenize", False), ("PinPrefix", False)])
def test_undecodable_requests_are_invalid_argument(engine, test_certs, method, streaming):
    process, log_path = engine
    with test_certs.channel(process.target) as channel:
        call = _raw(channel, method, streaming)
        for what, data in BAD.items():
            with pytest.raises(grpc.RpcError) as refused:
                list(call(data, timeout=30)) if streaming else call(data, timeout=30)
            error = refused.value
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, (what, error)
            assert error.details().startswith(
                "the request must be a well-formed protobuf message: Error parsing message"), what
        if method == "Generate":  # well-formed bytes still run
            reply = pb.GenerateResponse.FromString(call(GOOD, timeout=30))
            assert reply.usage.completion_tokens == 2
    assert "Traceback" not in log_path.read_text()
