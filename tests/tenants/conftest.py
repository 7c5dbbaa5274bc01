"""Tenants at the front doors, on real processes over loopback: Redis, the prefix index, one
engine on the tiny Llama and the router in front of it holding a key file (gRPC and the
OpenAI HTTP API), on the session's certificates (tests/support/tls.py); clients are gRPC stubs
and the official `openai` package, over TLS verifying the CA."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from pagedgen_api import generation_pb2_grpc as pb_grpc
from prefix_index.tools.redis_process import free_port
from tenancy.keys_tool import add_key
from tests.router.stack import RouterStack

# Each tenant's settings in the key file (keys are made by pagedgen-keys' add_key).
TENANTS = {
    "alice": {"may_set_priority": True, "max_live_requests": -1, "max_pins": -1,
              "may_read_stats": True},  # the stack's own checks read EngineStats with it
    "alice-ci": {"cache_group": "alice"},  # shares alice's cache, as configured
    "bob": {},  # the defaults: no priority, no pins
    "one-at-a-time": {"max_live_requests": 1},
    "pinner": {"max_pins": 4},
    "operator": {"may_read_stats": True},  # EngineStats and ModelInfo's path: granted
}


@dataclass
class Keys:
    path: Path
    by_tenant: dict[str, str]

    def __getitem__(self, tenant: str) -> str:
        return self.by_tenant[tenant]


def write_keys(path: Path, tenants: dict[str, dict]) -> Keys:
    return Keys(path, {name: add_key(path, name, settings=settings)
                       for name, settings in tenants.items()})


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


@dataclass
class TenantStack:
    stack: RouterStack
    keys: Keys
    http_port: int

    @property
    def target(self) -> str:
        return self.stack.router.target

    @property
    def base_url(self) -> str:
        return f"https://127.0.0.1:{self.http_port}/v1"

    def openai(self, api_key: str, **kwargs) -> openai.OpenAI:
        """The official client at the router's HTTPS front door, verifying the CA."""
        return self.stack.certs.openai_client(self.base_url, api_key, **kwargs)


@pytest.fixture(scope="module")
def tenant_stack(tiny_llama_dir, tmp_path_factory, test_certs) -> Iterator[TenantStack]:
    folder = tmp_path_factory.mktemp("tenants")
    keys = write_keys(folder / "keys.toml", TENANTS)
    secret = folder / "tenant-secret"
    secret.write_text("a-deployment-secret-of-32-bytes!")
    http_port = free_port()
    router_args = ["--api-key-file", str(keys.path), "--tenant-secret-file", str(secret),
                   "--http-port", str(http_port)]
    with RouterStack(tiny_llama_dir, folder, test_certs, num_engines=1, router_args=router_args,
                     api_key=keys["alice"]) as stack:
        yield TenantStack(stack, keys, http_port)


@pytest.fixture(scope="module")
def stub(tenant_stack) -> Iterator[pb_grpc.GenerationStub]:
    with tenant_stack.stack.certs.end_client_channel(tenant_stack.target) as channel:
        yield pb_grpc.GenerationStub(channel)


def wait_until(predicate, timeout_s: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached after {timeout_s}s")
        time.sleep(0.05)
