"""Redis key names. Every key of one engine carries the hash tag {engine_id}: one cluster slot."""

from __future__ import annotations

# The order is the KEYS layout of lua/common.lua.
ENGINE_KEY_SUFFIXES = ("meta", "bid", "own", "ref", "par", "kids", "last", "pin", "pinexp",
                       "hot", "free", "lru")

# Directory of engine ids (its own slot); lookup and stats walk it and prune the gone ones.
ENGINES_KEY = "pi:engines"


def engine_keys(engine_id: str) -> list[str]:
    return [f"pi:{{{engine_id}}}:{suffix}" for suffix in ENGINE_KEY_SUFFIXES]
