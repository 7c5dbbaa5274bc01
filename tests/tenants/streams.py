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
