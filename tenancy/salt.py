"""The cache salt a tenant's requests are hashed with: HMAC-SHA256(deployment secret, cache
group, client salt). The client's own `cache_salt` still separates its requests from its
other requests, but can never reach another group's blocks: it is only ever an input here.

The secret is shared by the routers and the engines of one deployment (--tenant-secret-file)
and never leaves them; the index sees only block hashes made with the derived salt, so whoever
reads the index cannot tell which prompt a hash stands for. Without a secret file each
process draws its own: tenants stay apart, but two routers (or a router restarted) no longer
send the same prompt to the same cache.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
from pathlib import Path

TENANT_SECRET_FILE_ENV = "PAGEDGEN_TENANT_SECRET_FILE"
MIN_SECRET_BYTES = 16
log = logging.getLogger("tenancy.salt")


def tenant_salt(secret: bytes, cache_group: str, client_salt: str) -> str:
    """64 hex characters: well inside the engine's cache_salt limit, so the router can send it
    on as the request's salt."""
    # A separator no group name holds: ("ab", "c") and ("a", "bc") must differ.
    message = cache_group.encode() + b"\0" + client_salt.encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def read_secret(flag: str | None) -> bytes | None:
    """The secret of --tenant-secret-file (else $PAGEDGEN_TENANT_SECRET_FILE), None when
    neither is set. ValueError when the file cannot be read or holds fewer than
    MIN_SECRET_BYTES bytes (surrounding whitespace aside)."""
    path = flag if flag is not None else os.environ.get(TENANT_SECRET_FILE_ENV)
    if path is None:
        return None
    source = "--tenant-secret-file" if flag is not None else TENANT_SECRET_FILE_ENV
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as error:
        raise ValueError(f"{source} {path}: cannot read it: {error.strerror or error}") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{source} {path} must hold a secret of at least {MIN_SECRET_BYTES} "
                         f"bytes (e.g. `openssl rand -hex 32 > FILE`), got {len(secret)}")
    return secret


def secret_or_random(secret: bytes | None) -> bytes:
    """`secret`, or one for this process alone (said in the log) when there is none."""
    if secret is not None:
        return secret
    log.warning("no --tenant-secret-file (or $%s): tenants' cache salts use a secret of this "
                "process alone, so routers and engines that should share cached prefixes "
                "must be given one file", TENANT_SECRET_FILE_ENV)
    return secrets.token_bytes(32)
