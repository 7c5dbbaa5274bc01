"""A long greedy stream run on a thread, so a test can act while it runs."""

from __future__ import annotations

import threading

import grpc

from pagedgen_api import generation_pb2 as pb
from tests.service.index_fixtures import prompt_ids
from tests.tenants.conftest import bearer


class BackgroundStream:
    def __init__(self, stub, key: str, request_id: str, max_tokens: int, seed: int) -> None:
        request = pb.GenerateRequest(
            request_id=request_id, token_ids=pb.TokenIds(ids=prompt_ids(seed, 20)),
            sampling=pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        self.call = stub.GenerateStream(request, timeout=300, metadata=bearer(key))
        self.messages: list[pb.GenerateStreamResponse] = []
        self.error: grpc.RpcError | None = None
        self.started = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for message in self.call:
                self.messages.append(message)
                self.started.set()
        except grpc.RpcError as error:
            self.error = error
        finally:
            self.started.set()

    def join(self, timeout_s: float = 300) -> None:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the stream did not end"

    @property
    def token_ids(self) -> list[int]:
        return [t for m in self.messages for c in m.choices for t in c.token_ids]

    @property
    def finish_reasons(self) -> list[int]:
        return [c.finish_reason for m in self.messages for c in m.choices if c.finish_reason]


def same_id_in_two_tenants(stub, alice_key: str, bob_key: str, request_id: str,
                           seed: int) -> None:
    """Two tenants run requests under the same id at once, both served; the id is still unique
    within a tenant (ALREADY_EXISTS), and each tenant's Abort reaches only its own request."""
    alice = BackgroundStream(stub, alice_key, request_id, 2000, seed)
    assert alice.started.wait(120) and alice.error is None
    bob = BackgroundStream(stub, bob_key, request_id, 60, seed + 1)
    bob.join()
    assert bob.error is None, bob.error
    assert len(bob.token_ids) == 60 and bob.finish_reasons == [pb.FINISH_REASON_LENGTH]
    assert {m.request_id for m in bob.messages} == {request_id}
    again = BackgroundStream(stub, alice_key, request_id, 4, seed + 2)
    again.join()
    assert again.error is not None and again.error.code() == grpc.StatusCode.ALREADY_EXISTS
    # Bob's request ended: his Abort of the id finds nothing, and leaves Alice's running.
    assert not stub.Abort(pb.AbortRequest(request_id=request_id), timeout=30,
                          metadata=bearer(bob_key)).found
    assert alice.error is None and not alice.finish_reasons
    assert stub.Abort(pb.AbortRequest(request_id=request_id), timeout=30,
                      metadata=bearer(alice_key)).found
    alice.join()
    assert alice.error is None and alice.finish_reasons == [pb.FINISH_REASON_ABORT]
