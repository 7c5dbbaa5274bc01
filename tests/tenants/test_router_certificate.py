"""An engine believes the tenant a call names (x-pagedgen-tenant) only from a peer whose
verified certificate's role is router (mutual TLS, real certificates from trust/certs.py);
from a client's or an engine's certificate, or in plain text, the header alone lets nobody in.
The gate runs in a real grpc.aio server; its method answers with the caller the gate found."""

from __future__ import annotations

import asyncio

import grpc

from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from tenancy.door import TenantDoor
from tenancy.gate import TENANT_METADATA, Gate, GateInterceptor
from tenancy.keyring import KeyRing
from tests.tenants.conftest import bearer, write_keys
from trust.certs import ensure_leaf
from trust.credentials import TlsFiles, aio_channel


class _WhoCalls(pb_grpc.GenerationServicer):
    def __init__(self, door: TenantDoor) -> None:
        self.door = door

    async def ModelInfo(self, request, context) -> pb.ModelInfoResponse:
        caller = await self.door.caller(context)
        return pb.ModelInfoResponse(served_model_name=f"{caller.via}:{caller.tenant}")


def _files(folder, role: str) -> TlsFiles:
    issued = ensure_leaf(folder, role)
    return TlsFiles(issued.cert, issued.key, folder / "ca.pem")


async def _callers(tmp_path) -> dict[str, str]:
    keys = write_keys(tmp_path / "keys.toml", {"bob": {}})
    door = TenantDoor(Gate(KeyRing.from_file(keys.path)), b"s" * 32)
    server = grpc.aio.server(interceptors=[GateInterceptor(door.gate)])
    pb_grpc.add_GenerationServicer_to_server(_WhoCalls(door), server)
    engine_tls = _files(tmp_path, "engine").load()
    tls_port = server.add_secure_port("127.0.0.1:0", engine_tls.server_credentials())
    plain_port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    named = ((TENANT_METADATA, "alice"),)
    attempts = {
        "router certificate": ("router", tls_port, named),
        "client certificate": ("client", tls_port, named),
        "engine certificate": ("engine", tls_port, named),
        "client certificate and bob's key": ("client", tls_port, (*named, *bearer(keys["bob"]))),
        "plain text": (None, plain_port, named),
    }
    answers = {}
    try:
        for name, (role, port, metadata) in attempts.items():
            tls = None if role is None else _files(tmp_path, role).load()
            async with aio_channel(f"127.0.0.1:{port}", tls, "engine" if tls else None) as channel:
                try:
                    reply = await pb_grpc.GenerationStub(channel).ModelInfo(
                        pb.ModelInfoRequest(), timeout=30, metadata=metadata)
                    answers[name] = reply.served_model_name
                except grpc.aio.AioRpcError as error:
                    answers[name] = error.code().name
    finally:
        await server.stop(0)
    return answers


def test_the_tenant_header_is_believed_from_a_router_certificate_only(tmp_path):
    assert asyncio.run(_callers(tmp_path)) == {
        "router certificate": "router:alice",
        "client certificate": "UNAUTHENTICATED",
        "engine certificate": "UNAUTHENTICATED",
        "client certificate and bob's key": "key:bob",
        "plain text": "UNAUTHENTICATED",
    }
