"""The tenancy flags of pagedgen-engine and pagedgen-router (pagedgen-stack passes them on):
--api-key-file and --tenant-secret-file; --api-key (openai_api/cli_args.py) stays as the
one-tenant shorthand."""

from __future__ import annotations

import argparse
import os

from tenancy.door import TenantDoor
from tenancy.gate import Gate
from tenancy.keyring import KeyRing
from tenancy.keys import single_key_table
from tenancy.salt import TENANT_SECRET_FILE_ENV, read_secret, secret_or_random

API_KEY_FILE_ENV = "PAGEDGEN_API_KEY_FILE"


def add_tenancy_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--api-key-file", default=None,
                   help="TOML file of API keys (stored as SHA-256) and their tenants' settings "
                        "(pagedgen-keys add writes it); every gRPC and HTTP call but health "
                        "and reflection needs authorization: Bearer KEY; read again on SIGHUP "
                        f"(default: ${API_KEY_FILE_ENV})")
    p.add_argument("--tenant-secret-file", default=None,
                   help="the deployment's secret (at least 16 bytes) that tenants' cache salts "
                        "are derived with; the same file on every router and engine "
                        f"(default: ${TENANT_SECRET_FILE_ENV}; unset: one of this process's "
                        "own)")


def resolve_tenancy_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Fills in args.keyring (None: no keys taken) and args.tenant_secret (None: unset);
    p.error on a key file or secret that does not load. Needs args.api_key resolved."""
    path = args.api_key_file if args.api_key_file is not None else os.environ.get(
        API_KEY_FILE_ENV)
    if path is not None and args.api_key is not None:
        p.error("give one of --api-key (one key) or --api-key-file (keys of tenants), got both "
                f"(--api-key-file or ${API_KEY_FILE_ENV}: {path})")
    try:
        if path is not None:
            args.keyring = KeyRing.from_file(path)
        elif args.api_key is not None:
            args.keyring = KeyRing(single_key_table(args.api_key))
        else:
            args.keyring = None
        args.tenant_secret = read_secret(args.tenant_secret_file)
    except ValueError as error:
        p.error(str(error))


def door_from_args(args: argparse.Namespace) -> TenantDoor:
    """The server's door; with keys, the keys are read again on SIGHUP once the caller's loop
    runs (keyring.reload_on_sighup)."""
    if args.keyring is None:
        return TenantDoor()
    return TenantDoor(Gate(args.keyring), secret_or_random(args.tenant_secret))
