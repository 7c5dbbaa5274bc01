"""Who is on the other end of a gRPC connection, read from its client certificate.

The naming scheme (the one pagedgen-certs writes, and the only one read here) is a URI subject
alternative name:

    spiffe://pagedgen/engine/<engine_id>   an engine; the id it may register under at the index
    spiffe://pagedgen/engine               an engine whose certificate names no id
    spiffe://pagedgen/router               a router
    spiffe://pagedgen/index                the prefix index
    spiffe://pagedgen/client               an end client (a tool, a test)

A certificate is only believed because the server checked it against its CA during the handshake
(mutual TLS): gRPC puts the verified peer certificate's names in the auth context, and nothing
else is read. A certificate with no such URI, or more than one, names no role: the peer is
treated as having no certificate.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

SPIFFE_PREFIX = "spiffe://pagedgen/"
ROLES = ("engine", "router", "index", "client")
ENGINE_ROLE, ROUTER_ROLE, INDEX_ROLE, CLIENT_ROLE = ROLES


@dataclass(frozen=True)
class PeerIdentity:
    role: str  # "engine" | "router" | "index" | "client"
    engine_id: str | None  # engines' certificates name it; None: any id (or not an engine)


def identity_uri(role: str, engine_id: str | None = None) -> str:
    """The URI SAN a certificate for `role` (and, for an engine, `engine_id`) carries."""
    if role not in ROLES:
        raise ValueError(f"role: {role!r} is not one of {', '.join(ROLES)}")
    if engine_id is not None and role != ENGINE_ROLE:
        raise ValueError(f"engine_id: only an engine certificate names one, not a {role}'s")
    if engine_id is not None and (not engine_id or "/" in engine_id):
        raise ValueError(f"engine_id: {engine_id!r} must be non-empty and hold no '/'")
    return SPIFFE_PREFIX + role + (f"/{engine_id}" if engine_id is not None else "")


def identity_from_uri(uri: str) -> PeerIdentity | None:
    """The identity a URI SAN of our scheme names; None for any other URI."""
    if not uri.startswith(SPIFFE_PREFIX):
        return None
    role, _, engine_id = uri[len(SPIFFE_PREFIX):].partition("/")
    if role not in ROLES or "/" in engine_id or (engine_id and role != ENGINE_ROLE):
        return None
    return PeerIdentity(role, engine_id or None)


def identity_from_names(names) -> PeerIdentity | None:
    """The identity a certificate's subject alternative names give (exactly one URI of our
    scheme among them), else None."""
    named = {identity_from_uri(n.decode() if isinstance(n, bytes) else n) for n in names}
    named.discard(None)
    return named.pop() if len(named) == 1 else None


def peer_identity(context) -> PeerIdentity | None:
    """The verified identity of a grpc.aio ServicerContext's peer; None on a plain-text
    connection, or a TLS one whose client presented no certificate (or one naming no role)."""
    auth = context.auth_context()
    if auth.get("transport_security_type") != [b"ssl"]:
        return None
    return identity_from_names(auth.get("x509_subject_alternative_name", ()))


def peer_certificate_digest(context) -> str | None:
    """SHA-256 of the peer's verified certificate (hex), None without one: tells apart two
    engines whose certificates name no engine id."""
    pems = context.auth_context().get("x509_pem_cert")
    return hashlib.sha256(pems[0]).hexdigest() if pems else None
