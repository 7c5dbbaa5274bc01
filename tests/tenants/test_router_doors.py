"""The router as the front door: without a valid key nothing but UNAUTHENTICATED (HTTP 401);
health and reflection stay open; tenants share no cache and no cached_tokens signal unless
their key file says so."""

from __future__ import annotations

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pagedgen_api import generation_pb2 as pb
from tests.service.index_fixtures import prompt_ids
from tests.tenants.conftest import bearer

CALLS = {
    "Generate": pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7]),
                                   sampling=pb.SamplingParams(max_tokens=2)),
    "Tokenize": pb.TokenizeRequest(text="hello"),
    "Detokenize": pb.DetokenizeRequest(token_ids=[5, 6]),
    "ModelInfo": pb.ModelInfoRequest(),
    "EngineStats": pb.EngineStatsRequest(),
    "Abort": pb.AbortRequest(request_id="anything"),
    "PinPrefix": pb.PinPrefixRequest(token_ids=pb.TokenIds(ids=list(range(100, 140)))),
}


@pytest.mark.parametrize("metadata", [None, bearer("pg-not-a-key"), (("authorization", "x"),)],
                         ids=["no key", "unknown key", "not bearer"])
def test_no_valid_key_gets_unauthenticated_and_nothing_else(stub, metadata):
    for method, request in CALLS.items():
        with pytest.raises(grpc.RpcError) as refused:
            getattr(stub, method).with_call(request, timeout=30, metadata=metadata)
        error = refused.value
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED, (method, error)
        assert "API key" in error.details()
        assert not error.trailing_metadata(), method  # not even which replica was tried
    stream = stub.GenerateStream(CALLS["Generate"], timeout=30, metadata=metadata)
    with pytest.raises(grpc.RpcError) as refused:
        list(stream)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_health_and_reflection_stay_open(tenant_stack):
    with tenant_stack.stack.certs.end_client_channel(tenant_stack.target) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                            timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
        services = {s.name for r in replies for s in r.list_services_response.service}
    assert "pagedgen.generation.v1.Generation" in services


def test_http_without_a_valid_key_is_401(tenant_stack):
    for key in ("none", "pg-wrong"):
        with tenant_stack.openai(key, max_retries=0, timeout=60) as client:
            with pytest.raises(openai.AuthenticationError) as refused:
                client.completions.create(model="x", prompt="hi", max_tokens=2)
            assert refused.value.status_code == 401
            with pytest.raises(openai.AuthenticationError):
                client.models.list()


def _cached_tokens(stub, key: str, ids: list[int], salt: str = "") -> int:
    reply = stub.Generate(pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids), cache_salt=salt,
        sampling=pb.SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)),
        timeout=120, metadata=bearer(key))
    return reply.usage.cached_tokens


def test_a_tenant_sees_its_own_cache_and_no_one_elses(tenant_stack, stub):
    keys = tenant_stack.keys
    victim = prompt_ids(3201, 80)  # five blocks
    assert _cached_tokens(stub, keys["alice"], victim) == 0
    assert _cached_tokens(stub, keys["alice"], victim) >= 64  # its own cache: hit
    # Another tenant probing the victim's prompt, with any client salt it may guess:
    for salt in ("", "alice"):
        assert _cached_tokens(stub, keys["bob"], victim, salt) == 0
    # ... nor another over HTTP, as usage.prompt_tokens_details.cached_tokens (not bob: its
    # own probe above cached the prompt, for bob).
    with tenant_stack.openai(keys["pinner"], max_retries=0, timeout=120) as client:
        model = client.models.list().data[0].id
        reply = client.completions.create(model=model, prompt=victim, max_tokens=2,
                                          temperature=0)
    details = reply.usage.prompt_tokens_details
    assert reply.usage.prompt_tokens == len(victim)
    assert details is None or not details.cached_tokens
    # A tenant of alice's cache group shares it, as its key file says.
    assert _cached_tokens(stub, keys["alice-ci"], victim) >= 64


def test_a_client_salt_still_separates_a_tenants_own_requests(tenant_stack, stub):
    keys = tenant_stack.keys
    ids = prompt_ids(3202, 48)
    assert _cached_tokens(stub, keys["bob"], ids, "one") == 0
    assert _cached_tokens(stub, keys["bob"], ids, "one") >= 32
    assert _cached_tokens(stub, keys["bob"], ids, "two") == 0


def test_router_stats_and_model_paths_are_the_operator_s(tenant_stack, stub):
    """Through the router, EngineStats (its replicas' addresses among them) needs
    may_read_stats; ModelInfo shows others the model directory's name only and no replica's
    ids, and their streams' trailing metadata does not name the replicas that ran them."""
    keys = tenant_stack.keys
    with pytest.raises(grpc.RpcError) as refused:
        stub.EngineStats(pb.EngineStatsRequest(), timeout=30, metadata=bearer(keys["bob"]))
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "may_read_stats" in refused.value.details()
    stats = stub.EngineStats(pb.EngineStatsRequest(), timeout=30,
                             metadata=bearer(keys["operator"]))
    assert stats.num_blocks > 0 and stats.index_details
    bob = stub.ModelInfo(pb.ModelInfoRequest(), timeout=30, metadata=bearer(keys["bob"]))
    operator = stub.ModelInfo(pb.ModelInfoRequest(), timeout=30,
                              metadata=bearer(keys["operator"]))
    assert operator.model_path.endswith("/" + bob.model_path) and "/" not in bob.model_path
    assert operator.engine_id and operator.instance_id
    assert bob.engine_id == bob.instance_id == ""
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7]),
                                 sampling=pb.SamplingParams(max_tokens=2))
    trailers: dict[str, list[dict]] = {}
    for who in ("bob", "operator"):
        _, unary = stub.Generate.with_call(request, timeout=60, metadata=bearer(keys[who]))
        stream = stub.GenerateStream(request, timeout=60, metadata=bearer(keys[who]))
        assert list(stream)
        trailers[who] = [dict(call.trailing_metadata() or ()) for call in (unary, stream)]
    assert all(t.get("pagedgen-replicas") for t in trailers["operator"]), trailers
    assert all("pagedgen-replicas" not in t and t.get("pagedgen-route")
               for t in trailers["bob"]), trailers
