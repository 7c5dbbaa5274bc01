"""The prefix index takes a request up to the largest one its limits allow (a full re-sync comes
in Applies of max_ops ops holding max_hashes hashes) and refuses a larger message with
RESOURCE_EXHAUSTED before reading it."""

from __future__ import annotations

import grpc
import pytest

from pagedgen_api import prefix_index_pb2 as pb
from pagedgen_api import prefix_index_pb2_grpc as pb_grpc
from prefix_index.api.ops import HASH_BYTES
from prefix_index.server.config import Limits
from prefix_index.server.main import connection_limits
from prefix_index.tools.launch import IndexProcess
from prefix_index.tools.redis_process import RedisProcess
from trust.identity import ENGINE_ROLE, INDEX_ROLE


@pytest.fixture(scope="module")
def index_stub(test_certs):
    with RedisProcess() as redis, IndexProcess(redis.url, ["--log-level", "WARNING"],
                                               tls=test_certs.files("index")) as index:
        # As an engine: Apply is an engine's call (mutual TLS, an engine certificate).
        with test_certs.channel(index.target, ENGINE_ROLE, INDEX_ROLE) as channel:
            yield pb_grpc.PrefixIndexStub(channel)


def hashes(count: int, start: int = 0) -> list[bytes]:
    return [(start + i).to_bytes(HASH_BYTES, "big") for i in range(count)]


def largest_apply(limits: Limits) -> pb.ApplyRequest:
    """max_ops ops, max_hashes hashes among them: commits with a parent, the rest of the hashes
    in acquire chains of max_chain, as large as a re-sync of the largest pool sends."""
    request = pb.ApplyRequest(engine_id="e" * 128, epoch=(1 << 63) - 1, seq=(1 << 53) - 1)
    num_commits = limits.max_ops - limits.max_hashes // limits.max_chain
    for i, (block, parent) in enumerate(zip(hashes(num_commits), hashes(num_commits, 1 << 40),
                                            strict=True)):
        request.ops.add(commit=pb.CommitOp(hash=block, parent=parent, block_id=(1 << 62) + i))
    left = limits.max_hashes - 2 * num_commits
    start = 1 << 50
    while left > 0:
        size = min(left, limits.max_chain)
        request.ops.add(acquire=pb.AcquireOp(chain=hashes(size, start)))
        start, left = start + size, left - size
    return request


def test_the_largest_apply_fits_and_a_larger_message_does_not(index_stub):
    limits = Limits()
    limit = connection_limits(limits).max_receive_bytes
    request = largest_apply(limits)
    assert len(request.ops) <= limits.max_ops
    assert request.ByteSize() <= limit
    # Read and answered (the engine is unknown here): not refused for its size.
    with pytest.raises(grpc.RpcError) as answered:
        index_stub.Apply(request, timeout=60)
    assert answered.value.code() != grpc.StatusCode.RESOURCE_EXHAUSTED
    # One byte-heavy op more than the limit allows: refused unread.
    while request.ByteSize() <= limit:
        request.ops.add(acquire=pb.AcquireOp(chain=hashes(limits.max_chain, 1 << 60)))
    with pytest.raises(grpc.RpcError) as refused:
        index_stub.Apply(request, timeout=60)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(limit) in refused.value.details()
