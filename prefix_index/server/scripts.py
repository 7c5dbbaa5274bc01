"""The Lua scripts: read once from lua/, loaded with SCRIPT LOAD, run with EVALSHA.

A Redis that restarted (or a cluster node that never saw a script) answers NOSCRIPT; the script
is then loaded again and the call repeated once.

No script carries a `#!lua flags=...` line. A full Redis (maxmemory, noeviction) still runs
the read-only ones (lookup, stats, residency): a script without flags is refused only when it
calls a command that needs memory, and only before its first write, so a write script stays
atomic (tests/prefix_index/test_redis_full.py). Flags would need Redis 7 (Redis 6 takes `#!`
for a syntax error) and buy nothing more here.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from redis.asyncio import Redis, RedisCluster
from redis.exceptions import NoScriptError

LUA_DIR = Path(__file__).resolve().parent / "lua"
SCRIPT_NAMES = ("register", "heartbeat", "apply", "cool", "lookup", "stats", "residency")
# Scripts over several engines' keys at once: without common.lua, whose KEYS are one engine's.
MULTI_ENGINE_SCRIPTS = frozenset({"lookup"})


@dataclass(frozen=True, slots=True)
class LuaScript:
    name: str
    source: str
    sha: str

    async def run(self, redis: Redis | RedisCluster, keys: list[str],
                  args: list[bytes | str | int]) -> object:
        try:
            return await redis.evalsha(self.sha, len(keys), *keys, *args)
        except NoScriptError:
            await redis.script_load(self.source)
            return await redis.evalsha(self.sha, len(keys), *keys, *args)

    async def run_pipelined(self, redis: Redis, key_lists: list[list[str]],
                            args: list[bytes | str | int]) -> list:
        """The script once per key list, all in one pipeline (one round trip; Redis still
        runs other clients' commands between two of them). A single server only."""
        for attempt in (1, 2):
            pipe = redis.pipeline(transaction=False)
            for keys in key_lists:
                pipe.evalsha(self.sha, len(keys), *keys, *args)
            try:
                return await pipe.execute()
            except NoScriptError:
                if attempt == 2:
                    raise
                await redis.script_load(self.source)
        raise AssertionError("unreachable")


def load_scripts(channel_name: str) -> dict[str, LuaScript]:
    """Each script is lua/common.lua followed by its own file (a multi-engine one: its file).
    `channel_name`: the residency channel the scripts publish on (keys.residency_channel)."""
    channel = f"local RESIDENCY_CHANNEL = '{channel_name}'\n"
    common = channel + (LUA_DIR / "common.lua").read_text()
    scripts = {}
    for name in SCRIPT_NAMES:
        own = (LUA_DIR / f"{name}.lua").read_text()
        source = own if name in MULTI_ENGINE_SCRIPTS else common + "\n" + own
        sha = hashlib.sha1(source.encode()).hexdigest()
        scripts[name] = LuaScript(name, source, sha)
    return scripts
