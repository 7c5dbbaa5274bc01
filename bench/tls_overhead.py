"""What TLS costs a served stream (issue 32): two stacks side by side, each Redis' index, one
engine and the router in front, one with every link TLS (certificates from pagedgen-certs,
mutual TLS behind the router) and one --insecure; 32 concurrent streams through each router,
alternated, three runs each. Prints each run and the medians of throughput and TTFT.

    python -m bench.tls_overhead [--model DIR] [--runs 3] [--streams 32] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import grpc

from engine_service.tools.launch import EngineProcess
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from prefix_index.tools.launch import IndexProcess
from prefix_index.tools.redis_process import RedisProcess
from router.tools.launch import RouterProcess
from trust.certs import ensure_leaf
from trust.credentials import TlsFiles

PROMPT_TOKENS = 64


def _files(certs: Path | None, role: str, engine_id: str | None = None) -> TlsFiles | None:
    if certs is None:
        return None
    issued = ensure_leaf(certs, role, engine_id)
    return TlsFiles(issued.cert, issued.key, certs / "ca.pem")


def start_stack(exits: ExitStack, model: str, redis_url: str, certs: Path | None, tag: str,
                log_dir: Path) -> RouterProcess:
    """The index, one engine and the router; TLS everywhere when `certs`, else --insecure."""
    plain = [] if certs else ["--insecure"]
    index = exits.enter_context(IndexProcess(redis_url, ["--log-level", "WARNING", *plain],
                                             tls=_files(certs, "index")))
    engine_id = f"{tag}-e0"
    exits.enter_context(EngineProcess(
        model, ["--prefix-index", index.target, "--engine-id", engine_id, "--num-blocks", "1024",
                "--log-level", "WARNING", *plain],
        log_path=log_dir / f"{engine_id}.log", tls=_files(certs, "engine", engine_id)))
    return exits.enter_context(RouterProcess(
        ["--prefix-index", index.target, "--log-level", "WARNING", *plain],
        log_path=log_dir / f"router-{tag}.log", tls=_files(certs, "router")))


async def one_run(target: str, ca: bytes | None, streams: int, max_tokens: int, seed: int
                  ) -> tuple[float, float]:
    """(completion tokens / s, median TTFT s) of `streams` concurrent GenerateStream calls."""
    credentials = grpc.ssl_channel_credentials(ca) if ca else None
    channel = (grpc.aio.secure_channel(target, credentials) if credentials
               else grpc.aio.insecure_channel(target))
    async with channel:
        stub = pb_grpc.GenerationStub(channel)

        async def stream(i: int) -> tuple[float, int]:
            ids = [(seed * 7919 + i * 131 + j) % 40000 + 100 for j in range(PROMPT_TOKENS)]
            request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(
                temperature=0, max_tokens=max_tokens, ignore_eos=True))
            started, first, tokens = time.perf_counter(), None, 0
            async for chunk in stub.GenerateStream(request, timeout=600):
                for choice in chunk.choices:
                    if choice.token_ids and first is None:
                        first = time.perf_counter() - started
                    tokens += len(choice.token_ids)
            return first or 0.0, tokens

        started = time.perf_counter()
        results = await asyncio.gather(*(stream(i) for i in range(streams)))
        wall = time.perf_counter() - started
    return sum(t for _, t in results) / wall, statistics.median(f for f, _ in results)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.tls_overhead", description=__doc__)
    p.add_argument("--model", default=None)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args(argv)
    model = args.model
    if model is None:
        from engine_service.tools.prepare_model import ensure_default_model

        model = str(ensure_default_model())
    work = Path(tempfile.mkdtemp(prefix="pagedgen-tls-bench-"))
    certs = work / "certs"
    with ExitStack() as exits:
        redis = exits.enter_context(RedisProcess())
        targets = {"tls": start_stack(exits, model, redis.url, certs, "tls", work).target,
                   "insecure": start_stack(exits, model, redis.url, None, "plain", work).target}
        ca = {"tls": (certs / "ca.pem").read_bytes(), "insecure": None}
        for mode in targets:  # warm-up: first compiles, connections
            asyncio.run(one_run(targets[mode], ca[mode], 4, 8, seed=999))
        figures: dict[str, list[tuple[float, float]]] = {"tls": [], "insecure": []}
        for run in range(args.runs):
            order = ("tls", "insecure") if run % 2 == 0 else ("insecure", "tls")
            for mode in order:
                result = asyncio.run(one_run(targets[mode], ca[mode], args.streams,
                                             args.max_tokens, seed=run))
                figures[mode].append(result)
                print(f"run {run} {mode:8s} {result[0]:8.1f} tok/s  TTFT p50 "
                      f"{result[1] * 1000:7.1f} ms", flush=True)
    medians = {mode: (statistics.median(t for t, _ in runs), statistics.median(f for _, f in runs))
               for mode, runs in figures.items()}
    tls, plain = medians["tls"], medians["insecure"]
    print(f"median throughput: TLS {tls[0]:.1f} vs insecure {plain[0]:.1f} tok/s "
          f"({tls[0] / plain[0]:.3f}x); TTFT p50: TLS {tls[1] * 1000:.1f} vs insecure "
          f"{plain[1] * 1000:.1f} ms ({tls[1] / plain[1]:.3f}x)")


if __name__ == "__main__":
    main()
