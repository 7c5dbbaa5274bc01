"""Request ids are the client's own within its tenant (issue 32): two tenants may use the same
id at once, and a live id of another tenant reads as unknown, never as ALREADY_EXISTS (which
would tell a prober that id is live). The front doors key their live requests by the scoped id
below, and an engine runs each request under it; replies carry the client's id."""

from __future__ import annotations

# Never in a request id (REQUEST_ID_PATTERN: [A-Za-z0-9._:-]), so a scoped id splits at its
# last separator one way only: two (tenant, id) pairs never share a scoped id.
SEPARATOR = "/"


def scoped_request_id(tenant: str | None, request_id: str) -> str:
    """The id a request runs under: the client's own where no tenant is known (an open
    service), else the tenant's name and the client's id."""
    return request_id if tenant is None else f"{tenant}{SEPARATOR}{request_id}"
