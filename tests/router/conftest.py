"""A router stack (Redis, index, two engines on the tiny Llama, the router) per test module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pagedgen_api import generation_pb2_grpc as pb_grpc
from tests.router.stack import RouterStack


@pytest.fixture(scope="module")
def stack(tiny_llama_dir, tmp_path_factory, test_certs) -> Iterator[RouterStack]:
    with RouterStack(tiny_llama_dir, tmp_path_factory.mktemp("router-stack"),
                     test_certs) as running:
        yield running


@pytest.fixture(scope="module")
def router_stub(stack) -> Iterator[pb_grpc.GenerationStub]:
    with stack.channel() as channel:
        yield pb_grpc.GenerationStub(channel)
