"""pagedgen-keys: add an API key to a key file (creating it, and the tenant's table, when
missing) and print the key, once: only its SHA-256 is written.

    pagedgen-keys add --file keys.toml --tenant acme [--max-live-requests 64] [--max-pins 512]
                      [--may-set-priority] [--may-read-stats] [--cache-group shared]
                      [--label ci]
    pagedgen-keys hash KEY      # the SHA-256 the file stores for KEY

Servers read the file again on SIGHUP (`kill -HUP PID`). To remove a key, delete its [[keys]]
entry and send SIGHUP.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
from pathlib import Path

from tenancy.keys import (
    DEFAULT_MAX_LIVE_REQUESTS,
    DEFAULT_MAX_PINS,
    TENANT_NAME,
    Tenant,
    hash_key,
    load_key_file,
)

KEY_PREFIX = "pg-"


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def add_key(path: Path, tenant: str, label: str = "", settings: dict | None = None,
            given: dict | None = None) -> str:
    """Appends a new key of `tenant` to the file at `path` (and a [tenants.NAME] table with
    `settings` when the tenant has none); returns the key. ValueError when the file, or the
    file as it would be, does not load, or when one of `given` (the settings the caller
    named) differs from an existing tenant's: its table stays as it is, so it would be
    ignored."""
    if not TENANT_NAME.fullmatch(tenant):
        raise ValueError(f"--tenant must be 1 to 64 characters of [A-Za-z0-9._-], got {tenant!r}")
    text = path.read_text() if path.exists() else ""
    # Every [tenants.NAME] table, those with no key yet (written by hand, or their keys
    # deleted) too: one of them must not get a second table.
    tables = load_key_file(path).tables if text else {}
    existing = tables.get(tenant)
    differing = sorted(name for name, value in (given or {}).items()
                       if existing is not None and not _same(name, value, existing))
    if differing:
        flags = ", ".join("--" + name.replace("_", "-") for name in differing)
        raise ValueError(
            f"tenant {tenant!r} exists in {path} with other settings: {flags} would not change "
            f"it (they set a new tenant's table); edit [tenants.{tenant}] in the file and "
            f"send SIGHUP to the servers, or add the key without them")
    if existing is None:
        lines = [f"\n[tenants.{tenant}]"]
        for name, value in (settings or {}).items():
            lines.append(f"{name} = {_toml(value)}")
        text += "\n".join(lines) + "\n"
    key = new_key()
    entry = ["\n[[keys]]", f"tenant = {_toml(tenant)}", f"sha256 = {_toml(hash_key(key))}"]
    if label:
        entry.append(f"label = {_toml(label)}")
    text += "\n".join(entry) + "\n"
    # Written whole, then moved into place: a server reloading meanwhile reads the old file or
    # the new one, never half of it.
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.chmod(partial, 0o600)
    try:
        load_key_file(partial)  # the file as it will be must load
    except ValueError:
        partial.unlink()
        raise
    partial.replace(path)
    return key


def _same(name: str, value, tenant: Tenant) -> bool:
    """Whether a setting given on the command line is what `tenant`'s table says already."""
    if name == "cache_group":  # (its own name is what an empty group means)
        return (value or tenant.name) == tenant.salt_group
    if value == -1 and not isinstance(value, bool):  # -1, no limit, loads as None
        value = None
    return value == getattr(tenant, name)


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    return json.dumps(str(value))  # a TOML basic string: JSON's escapes are TOML's


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="pagedgen-keys", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    add = sub.add_parser("add", help="add a key of a tenant and print it once")
    add.add_argument("--file", type=Path, required=True, help="the key file (created if absent)")
    add.add_argument("--tenant", required=True)
    add.add_argument("--label", default="", help="which key this is, for its owner")
    # (Defaults of None: a setting named for a tenant that exists is refused, not ignored.)
    add.add_argument("--may-set-priority", action="store_true", default=None,
                     help="a new tenant may set GenerateRequest.priority")
    add.add_argument("--may-read-stats", action="store_true", default=None,
                     help="a new tenant may read EngineStats, ModelInfo's model path and ids, "
                          "and which replicas ran its requests (the operator's)")
    add.add_argument("--max-live-requests", type=int, default=None,
                     help="a new tenant's unfinished requests at once (-1: no limit; default "
                          f"{DEFAULT_MAX_LIVE_REQUESTS})")
    add.add_argument("--max-pins", type=int, default=None,
                     help="a new tenant's blocks pinned at once through PinPrefix (-1: no "
                          f"limit; default {DEFAULT_MAX_PINS})")
    add.add_argument("--cache-group", default=None,
                     help="a new tenant shares cached blocks with the tenants of this group "
                          "(default: none but itself)")
    show = sub.add_parser("hash", help="print the SHA-256 a key file stores for KEY")
    show.add_argument("key")
    args = p.parse_args(argv)
    if args.command == "hash":
        print(hash_key(args.key))
        return
    for flag in ("max_live_requests", "max_pins"):  # named as typed, before any file is read
        value = getattr(args, flag)
        if value is not None and value < -1:
            p.error(f"--{flag.replace('_', '-')} must be >= 0, or -1 for no limit, got {value}")
    if args.cache_group is not None and not TENANT_NAME.fullmatch(args.cache_group):
        p.error(f"--cache-group must be 1 to 64 characters of [A-Za-z0-9._-], got "
                f"{args.cache_group!r}")
    defaults = {"may_set_priority": False, "max_live_requests": DEFAULT_MAX_LIVE_REQUESTS,
                "max_pins": DEFAULT_MAX_PINS, "may_read_stats": False, "cache_group": ""}
    given = {name: getattr(args, name) for name in defaults if getattr(args, name) is not None}
    settings = {name: default if getattr(args, name) is None else getattr(args, name)
                for name, default in defaults.items()}
    if not settings["cache_group"]:
        del settings["cache_group"]
    try:
        key = add_key(args.file, args.tenant, args.label, settings, given)
    except ValueError as error:
        p.exit(2, f"pagedgen-keys: {error}\n")
    print(key)
    print(f"(the key of tenant {args.tenant!r}, shown once: {args.file} keeps its SHA-256 "
          "only; send SIGHUP to running servers to load it)", file=sys.stderr)


if __name__ == "__main__":
    main()
