"""TLS files turned into gRPC credentials and channels, in one place for every server and client.

Clients between the services verify the peer's role, not its address: the TLS target name is
`<role>.pagedgen.internal` (grpc.ssl_target_name_override), a DNS name only certificates of that
role carry (trust/certs.py). So the router talks only to replicas presenting an engine
certificate, and engines and routers only to an index presenting the index's, whatever address
was registered or configured.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc

from trust.certs import role_dns_name


@dataclass(frozen=True)
class TlsFiles:
    cert: Path  # this process's certificate (chain), PEM
    key: Path  # its private key, PEM
    ca: Path  # the CA that signs every peer's certificate, PEM

    def load(self) -> TlsMaterial:
        return TlsMaterial(self.cert.read_bytes(), self.key.read_bytes(), self.ca.read_bytes(),
                           self)


@dataclass(frozen=True)
class TlsMaterial:
    cert: bytes
    key: bytes
    ca: bytes
    files: TlsFiles | None = None  # where they were read (Python's ssl, uvicorn, take paths)

    def server_credentials(self, require_client_cert: bool = True) -> grpc.ServerCredentials:
        """require_client_cert=False: server-authenticated TLS, for end clients; grpcio then
        does not ask for a client certificate at all, so no peer has a role."""
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=require_client_cert)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Presents this process's certificate; trusts servers signed by the CA."""
        return grpc.ssl_channel_credentials(self.ca, self.key, self.cert)


def channel_options(peer_role: str | None, options=()) -> list:
    """`options` plus the target-name override that makes the peer prove `peer_role`."""
    extra = [("grpc.ssl_target_name_override", role_dns_name(peer_role))] if peer_role else []
    return [*options, *extra]


def aio_channel(target: str, tls: TlsMaterial | None, peer_role: str | None = None,
                options=()) -> grpc.aio.Channel:
    """A grpc.aio channel: mutual TLS when `tls` is given (the peer must hold a `peer_role`
    certificate when one is named; else its certificate must name the target's host), plain
    text otherwise."""
    if tls is None:
        return grpc.aio.insecure_channel(target, options=list(options))
    return grpc.aio.secure_channel(target, tls.channel_credentials(),
                                   options=channel_options(peer_role, options))


def end_client_channel(target: str, ca: bytes | None) -> grpc.Channel:
    """An end client's blocking channel to a front door: server-authenticated TLS trusting
    `ca` (no client certificate; the server must name the target's host); plain text for
    None."""
    if ca is None:
        return grpc.insecure_channel(target)
    return grpc.secure_channel(target, grpc.ssl_channel_credentials(ca))


def sync_channel(target: str, tls: TlsMaterial | None, peer_role: str | None = None,
                 options=()) -> grpc.Channel:
    """aio_channel's blocking twin (launchers' health checks)."""
    if tls is None:
        return grpc.insecure_channel(target, options=list(options))
    return grpc.secure_channel(target, tls.channel_credentials(),
                               options=channel_options(peer_role, options))
