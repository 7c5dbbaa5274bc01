"""A front door's tenancy rules, one object for the engine's servicer and the router's: who
calls, the cache salt it gets, and what its tenant may do (priority, live requests, pins).

Limits are counted where the key was checked (Caller.settings is set): the router for the
requests it routes, an engine for the clients it serves itself. A router's calls to an engine
arrive with the tenant's name only (the engine needs it for Abort) and its salt already
derived, so nothing is counted or derived twice."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from tenancy.gate import Caller, Gate, Unauthenticated
from tenancy.ledger import Pin, TenantLedger
from tenancy.salt import tenant_salt


class TenantRefused(Exception):
    """The tenant may not do this (PERMISSION_DENIED) or holds too much (RESOURCE_EXHAUSTED)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class PinReservation:
    """A pin counted in a tenant's ledger before it is made (tenant None: nothing counted)."""

    tenant: str | None
    prefix: bytes
    previous: Pin | None  # the same prefix's entry before, put back if the pin is not made


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

    def check_stats(self, caller: Caller, what: str) -> None:
        """EngineStats is the operator's: refused to a tenant not granted may_read_stats (a
        service's call, such as a router's poll, has no tenant)."""
        settings = caller.settings
        if settings is not None and not settings.may_read_stats:
            raise TenantRefused(
                grpc.StatusCode.PERMISSION_DENIED,
                f"{what} is not for tenant {settings.name!r} (may_read_stats is not granted "
                f"in the key file)")

    def shows_internals(self, caller: Caller) -> bool:
        """Whether the caller may see the deployment's own names (may_read_stats, as for
        EngineStats): the server's model path (else its name), which engine and which process
        of it answers (ModelInfo's engine_id and instance_id), and through a router which
        replicas ran a request (trailing metadata `pagedgen-replicas`)."""
        return caller.settings is None or caller.settings.may_read_stats

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

    def reserve_pin(self, caller: Caller, chain: list[bytes], ttl_s: float) -> PinReservation:
        """Counts a pin of `chain` against the tenant's pin budget now, before the pin is made
        (calls at the same time each see the others'), or refuses it past the budget. Keep
        the reservation when the pin is made; cancel_pin() it when it is not."""
        settings = caller.settings
        if settings is not None and settings.max_pins == 0:
            # Not a budget spent but a right not granted: no unpinning would let it through.
            raise TenantRefused(
                grpc.StatusCode.PERMISSION_DENIED,
                f"tenant {settings.name!r} may not pin prefixes (max_pins is 0 in the key file)")
        if settings is None or not chain:
            return PinReservation(None, b"", None)
        name, prefix = settings.name, chain[-1]
        if settings.max_pins is not None:
            held = self.ledger.would_hold(name, prefix, len(chain))
            if held > settings.max_pins:
                raise TenantRefused(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"pinned blocks of tenant {name!r} must be at most "
                    f"{settings.max_pins} (max_pins in the key file), got {held} with this "
                    f"prefix's {len(chain)}: unpin some first")
        previous = self.ledger.unpin(name, prefix)
        self.ledger.pin(name, prefix, len(chain), ttl_s)
        return PinReservation(name, prefix, previous)

    def cancel_pin(self, reservation: PinReservation) -> None:
        """The pin was not made: the tenant's ledger as before reserve_pin()."""
        if reservation.tenant is None:
            return
        self.ledger.unpin(reservation.tenant, reservation.prefix)
        if reservation.previous is not None:
            self.ledger.restore(reservation.tenant, reservation.prefix, reservation.previous)

    def record_unpin(self, caller: Caller, chain: list[bytes]) -> None:
        if caller.settings is not None and chain:
            self.ledger.unpin(caller.settings.name, chain[-1])
