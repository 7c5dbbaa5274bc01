"""The key file: API keys, stored as their SHA-256, mapped to tenants and their settings.

    # pagedgen-keys add --file keys.toml --tenant acme   (prints the new key once)
    [tenants.acme]
    may_set_priority = false   # GenerateRequest.priority != 0 is refused (PERMISSION_DENIED)
    max_live_requests = 64     # unfinished requests at once (RESOURCE_EXHAUSTED past it)
    max_pins = 512             # blocks pinned at once through PinPrefix (0: no pins)
    may_read_stats = false     # EngineStats (else PERMISSION_DENIED), the deployment's names
                               # (ModelInfo's model path, else its name; engine and replica ids)
    cache_group = "acme"       # tenants of one group share cached blocks (default: its name)

    [[keys]]
    tenant = "acme"
    sha256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    label = "ci"               # optional: which key this is, for its owner

Only hashes are stored: a leaked key file gives no key. Keys are compared by their hash, in a
dict: the hash of a guess says nothing about how close it was.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_MAX_LIVE_REQUESTS = 256
DEFAULT_MAX_PINS = 0  # pins hold blocks every tenant's requests need: granted, not assumed
TENANT_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
_TENANT_FIELDS = {"may_set_priority", "max_live_requests", "max_pins", "cache_group",
                  "may_read_stats"}
_KEY_FIELDS = {"tenant", "sha256", "label"}


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    may_set_priority: bool = False
    max_live_requests: int | None = DEFAULT_MAX_LIVE_REQUESTS  # None: no limit
    max_pins: int | None = DEFAULT_MAX_PINS  # pinned blocks at once; None: no limit
    cache_group: str = ""  # tenants with the same group share the cache; "" = its name
    # The server's own state: EngineStats (counters every tenant's traffic moves, and behind a
    # router its replicas' addresses), ModelInfo's model path, engine_id and instance_id, and
    # which replicas ran a request (the router's pagedgen-replicas). An operator's, not granted.
    may_read_stats: bool = False

    @property
    def salt_group(self) -> str:
        return self.cache_group or self.name


# The one tenant of --api-key: the operator's own key, trusted with everything.
SINGLE_KEY_TENANT = Tenant("default", may_set_priority=True, max_live_requests=None,
                           max_pins=None, may_read_stats=True)


@dataclass(frozen=True, slots=True)
class KeyTable:
    tenants_by_hash: dict[str, Tenant] = field(default_factory=dict)
    source: str = ""  # the file it came from, or --api-key
    tables: dict[str, Tenant] = field(default_factory=dict)  # every [tenants.NAME], keyed or not

    def tenant_for(self, key: str) -> Tenant | None:
        return self.tenants_by_hash.get(hash_key(key))

    @property
    def tenants(self) -> list[Tenant]:
        return sorted({t.name: t for t in self.tenants_by_hash.values()}.values(),
                      key=lambda t: t.name)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def single_key_table(key: str, source: str = "--api-key") -> KeyTable:
    return KeyTable({hash_key(key): SINGLE_KEY_TENANT}, source)


def load_key_file(path: Path) -> KeyTable:
    """The key file at `path`; ValueError naming the file, the entry and the field when it is
    not valid (a server refuses to start on it, or keeps its old keys on SIGHUP)."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as error:
        raise ValueError(f"key file {path}: cannot read it: {error.strerror or error}") from None
    except tomllib.TOMLDecodeError as error:
        raise ValueError(f"key file {path}: not valid TOML: {error}") from None
    return parse_key_table(data, str(path))


def parse_key_table(data: dict, source: str) -> KeyTable:
    unknown = set(data) - {"tenants", "keys"}
    if unknown:
        raise ValueError(f"key file {source}: top-level entries must be tenants and keys, got "
                         f"{', '.join(sorted(unknown))}")
    tenants_data = data.get("tenants", {})
    if not isinstance(tenants_data, dict):
        raise ValueError(f"key file {source}: tenants must be a table of [tenants.NAME], got "
                         f"{type(tenants_data).__name__}")
    tenants = {name: _tenant(name, settings, source) for name, settings in tenants_data.items()}
    keys = data.get("keys", [])
    if not isinstance(keys, list):
        raise ValueError(f"key file {source}: keys must be an array of [[keys]], got "
                         f"{type(keys).__name__}")
    by_hash: dict[str, Tenant] = {}
    for i, entry in enumerate(keys):
        where = f"key file {source}: keys[{i}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} must be a table with tenant and sha256, got {entry!r}")
        unknown = set(entry) - _KEY_FIELDS
        if unknown:
            raise ValueError(f"{where}: fields must be among {', '.join(sorted(_KEY_FIELDS))}, "
                             f"got {', '.join(sorted(unknown))}")
        tenant, digest = entry.get("tenant"), entry.get("sha256")
        if tenant not in tenants:
            raise ValueError(f"{where}.tenant must name a [tenants.NAME] table of the file "
                             f"({', '.join(sorted(tenants)) or 'none'}), got {tenant!r}")
        if not isinstance(digest, str) or not _SHA256_HEX.fullmatch(digest):
            raise ValueError(f"{where}.sha256 must be the key's SHA-256 as 64 lowercase hex "
                             f"digits (pagedgen-keys add writes it), got {digest!r}")
        if digest in by_hash:
            raise ValueError(f"{where}.sha256 must be unique: the same key is listed for "
                             f"{by_hash[digest].name!r} already")
        by_hash[digest] = tenants[tenant]
    return KeyTable(by_hash, source, tenants)


def _tenant(name: str, settings, source: str) -> Tenant:
    where = f"key file {source}: tenants.{name}"
    if not TENANT_NAME.fullmatch(name):
        raise ValueError(f"key file {source}: a tenant's name must be 1 to 64 characters of "
                         f"[A-Za-z0-9._-], got {name!r}")
    if not isinstance(settings, dict):
        raise ValueError(f"{where} must be a table, got {settings!r}")
    unknown = set(settings) - _TENANT_FIELDS
    if unknown:
        raise ValueError(f"{where}: fields must be among {', '.join(sorted(_TENANT_FIELDS))}, "
                         f"got {', '.join(sorted(unknown))}")
    flags = {}
    for key in ("may_set_priority", "may_read_stats"):
        flags[key] = settings.get(key, False)
        if not isinstance(flags[key], bool):
            raise ValueError(f"{where}.{key} must be true or false, got {flags[key]!r}")
    limits = {}
    for key, default in (("max_live_requests", DEFAULT_MAX_LIVE_REQUESTS),
                         ("max_pins", DEFAULT_MAX_PINS)):
        value = settings.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < -1:
            raise ValueError(f"{where}.{key} must be an integer >= 0 (-1: no limit), got "
                             f"{value!r}")
        limits[key] = None if value == -1 else value
    group = settings.get("cache_group", "")
    if not isinstance(group, str) or (group and not TENANT_NAME.fullmatch(group)):
        raise ValueError(f"{where}.cache_group must be 1 to 64 characters of [A-Za-z0-9._-] "
                         f"(or absent: the tenant's own name), got {group!r}")
    return Tenant(name, flags["may_set_priority"], limits["max_live_requests"],
                  limits["max_pins"], group, flags["may_read_stats"])
