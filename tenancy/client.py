"""A client's side: a gRPC channel whose every call carries `authorization: Bearer KEY`
(grpc's call credentials need a TLS channel; metadata works on any)."""

from __future__ import annotations

import collections

import grpc


class _CallDetails(collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                         "compression")), grpc.ClientCallDetails):
    pass


class _BearerKey(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                 grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    def __init__(self, key: str) -> None:
        self.metadata = ("authorization", f"Bearer {key}")

    def _with_key(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = [*(details.metadata or ()), self.metadata]
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                            details.wait_for_ready, details.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_key(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_key(details), request)

    def intercept_stream_unary(self, continuation, details, requests):
        return continuation(self._with_key(details), requests)

    def intercept_stream_stream(self, continuation, details, requests):
        return continuation(self._with_key(details), requests)


def with_api_key(channel: grpc.Channel, key: str | None) -> grpc.Channel:
    """`channel` sending `key` with every call (the channel itself when key is None)."""
    return channel if key is None else grpc.intercept_channel(channel, _BearerKey(key))
