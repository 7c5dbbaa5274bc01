"""Who may call which PrefixIndex method, decided in one table (issue 32).

On a TLS index every peer holds a certificate (mutual TLS); its role (trust/identity.py) picks
the methods it may call:
- engines write: Register, Heartbeat, Apply (ForgetOp rides in Apply) — and only for engine ids
  of their own: the id their certificate names, when it names one; and in any case ids they
  registered themselves (the principal is folded into the registration's nonce, so a lease held
  by another certificate is another process's);
- routers read: Lookup, Stats, WatchResidency;
- anything else is PERMISSION_DENIED; a certificate naming no role UNAUTHENTICATED (a caller
  with no certificate at all is refused by the TLS handshake, before any method).
A plain-text index (--insecure) knows nobody and allows everything, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from trust.identity import ENGINE_ROLE, ROUTER_ROLE, peer_certificate_digest, peer_identity

METHOD_ROLES = {
    "Register": ENGINE_ROLE, "Heartbeat": ENGINE_ROLE, "Apply": ENGINE_ROLE,
    "Lookup": ROUTER_ROLE, "Stats": ROUTER_ROLE, "WatchResidency": ROUTER_ROLE,
}
PRINCIPAL_SEPARATOR = "|"  # never in an engine id (validate.py) nor in a digest


@dataclass(frozen=True, slots=True)
class Caller:
    principal: str | None  # who owns what an engine registers; None: plain text, anyone
    engine_id: str | None = None  # the one id its certificate allows; None: any of its own

    def stored_nonce(self, nonce: str) -> str:
        """The nonce the registration is held under: another principal never matches it."""
        return nonce if self.principal is None else self.principal + PRINCIPAL_SEPARATOR + nonce

    def owns(self, stored_nonce: str) -> bool:
        if self.principal is None:
            return True
        return stored_nonce.startswith(self.principal + PRINCIPAL_SEPARATOR)


ANYONE = Caller(None)


class Denied(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _article(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


def authorize(method: str, context, secure: bool, engine_id: str | None = None) -> Caller:
    """The caller of `method` (on `engine_id`, for engines' methods), or Denied."""
    if not secure:
        return ANYONE
    peer = peer_identity(context)
    if peer is None:
        raise Denied(grpc.StatusCode.UNAUTHENTICATED,
                     "the prefix index takes only callers with a client certificate signed by "
                     "its CA naming a pagedgen role (mutual TLS; pagedgen-certs makes them)")
    wanted = METHOD_ROLES.get(method)
    if peer.role != wanted:
        raise Denied(grpc.StatusCode.PERMISSION_DENIED,
                     f"{method}: {_article(peer.role)} {peer.role} certificate may not call "
                     f"it; it is for {wanted or 'nobody'}s")
    if wanted != ENGINE_ROLE:
        return Caller(peer.role)
    if peer.engine_id is not None and engine_id != peer.engine_id:
        raise Denied(grpc.StatusCode.PERMISSION_DENIED,
                     f"{method}: engine_id {engine_id!r} is not this certificate's; it allows "
                     f"only {peer.engine_id!r}")
    principal = (f"engine/{peer.engine_id}" if peer.engine_id is not None
                 else f"engine@{peer_certificate_digest(context)}")
    return Caller(principal, peer.engine_id)
