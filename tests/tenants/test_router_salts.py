"""The router hashes a tenant's prompt as its engines do (the salt derived from the tenant,
with the deployment's secret), so kv-aware routing still finds the replica holding it; the
index holds only hashes under derived salts, which nobody without the secret can recompute."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pagedgen_api import generation_pb2_grpc as pb_grpc
from tenancy.client import with_api_key
from tenancy.salt import tenant_salt
from tests.router.stack import (
    RouterStack,
    generate,
    generate_kv_routed,
    hasher_of,
    wait_until,
)
from tests.service.index_fixtures import prompt_ids
from tests.tenants.conftest import write_keys

SECRET = b"another-deployment-secret-32-byt"
PREFIX_BLOCKS = 12


@pytest.fixture(scope="module")
def routed(tiny_llama_dir, tmp_path_factory, test_certs) -> Iterator[tuple[RouterStack, dict]]:
    folder = tmp_path_factory.mktemp("tenant-routes")
    keys = write_keys(folder / "keys.toml", {"alice": {"may_read_stats": True}, "bob": {}})
    secret = folder / "secret"
    secret.write_bytes(SECRET)
    args = ["--api-key-file", str(keys.path), "--tenant-secret-file", str(secret)]
    with RouterStack(tiny_llama_dir, folder, test_certs, num_engines=2, router_args=args,
                     api_key=keys["alice"]) as stack:
        yield stack, keys.by_tenant


def _stub(stack: RouterStack, key: str) -> pb_grpc.GenerationStub:
    return pb_grpc.GenerationStub(with_api_key(stack.certs.end_client_channel(stack.router.target),
                                               key))


def test_a_tenants_prefix_is_routed_to_its_holder_and_hidden_from_the_index(routed):
    stack, keys = routed
    alice, bob = _stub(stack, keys["alice"]), _stub(stack, keys["bob"])
    base = prompt_ids(3801, PREFIX_BLOCKS * 16)
    _, [holder] = generate(alice, base)
    hasher = hasher_of(alice)
    derived = hasher.chain(base, tenant_salt(SECRET, "alice", ""))
    wait_until(lambda: stack.lookup(derived).get(holder) == PREFIX_BLOCKS,
               what="alice's blocks in the index, under her derived salt")
    for guess in (None, "alice"):  # what an index reader could compute from the prompt
        assert stack.lookup(hasher.chain(base, guess)) == {}
    reply, replicas, holders = generate_kv_routed(alice, base, {holder})
    assert replicas[0] in holders
    assert reply.usage.cached_tokens >= (PREFIX_BLOCKS - 1) * 16
    reply, _ = generate(bob, base)
    assert reply.usage.cached_tokens == 0
