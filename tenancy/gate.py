"""Who is calling: one check for every gRPC method (an interceptor) and every HTTP request
(openai_api/auth.py), so no method can be reached around it.

A caller is one of:
- a client with a valid API key (`authorization: Bearer KEY`): its tenant, whose limits this
  server enforces (it is the front door);
- a router, known by its certificate's role (mutual TLS, trust/identity.py): it checked the
  client's key itself and names the tenant in `x-pagedgen-tenant`; its limits were counted
  there. Without TLS nobody has a role, so that header is trusted from nobody: an engine
  behind a router in plain text takes no keys of its own and sees no tenants;
- anyone, when the server takes no keys (no --api-key, --api-key-file): no tenant at all.
Health and reflection stay open: probes and grpcurl's listing carry no key.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from openai_api.call_context import HttpCallContext
from tenancy.keyring import KeyRing
from tenancy.keys import Tenant
from trust.identity import ROUTER_ROLE, peer_identity

# Told of a call refused before its method ran: (its full method name, the status code). A server
# counts the refused generation requests with it as its servicer counts its own refusals.
RefusalHook = Callable[[str, grpc.StatusCode], None]

TENANT_METADATA = "x-pagedgen-tenant"
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")
NO_KEY = "this server needs an API key: send the metadata authorization: Bearer <key>"
BAD_KEY = "the API key is not valid (authorization: Bearer <key>)"


class Unauthenticated(Exception):
    """No valid key: the caller gets this message and nothing else."""


@dataclass(frozen=True, slots=True)
class Caller:
    tenant: str | None  # owns the requests it starts; None: no tenants (an open server)
    settings: Tenant | None = None  # set when this server checked the key: its limits apply
    via: str = "open"  # "key", "router" or "open"


OPEN_CALLER = Caller(None)


class Gate:
    def __init__(self, keyring: KeyRing | None) -> None:
        self.keyring = keyring  # None: no keys taken, every caller is let in

    @property
    def takes_keys(self) -> bool:
        return self.keyring is not None

    def from_authorization(self, authorization: str | None) -> Caller:
        """The caller of an `authorization` header (HTTP) or metadata value (gRPC)."""
        if self.keyring is None:
            return OPEN_CALLER
        if not authorization:
            raise Unauthenticated(NO_KEY)
        scheme, _, key = authorization.partition(" ")
        tenant = (self.keyring.table.tenant_for(key.strip()) if scheme.lower() == "bearer"
                  else None)
        if tenant is None:
            raise Unauthenticated(BAD_KEY)
        return Caller(tenant.name, tenant, "key")

    def from_metadata(self, metadata, context) -> Caller:
        """A gRPC call's caller; `context` (None inside an interceptor) for the peer's
        certificate."""
        authorization = tenant_name = None
        for key, value in metadata or ():
            if key == "authorization":
                authorization = value
            elif key == TENANT_METADATA:
                tenant_name = value
        if context is not None and _peer_role(context) == ROUTER_ROLE:
            return Caller(tenant_name or None, None, "router")
        return self.from_authorization(authorization)

    def caller(self, context) -> Caller:
        """The caller of a servicer call, gRPC's or HTTP's (Unauthenticated when none)."""
        if isinstance(context, HttpCallContext):  # (the HTTP API checked the key; None: a
            return context.caller or OPEN_CALLER  # call of the server's own, e.g. token texts)
        return self.from_metadata(context.invocation_metadata(), context)


def _peer_role(context) -> str | None:
    identity = peer_identity(context)  # None in plain text: nobody has a role
    return None if identity is None else identity.role


class GateInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but health and reflection without a valid key or a router's
    certificate: UNAUTHENTICATED, and the method is never run (`on_refused` is told)."""

    def __init__(self, gate: Gate, on_refused: RefusalHook | None = None) -> None:
        self.gate = gate
        self.on_refused = on_refused

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        try:  # the key alone decides most calls: they run as they are, nothing wrapped
            self.gate.from_metadata(handler_call_details.invocation_metadata, None)
            return handler
        except Unauthenticated:
            pass  # a router's certificate may still let it in: that needs the context
        return _checked(handler, self.gate, handler_call_details.method, self.on_refused)


def _checked(handler: grpc.RpcMethodHandler, gate: Gate, method: str,
             on_refused: RefusalHook | None) -> grpc.RpcMethodHandler:
    """`handler` run only after `gate` lets its caller in (it aborts otherwise)."""

    async def admit(context) -> None:
        try:
            gate.caller(context)
        except Unauthenticated as error:
            if on_refused is not None:
                on_refused(method, grpc.StatusCode.UNAUTHENTICATED)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(error))

    def unary(inner):
        async def behavior(request, context):
            await admit(context)
            return await inner(request, context)
        return behavior

    def streaming(inner):
        async def behavior(request, context) -> AsyncIterator:
            await admit(context)
            async for message in inner(request, context):
                yield message
        return behavior

    kinds: dict[tuple[bool, bool], tuple[Callable, Callable]] = {
        (False, False): (grpc.unary_unary_rpc_method_handler, unary(handler.unary_unary)),
        (False, True): (grpc.unary_stream_rpc_method_handler, streaming(handler.unary_stream)),
        (True, False): (grpc.stream_unary_rpc_method_handler, unary(handler.stream_unary)),
        (True, True): (grpc.stream_stream_rpc_method_handler,
                       streaming(handler.stream_stream)),
    }
    make, behavior = kinds[(handler.request_streaming, handler.response_streaming)]
    return make(behavior, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
