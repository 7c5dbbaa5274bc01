"""A request that is not a well-formed protobuf message of its method's type (bytes that are not
UTF-8 in a string field, a cut or corrupt message) is refused with INVALID_ARGUMENT, naming the
type and what was wrong.

grpcio answers a message its deserializer cannot read with UNKNOWN ("Unexpected DecodeError")
and logs the traceback at ERROR, once a call: a client's bad bytes read as a server fault, and
a client sending them in a loop filled the log. Here the deserializer hands the error to the
method's behaviour, which aborts with it; well-formed requests run as they did.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable

import grpc
from google.protobuf.message import DecodeError

from pagedgen_api import generation_pb2 as pb

GENERATION_PREFIX = f"/{pb.DESCRIPTOR.services_by_name['Generation'].full_name}/"
# The generation requests a server counts in requests_total (gRPC's full method names).
GENERATE_METHODS = frozenset({GENERATION_PREFIX + "Generate", GENERATION_PREFIX + "GenerateStream"})


class _Undecodable:
    """What a request's bytes decoded to when they were not a message of its type."""

    __slots__ = ("message",)

    def __init__(self, message: str) -> None:
        self.message = message


class WireErrorInterceptor(grpc.aio.ServerInterceptor):
    """For the Generation service's methods (one request each): their requests decoded here."""

    def __init__(self, on_refused: Callable[[str, grpc.StatusCode], None] | None = None) -> None:
        # Told of each request refused here (its method, INVALID_ARGUMENT): the servicer never
        # sees it, so it cannot count it itself.
        self.on_refused = on_refused
        # Method -> (its handler, the lenient one), made once, not on every call; keyed by the
        # service's own methods only (an unknown one has no handler), so it stays that small.
        self._lenient: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if (handler is None or handler.request_streaming or handler.request_deserializer is None
                or not handler_call_details.method.startswith(GENERATION_PREFIX)):
            return handler
        method = handler_call_details.method
        made = self._lenient.get(method)
        if made is None or made[0] is not handler:
            made = self._lenient[method] = (handler, _lenient(handler, method, self.on_refused))
        return made[1]


def _lenient(handler: grpc.RpcMethodHandler, method: str,
             on_refused: Callable[[str, grpc.StatusCode], None] | None,
             ) -> grpc.RpcMethodHandler:
    decode = handler.request_deserializer

    def deserialize(data: bytes):
        try:
            return decode(data)
        except DecodeError as error:
            return _Undecodable(str(error))

    async def refuse_undecodable(request, context) -> None:
        if isinstance(request, _Undecodable):
            if on_refused is not None:
                on_refused(method, grpc.StatusCode.INVALID_ARGUMENT)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the request must be a well-formed protobuf message: "
                                f"{request.message}")

    def unary(inner: Callable):
        async def behavior(request, context):
            await refuse_undecodable(request, context)
            return await inner(request, context)
        return behavior

    def streaming(inner: Callable):
        async def behavior(request, context) -> AsyncIterator:
            await refuse_undecodable(request, context)
            async with contextlib.aclosing(inner(request, context)) as messages:
                async for message in messages:
                    yield message
        return behavior

    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(
            streaming(handler.unary_stream), deserialize, handler.response_serializer)
    return grpc.unary_unary_rpc_method_handler(
        unary(handler.unary_unary), deserialize, handler.response_serializer)
