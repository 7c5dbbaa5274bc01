"""Prefix index benchmark: acquire latency over gRPC on loopback by chain length, throughput by
number of concurrent clients, Lookup latency by number of registered engines, and the raw Redis
round trip measured in the same run, so the service's overhead reads as a ratio.

    python -m bench.prefix_index [--samples 2000] [--duration-s 3] [--redis-url URL]

Writes bench/results/prefix_index.json and prints a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import time
from collections.abc import Awaitable, Callable
from contextlib import ExitStack
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from redis.asyncio import Redis
from tqdm import tqdm

from prefix_index.api.client import PrefixIndexClient
from prefix_index.api.ops import Acquire, Commit, Release
from prefix_index.server.config import PinPolicy
from prefix_index.server.store import IndexStore
from prefix_index.tools.launch import IndexProcess
from prefix_index.tools.redis_process import RedisProcess

CHAIN_LENGTHS = (1, 16, 128)
CONCURRENCY = (1, 8, 32)
THROUGHPUT_CHAIN = 16
LOOKUP_ENGINES = (1, 10, 100)
LOOKUP_CHAIN = 16
LOOKUP_HOLDERS = 1   # engines holding the looked-up chain; the others hold other chains
NUM_BLOCKS = 4096
RESULTS = Path(__file__).resolve().parent / "results" / "prefix_index.json"


def _chain(name: str, length: int) -> list[bytes]:
    import xxhash

    chain, parent = [], b""
    for i in range(length):
        parent = xxhash.xxh3_128_digest(parent + f"{name}/{i}".encode())
        chain.append(parent)
    return chain


def _percentiles(samples_s: list[float]) -> dict[str, float]:
    ordered = sorted(samples_s)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e6  # noqa: E731
    return {"p50_us": pick(0.50), "p99_us": pick(0.99),
            "mean_us": statistics.fmean(ordered) * 1e6, "samples": len(ordered)}


async def _timed(call: Callable[[], Awaitable[object]], samples: int, label: str
                 ) -> dict[str, float]:
    for _ in range(min(200, samples)):  # warm up connections, script cache, code paths
        await call()
    times = []
    for _ in tqdm(range(samples), desc=label, leave=False):
        started = time.perf_counter()
        await call()
        times.append(time.perf_counter() - started)
    return _percentiles(times)


async def _throughput(target: str, engine_id: str, epoch: int, chain: list[bytes],
                      clients: int, duration_s: float) -> dict[str, float]:
    """Each client (own channel) loops Apply([Acquire(chain), Release(chain)])."""
    workers = []
    for _ in range(clients):
        w = PrefixIndexClient(target, timeout_s=10.0)
        w.attach(engine_id, epoch)
        workers.append(w)
    ops = [Acquire(chain), Release(chain)]
    for w in workers:
        await w.apply(ops)
    stop_at = time.perf_counter() + duration_s
    counts = [0] * clients

    async def loop(i: int) -> None:
        while time.perf_counter() < stop_at:
            [acq, rel] = await workers[i].apply(ops)
            if len(acq.block_ids) != len(chain) or not rel.ok:
                raise RuntimeError(f"unexpected answer under load: {acq} {rel}")
            counts[i] += 1

    started = time.perf_counter()
    await asyncio.gather(*(loop(i) for i in range(clients)))
    elapsed = time.perf_counter() - started
    for w in workers:
        await w.close()
    rpcs = sum(counts)
    return {"clients": clients, "rpcs_per_s": rpcs / elapsed,
            "ops_per_s": 2 * rpcs / elapsed, "hashes_per_s": 2 * len(chain) * rpcs / elapsed,
            "seconds": elapsed}


async def _scan_every_engine(store: IndexStore, engine_ids: list[str], chain: list[bytes]
                             ) -> list:
    """The Lookup the index had before its view: one script per registered engine."""
    return await asyncio.gather(*(store._run("lookup", e, chain) for e in engine_ids))


async def _lookup_latency(target: str, store: IndexStore, samples: int) -> list[dict]:
    """Lookup of one chain with 1, 10, 100 engines registered, LOOKUP_HOLDERS of them holding
    it: over gRPC, and beside it (same run) the old per-engine scan called on the store."""
    rows = []
    chain = _chain("lookup", LOOKUP_CHAIN)
    client = PrefixIndexClient(target, timeout_s=10.0)
    registered: list[str] = []
    for engines in LOOKUP_ENGINES:
        while len(registered) < engines:
            engine_id = f"bench-lookup-{len(registered)}"
            await client.register(engine_id, "bench", 16, 256, 600)
            held = chain if len(registered) < LOOKUP_HOLDERS else _chain(engine_id, 64)
            await client.apply([Commit(h, held[i - 1] if i else b"", i)
                                for i, h in enumerate(held)] + [Release(held)])
            registered.append(engine_id)
        matches = await client.lookup(chain)
        if [m.matched_blocks for m in matches] != [LOOKUP_CHAIN] * LOOKUP_HOLDERS:
            raise RuntimeError(f"wrong Lookup answer at {engines} engines: {matches}")
        n = min(samples, 500)
        via_view = await _timed(lambda: client.lookup(chain), n, f"gRPC Lookup, {engines} eng")
        scan = await _timed(lambda: _scan_every_engine(store, registered, chain), n,
                            f"per-engine scan, {engines} eng")
        rows.append({"registered_engines": engines, "holders": LOOKUP_HOLDERS,
                     "chain": LOOKUP_CHAIN, "grpc_lookup": via_view,
                     "per_engine_scan_direct": scan})
    await client.close()
    base = rows[0]["grpc_lookup"]["p50_us"]
    for row in rows:
        row["ratio_p50_to_1_engine"] = row["grpc_lookup"]["p50_us"] / base
        row["ratio_scan_to_view_p50"] = (row["per_engine_scan_direct"]["p50_us"]
                                         / row["grpc_lookup"]["p50_us"])
    return rows


async def run(redis_url: str, target: str, samples: int, duration_s: float) -> dict:
    redis = Redis.from_url(redis_url)
    store = IndexStore(redis, PinPolicy())
    longest = _chain("bench", max(CHAIN_LENGTHS))
    result: dict = {"latency": {}, "throughput": [], "raw_redis": {}}

    # Raw Redis: PING, and the acquire script called directly (no gRPC, no service).
    result["raw_redis"]["ping"] = await _timed(redis.ping, samples, "redis PING")
    reg = await store.register("bench-direct", "bench", 16, NUM_BLOCKS, 600)
    await store.apply("bench-direct", reg.epoch,
                      [Commit(h, longest[i - 1] if i else b"", i) for i, h in enumerate(longest)])
    for n in CHAIN_LENGTHS:
        ops = [Acquire(longest[:n])]
        result["raw_redis"][f"evalsha_acquire_{n}"] = await _timed(
            lambda ops=ops: store.apply("bench-direct", reg.epoch, ops), samples,
            f"direct EVALSHA acquire {n}")

    # The gRPC floor: a trivial RPC (health Check) on the same server and transport.
    async with grpc.aio.insecure_channel(target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        check = health_pb2.HealthCheckRequest(service="")
        result["grpc_floor"] = await _timed(lambda: health.Check(check, timeout=10), samples,
                                            "gRPC health Check")

    # The service over gRPC.
    client = PrefixIndexClient(target, timeout_s=10.0)
    await client.register("bench-grpc", "bench", 16, NUM_BLOCKS, 600)
    await client.apply([Commit(h, longest[i - 1] if i else b"", i)
                        for i, h in enumerate(longest)])
    for n in CHAIN_LENGTHS:
        ops = [Acquire(longest[:n])]
        result["latency"][str(n)] = await _timed(lambda ops=ops: client.apply(ops), samples,
                                                  f"gRPC acquire {n}")
    for clients in tqdm(CONCURRENCY, desc="throughput", leave=False):
        result["throughput"].append(await _throughput(
            target, "bench-grpc", client.epoch, longest[:THROUGHPUT_CHAIN], clients, duration_s))
    await client.close()
    result["lookup"] = await _lookup_latency(target, store, samples)
    await redis.aclose()

    ping = result["raw_redis"]["ping"]["p50_us"]
    for n in CHAIN_LENGTHS:
        lat = result["latency"][str(n)]
        direct = result["raw_redis"][f"evalsha_acquire_{n}"]["p50_us"]
        lat["ratio_p50_to_redis_ping"] = lat["p50_us"] / ping
        lat["ratio_p50_to_direct_evalsha"] = lat["p50_us"] / direct
        lat["service_python_us"] = lat["p50_us"] - direct - result["grpc_floor"]["p50_us"]
    return result


def _has_hiredis() -> bool:
    import importlib.util

    return importlib.util.find_spec("hiredis") is not None


def print_table(result: dict) -> None:
    raw = result["raw_redis"]
    print(f"\nraw Redis PING round trip: p50 {raw['ping']['p50_us']:.0f} us, "
          f"p99 {raw['ping']['p99_us']:.0f} us")
    floor = result["grpc_floor"]
    print(f"gRPC floor (health Check, same server): p50 {floor['p50_us']:.0f} us, "
          f"p99 {floor['p99_us']:.0f} us")
    print(f"{'chain':>6} {'gRPC p50 us':>12} {'gRPC p99 us':>12} {'EVALSHA p50 us':>15} "
          f"{'x PING':>7} {'x EVALSHA':>10} {'rest us':>8}")
    for n, lat in result["latency"].items():
        direct = raw[f"evalsha_acquire_{n}"]
        print(f"{n:>6} {lat['p50_us']:>12.0f} {lat['p99_us']:>12.0f} {direct['p50_us']:>15.0f} "
              f"{lat['ratio_p50_to_redis_ping']:>7.1f} {lat['ratio_p50_to_direct_evalsha']:>10.1f} "
              f"{lat['service_python_us']:>8.0f}")
    print("(rest = gRPC p50 - direct EVALSHA p50 - gRPC floor p50: our servicer's own cost)")
    print(f"\nthroughput, Apply([Acquire({THROUGHPUT_CHAIN}), Release({THROUGHPUT_CHAIN})]):")
    print(f"{'clients':>8} {'RPC/s':>9} {'ops/s':>9} {'hashes/s':>10}")
    for t in result["throughput"]:
        print(f"{t['clients']:>8} {t['rpcs_per_s']:>9.0f} {t['ops_per_s']:>9.0f} "
              f"{t['hashes_per_s']:>10.0f}")
    print(f"\nLookup of a {LOOKUP_CHAIN}-block chain held by {LOOKUP_HOLDERS} engine(s), by "
          "engines registered (scan = the old one-script-per-engine Lookup, no gRPC):")
    print(f"{'engines':>8} {'p50 us':>8} {'p99 us':>8} {'x 1 eng':>8} {'scan p50 us':>12} "
          f"{'scan/view':>10}")
    for row in result["lookup"]:
        lat, scan = row["grpc_lookup"], row["per_engine_scan_direct"]
        print(f"{row['registered_engines']:>8} {lat['p50_us']:>8.0f} {lat['p99_us']:>8.0f} "
              f"{row['ratio_p50_to_1_engine']:>8.2f} {scan['p50_us']:>12.0f} "
              f"{row['ratio_scan_to_view_p50']:>10.2f}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=2000, help="timed calls per latency figure")
    p.add_argument("--duration-s", type=float, default=3.0, help="per throughput point")
    p.add_argument("--redis-url", default="", help="use this Redis (default: start one)")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    load_before = os.getloadavg()
    with ExitStack() as stack:
        redis_url = args.redis_url or stack.enter_context(RedisProcess()).url
        index = stack.enter_context(IndexProcess(redis_url,
            ["--log-level", "WARNING", "--insecure"]))
        result = asyncio.run(run(redis_url, index.target, args.samples, args.duration_s))
    result["setup"] = {
        "transport": "gRPC over loopback (grpc.aio client and server, separate processes)",
        "redis": "redis-server on loopback, no persistence",
        "cpus": os.cpu_count(), "python": platform.python_version(),
        "machine": platform.machine(), "samples": args.samples,
        "duration_s": args.duration_s, "pool_blocks": NUM_BLOCKS,
        "unix_time": time.time(),
        # The machine may be shared: the load average says how noisy these figures are.
        "loadavg_1m_before_after": [load_before[0], os.getloadavg()[0]],
        "hiredis": _has_hiredis(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    setup = result["setup"]
    print(f"\nload average (1 min) before/after: {setup['loadavg_1m_before_after'][0]:.1f} / "
          f"{setup['loadavg_1m_before_after'][1]:.1f} on {setup['cpus']} CPUs; "
          f"hiredis: {setup['hiredis']}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
