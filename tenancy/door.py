"""A front door's tenancy rules, one object for the engine's servicer and the router's: who
calls, the cache salt it gets, and what its tenant may do (priority, live requests, pins).

Limits are counted where the key was checked (Caller.settings is set): the router for the
requests it routes, an engine for the clients it serves itself. A router's calls to an engine
arrive with the tenant's name only (the engine needs it for Abort) and its salt already
derived, so nothing is counted or derived twice."""

from __future__ import annotations

import grpc

from tenancy.gate import Caller, Gate, Unauthenticated
from tenancy.ledger import TenantLedger
from tenancy.salt import tenant_salt


class TenantRefused(Exception):
    """The tenant may not do this (PERMISSION_DENIED) or holds too much (RESOURCE_EXHAUSTED)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class TenantDoor:
    def __init__(self, gate: Gate | None = None, secret: bytes = b"") -> None:
        self.gate = gate or Gate(None)
        self.secret = secret  # the deployment's (tenancy/salt.py); unused by an open door
        self.ledger = TenantLedger()

    async def caller(self, context) -> Caller:
        """The call's caller; the call is aborted (UNAUTHENTICATED) when it has none."""
        try:
            return self.gate.caller(context)
        except Unauthenticated as error:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, str(error))
            raise  # (context.abort raises; an HttpCallContext's too)

    def cache_salt(self, caller: Caller, client_salt: str) -> str:
        """The salt the request's blocks are hashed with: the client's own where no tenant was
        authenticated here (an open server, or a router that derived it already)."""
        if caller.settings is None:
            return client_salt
        return tenant_salt(self.secret, caller.settings.salt_group, client_salt)

    def check_priority(self, caller: Caller, priority: int) -> None:
        settings = caller.settings
        if priority and settings is not None and not settings.may_set_priority:
            raise TenantRefused(
                grpc.StatusCode.PERMISSION_DENIED,
                f"priority must be 0 for tenant {settings.name!r} (may_set_priority is not "
                f"granted in the key file), got {priority}")

    def enter(self, caller: Caller) -> None:
        """Counts one more live request of the caller's tenant (leave() when it ends)."""
        settings = caller.settings
        if settings is None:
            return
        if not self.ledger.enter(settings.name, settings.max_live_requests):
            raise TenantRefused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"live requests of tenant {settings.name!r} must be at most "
                f"{settings.max_live_requests} (max_live_requests in the key file), got "
                f"{settings.max_live_requests + 1}: retry when one has finished")

    def leave(self, caller: Caller) -> None:
        if caller.settings is not None:
            self.ledger.leave(caller.settings.name)

    def check_pin(self, caller: Caller, chain: list[bytes]) -> None:
        """Refuses a pin of `chain` that would take the tenant past its pin budget."""
        settings = caller.settings
        if settings is None or settings.max_pins is None or not chain:
            return
        held = self.ledger.would_hold(settings.name, chain[-1], len(chain))
        if held > settings.max_pins:
            raise TenantRefused(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"pinned blocks of tenant {settings.name!r} must be at most "
                f"{settings.max_pins} (max_pins in the key file), got {held} with this "
                f"prefix's {len(chain)}: unpin some first")

    def record_pin(self, caller: Caller, chain: list[bytes], ttl_s: float, unpin: bool) -> None:
        settings = caller.settings
        if settings is None or not chain:
            return
        if unpin:
            self.ledger.unpin(settings.name, chain[-1])
        else:
            self.ledger.pin(settings.name, chain[-1], len(chain), ttl_s)
