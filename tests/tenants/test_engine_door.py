"""An engine served alone is a front door too: the same keys, salts and limits as the router.
Without TLS it believes the tenant header (x-pagedgen-tenant) from nobody: only a router's
certificate makes it trusted."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import openai
import pytest

from engine_service.tools.launch import EngineProcess
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from prefix_index.tools.redis_process import free_port
from tenancy.gate import TENANT_METADATA
from tests.service.conftest import engine_args
from tests.service.index_fixtures import prompt_ids
from tests.tenants.conftest import TENANTS, bearer, write_keys
from tests.tenants.streams import BackgroundStream, same_id_in_two_tenants


@pytest.fixture(scope="module")
def engine(tiny_llama_dir, tmp_path_factory,
           test_certs) -> Iterator[tuple[EngineProcess, dict, int]]:
    folder = tmp_path_factory.mktemp("engine-door")
    keys = write_keys(folder / "keys.toml", TENANTS)
    http_port = free_port()
    args = [*engine_args(free_port(), None), "--http-port", str(http_port),
            "--api-key-file", str(keys.path),  # no secret file: one of its own, warned
            "--tls-server-only"]  # served alone to end clients: TLS, keys, no certificates
    process = EngineProcess(tiny_llama_dir, args, log_path=folder / "engine.log",
                            tls=test_certs.files("engine")).start()
    try:
        yield process, keys, http_port
    finally:
        process.terminate()


@pytest.fixture(scope="module")
def stub(engine, test_certs) -> Iterator[pb_grpc.GenerationStub]:
    with test_certs.end_client_channel(engine[0].target) as channel:
        yield pb_grpc.GenerationStub(channel)


def _cached(stub, metadata, ids: list[int], **fields) -> int:
    return stub.Generate(pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=ids),
        sampling=pb.SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), **fields),
        timeout=120, metadata=metadata).usage.cached_tokens


def test_no_key_is_unauthenticated_over_grpc_and_401_over_http(engine, stub, test_certs):
    _, _, http_port = engine
    for metadata in (None, bearer("pg-wrong"), ((TENANT_METADATA, "alice"),)):
        with pytest.raises(grpc.RpcError) as refused:
            stub.ModelInfo(pb.ModelInfoRequest(), timeout=30, metadata=metadata)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as refused:
            _cached(stub, metadata, [5, 6, 7])
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with test_certs.openai_client(f"https://127.0.0.1:{http_port}/v1", "pg-wrong",
                                  max_retries=0, timeout=60) as client:
        with pytest.raises(openai.AuthenticationError):
            client.models.list()


def test_tenants_share_no_cache_at_the_engine(engine, stub):
    _, keys, _ = engine
    ids = prompt_ids(3701, 64)
    alice, bob = bearer(keys["alice"]), bearer(keys["bob"])
    assert _cached(stub, alice, ids) == 0
    assert _cached(stub, alice, ids) >= 48
    assert _cached(stub, bob, ids) == 0
    # Naming another tenant in the header changes nothing without a router's certificate.
    assert _cached(stub, (*bearer(keys["pinner"]), (TENANT_METADATA, "alice")), ids) == 0


def test_aborts_priority_and_live_requests_at_the_engine(engine, stub):
    _, keys, _ = engine
    victim = BackgroundStream(stub, keys["alice"], "engine-victim", 120, 3702)
    assert victim.started.wait(120) and victim.error is None
    for metadata in (bearer(keys["bob"]), (*bearer(keys["bob"]), (TENANT_METADATA, "alice"))):
        assert not stub.Abort(pb.AbortRequest(request_id="engine-victim"), timeout=30,
                              metadata=metadata).found
    victim.join()
    assert victim.error is None and len(victim.token_ids) == 120
    with pytest.raises(grpc.RpcError) as refused:
        _cached(stub, bearer(keys["bob"]), [5, 6, 7], priority=3)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    running = BackgroundStream(stub, keys["one-at-a-time"], "engine-limited", 2000, 3703)
    assert running.started.wait(120) and running.error is None
    with pytest.raises(grpc.RpcError) as full:
        _cached(stub, bearer(keys["one-at-a-time"]), [5, 6, 7])
    assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert _cached(stub, bearer(keys["bob"]), [5, 6, 8]) == 0  # others served
    assert stub.Abort(pb.AbortRequest(request_id="engine-limited"), timeout=30,
                      metadata=bearer(keys["one-at-a-time"])).found
    running.join()


def test_request_ids_are_scoped_per_tenant_at_the_engine(engine, stub):
    _, keys, _ = engine
    same_id_in_two_tenants(stub, keys["alice"], keys["bob"], "engine-shared-id", 3704)


def test_engine_stats_and_model_paths_are_the_operator_s(engine, stub):
    """EngineStats (counters every tenant's traffic moves) needs may_read_stats; ModelInfo
    shows others the model directory's name, not the server's path, and not which engine or
    process answers."""
    with pytest.raises(grpc.RpcError) as refused:
        stub.EngineStats(pb.EngineStatsRequest(), timeout=30, metadata=bearer(engine[1]["bob"]))
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "may_read_stats" in refused.value.details() and "'bob'" in refused.value.details()
    stats = stub.EngineStats(pb.EngineStatsRequest(), timeout=30,
                             metadata=bearer(engine[1]["operator"]))
    assert stats.num_blocks > 0
    bob = stub.ModelInfo(pb.ModelInfoRequest(), timeout=30, metadata=bearer(engine[1]["bob"]))
    operator = stub.ModelInfo(pb.ModelInfoRequest(), timeout=30,
                              metadata=bearer(engine[1]["operator"]))
    assert "/" in operator.model_path and operator.model_path.endswith("/" + bob.model_path)
    assert bob.model_path and "/" not in bob.model_path
    assert operator.engine_id and operator.instance_id
    assert bob.engine_id == bob.instance_id == ""
    assert bob.model_identity == operator.model_identity  # what a client needs is there
