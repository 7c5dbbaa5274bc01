"""A request too large for the replicas is the client's error (INVALID_ARGUMENT, HTTP 400)
saying what is too large, not "every replica is full" (RESOURCE_EXHAUSTED, HTTP 429, which
clients retry): a token-id prompt far past the context is refused by the router as an engine
words it, and a message past an engine's gRPC size limit (sized to its context, the router's
to a 128K one) is not taken for a full replica and tried on every other. Refusals name no
replica address (the router's log does)."""

from __future__ import annotations

import grpc
import openai
import pytest

from engine_service.serving.connection_limits import generation_request_bytes
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from prefix_index.tools.redis_process import free_port
from tests.router.stack import ENGINE_SHAPE, RouterStack

CONTEXT = 2048  # ENGINE_SHAPE's --max-model-len
HUGE = 3_000_000  # ids of 2 bytes each: a 6 MB message, under the router's 16 MiB limit
# Over HTTP, 100 times the context: 3M ids took ~20 s end to end (the front parses their 18 MB
# body in 0.12 s; the rest is the openai client building and sending it).
HUGE_HTTP = 200_000


@pytest.fixture(scope="module")
def stack(tiny_llama_dir, tmp_path_factory, test_certs):
    http_port = free_port()
    assert "2048" in ENGINE_SHAPE
    with RouterStack(tiny_llama_dir, tmp_path_factory.mktemp("oversized"), test_certs,
                     num_engines=2, with_index=False,
                     router_args=["--http-port", str(http_port)]) as stack:
        stack.http_port = http_port
        yield stack


def _sampling() -> pb.SamplingParams:
    return pb.SamplingParams(temperature=0, max_tokens=4)


def _no_address(stack: RouterStack, details: str) -> None:
    for engine in stack.engines.values():
        assert engine.target not in details, details


def test_a_prompt_far_past_the_context_is_invalid_argument(stack):
    with stack.channel() as channel:
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=[1000] * HUGE), sampling=_sampling()), timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
    details = refused.value.details()
    assert f"prompt must be at most {CONTEXT - 1} tokens" in details
    assert f"got {HUGE} tokens" in details
    _no_address(stack, details)


def test_a_prompt_far_past_the_context_is_400_over_http(stack, test_certs):
    client = test_certs.openai_client(f"https://127.0.0.1:{stack.http_port}/v1", "none",
                                      max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=model, prompt=[1000] * HUGE_HTTP, max_tokens=4)
    assert refused.value.status_code == 400
    assert f"got {HUGE_HTTP} tokens" in str(refused.value)
    client.close()


def test_a_message_past_the_engines_size_limit_is_not_a_full_replica(stack):
    """A short prompt with a stop string larger than an engine accepts in a whole message:
    the router's own limit (a 128K context's) lets it through; the engine's gRPC refuses it."""
    sampling = _sampling()
    sampling.stop.append("x" * (generation_request_bytes(CONTEXT) + 1))
    with stack.channel() as channel:
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=[1000] * 8), sampling=sampling), timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
    details = refused.value.details()
    assert "message size limit" in details and "request limit" not in details
    _no_address(stack, details)
    # Both replicas still up: the refusal marked neither down.
    assert stack.router_stats().index_details["replicas_routable"] == "2"
