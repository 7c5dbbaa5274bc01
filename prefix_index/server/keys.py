"""Redis key names. Every key of one engine carries the hash tag {engine_id}: one cluster slot."""

from __future__ import annotations

# The order is the KEYS layout of lua/common.lua.
ENGINE_KEY_SUFFIXES = ("meta", "bid", "own", "ref", "par", "kids", "last", "pin", "pinexp",
                       "hot", "free", "lru", "hage", "pinchg", "vref", "pins", "cover")

# Directory of engine ids (its own slot); lookup, stats and the sweeper prune the gone ones.
ENGINES_KEY = "pi:engines"



def residency_channel(db: int) -> str:
    """Pub/sub channel of every change to an engine's resident blocks (apply.lua) and every
    reset (register.lua), published by the script that makes it; router/residency.py mirrors
    it. Per database: Redis pub/sub ignores the database number, so two index deployments on
    databases of one server would otherwise hear each other's engines."""
    return f"pi:residency:{db}"


def engine_keys(engine_id: str, suffixes: tuple[str, ...] = ENGINE_KEY_SUFFIXES) -> list[str]:
    return [f"pi:{{{engine_id}}}:{suffix}" for suffix in suffixes]


def lookup_keys(engine_id: str) -> list[str]:
    """What lua/lookup.lua reads of one engine, in its order."""
    return engine_keys(engine_id, ("meta", "bid", "free"))


def view_key(block_hash: bytes) -> str:
    """The set of `engine_id@epoch` holding this block hash: the routing view Lookup reads.
    Tagged by the hash itself, so the view spreads over every cluster slot."""
    return f"pi:view:{{{block_hash.hex()}}}"


def view_member(engine_id: str, epoch: int) -> str:
    # '@' never occurs in an engine id; the epoch makes an old registration's entries tell
    # themselves apart from the current one's.
    return f"{engine_id}@{epoch}"


def parse_view_member(member: bytes | str) -> tuple[str, int]:
    text = member.decode() if isinstance(member, bytes) else member
    engine_id, _, epoch = text.rpartition("@")
    return engine_id, int(epoch)
