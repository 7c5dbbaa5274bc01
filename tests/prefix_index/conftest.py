"""Shared fixtures: one real redis-server and one index server (subprocess) per session, served
on the session's certificates (mutual TLS): tests call it through test_certs.index_client."""

from __future__ import annotations

import uuid

import pytest

from prefix_index.tools.launch import IndexProcess
from prefix_index.tools.redis_process import RedisProcess

# One session certificate stands in for every engine these tests register on the shared Redis
# (hundreds, some with 30 s leases): its per-certificate quota is not under test here
# (tests/trust/test_index_quotas.py tests it). Every index these tests start on the shared
# Redis takes it.
ONE_CERTIFICATE = ["--max-engines-per-identity", "1024"]
# The policy the tests (and the reference model) assume: a window far longer than any test, so
# a block's hit estimate is exactly its hit count.
HOT_THRESHOLD = 3
PIN_BUDGET_FRACTION = 0.25
HISTORY_PER_BLOCK = 2  # small, so the model-based test sees the history trimmed
INDEX_ARGS = ["--hot-threshold", str(HOT_THRESHOLD), "--hot-window-s", "3600",
              "--pin-budget-fraction", str(PIN_BUDGET_FRACTION),
              "--history-per-block", str(HISTORY_PER_BLOCK), "--log-level", "WARNING",
              "--grace-s", "1", *ONE_CERTIFICATE]


@pytest.fixture(scope="session")
def redis_server():
    with RedisProcess() as redis:
        yield redis


@pytest.fixture(scope="session")
def index_server(redis_server, test_certs):
    with IndexProcess(redis_server.url, INDEX_ARGS, tls=test_certs.files("index")) as index:
        yield index


@pytest.fixture
def engine_id() -> str:
    """A fresh engine per test: tests share the server but never each other's state."""
    return f"engine-{uuid.uuid4().hex[:12]}"
