"""What a tenant may do at the router: Abort only its own requests, set priority only when
allowed, hold at most its live requests and pinned blocks, while other tenants are served;
keys added and removed by SIGHUP."""

from __future__ import annotations

import signal

import grpc
import openai
import pytest

from pagedgen_api import generation_pb2 as pb
from tenancy.keys import hash_key
from tenancy.keys_tool import add_key
from tests.service.index_fixtures import prompt_ids
from tests.tenants.conftest import bearer, wait_until
from tests.tenants.streams import BackgroundStream, same_id_in_two_tenants


def _generate(stub, key: str, seed: int, **fields) -> pb.GenerateResponse:
    return stub.Generate(pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt_ids(seed, 20)),
        sampling=pb.SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), **fields),
        timeout=120, metadata=bearer(key))


def test_a_foreign_abort_is_not_found_and_the_victims_stream_completes(tenant_stack, stub):
    keys = tenant_stack.keys
    victim = BackgroundStream(stub, keys["alice"], "victim-1", 120, 3301)
    assert victim.started.wait(120) and victim.error is None
    foreign = stub.Abort(pb.AbortRequest(request_id="victim-1"), timeout=30,
                         metadata=bearer(keys["bob"]))
    unknown = stub.Abort(pb.AbortRequest(request_id="no-such-request"), timeout=30,
                         metadata=bearer(keys["bob"]))
    assert foreign == unknown == pb.AbortResponse(found=False)  # told apart by nothing
    victim.join()
    assert victim.error is None
    assert len(victim.token_ids) == 120
    assert victim.finish_reasons == [pb.FINISH_REASON_LENGTH]
    # Its owner can abort its own.
    own = BackgroundStream(stub, keys["alice"], "victim-2", 2000, 3302)
    assert own.started.wait(120) and own.error is None
    assert stub.Abort(pb.AbortRequest(request_id="victim-2"), timeout=30,
                      metadata=bearer(keys["alice"])).found
    own.join()
    assert own.finish_reasons == [pb.FINISH_REASON_ABORT]


def test_request_ids_are_scoped_per_tenant_at_the_router(tenant_stack, stub):
    keys = tenant_stack.keys
    same_id_in_two_tenants(stub, keys["alice"], keys["bob"], "router-shared-id", 3305)


def test_priority_only_from_a_tenant_allowed_to_set_it(tenant_stack, stub):
    keys = tenant_stack.keys
    with pytest.raises(grpc.RpcError) as refused:
        _generate(stub, keys["bob"], 3401, priority=5)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert refused.value.details().startswith("priority must be 0 for tenant 'bob'")
    assert _generate(stub, keys["bob"], 3401).usage.completion_tokens == 2  # priority 0: served
    assert _generate(stub, keys["alice"], 3401, priority=5).usage.completion_tokens == 2
    with tenant_stack.openai(keys["bob"], max_retries=0, timeout=120) as client:
        model = client.models.list().data[0].id
        with pytest.raises(openai.PermissionDeniedError) as http_refused:
            client.completions.create(model=model, prompt="hello", max_tokens=2,
                                      extra_body={"priority": 5})
    assert "priority must be 0" in str(http_refused.value)


def test_a_tenant_past_its_live_requests_is_refused_while_others_are_served(tenant_stack,
                                                                             stub):
    keys = tenant_stack.keys
    running = BackgroundStream(stub, keys["one-at-a-time"], "limited-1", 2000, 3501)
    assert running.started.wait(120) and running.error is None
    with pytest.raises(grpc.RpcError) as refused:
        _generate(stub, keys["one-at-a-time"], 3502)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_live_requests" in refused.value.details()
    assert _generate(stub, keys["bob"], 3503).usage.completion_tokens == 2
    running.call.cancel()
    running.join()
    # Its request over, the tenant is served again (the router counts it down as it ends).
    wait_until(lambda: _served(stub, keys["one-at-a-time"]), what="the tenant served again")


def _served(stub, key: str) -> bool:
    try:
        return _generate(stub, key, 3504).usage.completion_tokens == 2
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
        return False


def _pin(stub, key: str, seed: int, unpin: bool = False) -> pb.PinPrefixResponse:
    return stub.PinPrefix(pb.PinPrefixRequest(token_ids=pb.TokenIds(ids=prompt_ids(seed, 48)),
                                              unpin=unpin), timeout=60, metadata=bearer(key))


def test_a_tenant_past_its_pin_budget_is_refused_while_others_pin(tenant_stack, stub):
    keys = tenant_stack.keys
    assert _pin(stub, keys["pinner"], 3601).num_blocks == 3  # 3 of its 4 blocks
    with pytest.raises(grpc.RpcError) as refused:
        _pin(stub, keys["pinner"], 3602)  # 3 more: 6 > 4
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_pins" in refused.value.details()
    with pytest.raises(grpc.RpcError) as no_budget:
        _pin(stub, keys["bob"], 3603)  # the default: no pins
    # Not granted, rather than spent: no advice to unpin (HTTP 403, not 429 to retry).
    assert no_budget.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "may not pin" in no_budget.value.details()
    assert "unpin" not in no_budget.value.details()
    assert _pin(stub, keys["alice"], 3604).num_blocks == 3  # no limit
    assert _generate(stub, keys["pinner"], 3605).usage.completion_tokens == 2  # still served
    _pin(stub, keys["pinner"], 3601, unpin=True)  # its budget back
    assert _pin(stub, keys["pinner"], 3602).num_blocks == 3


def test_parallel_pins_cannot_pass_a_tenants_pin_budget(tenant_stack, stub):
    """Four 3-block pins at once from a tenant allowed 4 blocks: each is counted when checked,
    not when made, so exactly one is made and three are refused."""
    keys = tenant_stack.keys
    for seed in (3601, 3602):  # what the test above may have left pinned
        _pin(stub, keys["pinner"], seed, unpin=True)
    calls = [stub.PinPrefix.future(pb.PinPrefixRequest(
        token_ids=pb.TokenIds(ids=prompt_ids(3700 + i, 48))), timeout=60,
        metadata=bearer(keys["pinner"])) for i in range(4)]
    made, refused = [], []
    for i, call in enumerate(calls):
        try:
            made.append((i, call.result()))
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
            refused.append(i)
    assert len(made) == 1 and len(refused) == 3, (made, refused)
    _pin(stub, keys["pinner"], 3700 + made[0][0], unpin=True)


def test_sighup_reloads_the_key_file(tenant_stack, stub):
    keys, router = tenant_stack.keys, tenant_stack.stack.router
    bob = keys["bob"]
    text = keys.path.read_text()
    entry = f'\n[[keys]]\ntenant = "bob"\nsha256 = "{hash_key(bob)}"\n'
    assert entry in text
    keys.path.write_text(text.replace(entry, ""))
    carol = add_key(keys.path, "carol")
    router.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: _authenticated(stub, carol), what="carol's new key taken")
    assert not _authenticated(stub, bob)  # removed
    # A file that does not load keeps the keys held (and the log says why).
    keys.path.write_text("[tenants.x]\nmax_pins = 'many'\n")
    router.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "max_pins must be an integer" in tenant_stack.stack.router_log(),
               what="the refused file logged")
    assert _authenticated(stub, carol)
    assert router.proc.poll() is None


def _authenticated(stub, key: str) -> bool:
    try:
        stub.ModelInfo(pb.ModelInfoRequest(), timeout=30, metadata=bearer(key))
        return True
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED, error
        return False
