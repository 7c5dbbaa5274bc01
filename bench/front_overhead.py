"""What the gRPC front costs against the offline API, on a model whose compute is tiny (issue 36).

    python -m bench.front_overhead                       # this checkout, best of 2, alternated
    python -m bench.front_overhead --baseline /tmp/base  # and a server from another checkout
    python -m bench.front_overhead --json out.json
    python -m bench.front_overhead --stream-interval 4   # and a server streaming 4 tokens a message

64 concurrent greedy `ignore_eos` requests of 500 tokens (8-token prompts) on the random
one-layer Llama of bench/step_loop.py, one torch thread:

- **offline**: `LLM.generate` in this process; CPU = this process's CPU time during the call.
- **served**: a real `pagedgen-engine` (`--prefix-index none`, float32) and 64 concurrent
  `GenerateStream` calls from a grpc.aio client in this process; server CPU = user + system
  time of the server process and its children (the engine core) read from /proc before and
  after, so the client's own CPU is not counted.

Figures: output tokens per second of wall time, and server (or offline) CPU microseconds per
output token; the targets are served CPU per token at most 1.5x offline's and served
throughput at least 0.5x offline's (the client shares the machine's cores with the server).
Runs alternate offline / served (/ baseline served), and each figure is the best of `--repeats`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from bench.step_loop import prompts, tiny_llama
from engine_service.tools.launch import EngineProcess
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc

BATCH = 64
MAX_TOKENS = 500
MAX_MODEL_LEN = 1024
CACHE = Path(os.environ.get("PAGEDGEN_CACHE_DIR", Path.home() / ".cache" / "pagedgen"))
# One torch thread in every process measured (the served core inherits it).
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def engine_args(batch: int) -> list[str]:
    blocks = batch * ((8 + MAX_TOKENS) // 16 + 2) + 16
    return ["--prefix-index", "none", "--dtype", "float32", "--max-num-seqs", str(batch),
            "--num-blocks", str(blocks), "--max-model-len", str(MAX_MODEL_LEN),
            "--max-live-requests", str(4 * batch), "--log-level", "WARNING"]


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of `pid` and its live children (the engine core)."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        ppid, utime, stime = int(fields[1]), int(fields[11]), int(fields[12])
        if int(entry.name) == pid or ppid == pid:
            total += (utime + stime) / ticks
    return total


def offline(model_dir: Path, batch: int, max_tokens: int) -> dict:
    """In a child process with one torch thread, as the served engine runs."""
    code = ("import json, sys, time, torch; torch.set_num_threads(1);"
            "from bench.front_overhead import offline_here;"
            "print(json.dumps(offline_here(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))")
    out = subprocess.run([sys.executable, "-c", code, str(model_dir), str(batch),
                          str(max_tokens)], check=True, capture_output=True, text=True,
                         env={**os.environ, **ONE_THREAD})
    return json.loads(out.stdout.strip().splitlines()[-1])


def offline_here(model_dir: str, batch: int, max_tokens: int) -> dict:
    from engine_service import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype="float32", max_num_seqs=batch,
              max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts(4), SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
    cpu, wall = time.process_time(), time.perf_counter()
    outputs = llm.generate(prompts(batch), params)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"tokens": tokens, "wall_s": wall, "cpu_s": cpu}


async def stream_all(target: str, batch: int, max_tokens: int,
                     started: Callable[[], None] = lambda: None) -> int:
    """`batch` concurrent streams of `max_tokens` tokens; the output tokens received. The
    channel is connected first (one stream of one token), then `started()` marks the start of
    what is measured."""
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)

        async def one(ids: list[int], tokens: int) -> int:
            request = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=ids),
                sampling=pb.SamplingParams(temperature=0, max_tokens=tokens,
                                           ignore_eos=True))
            count = 0
            async for message in stub.GenerateStream(request, timeout=600):
                count += sum(len(c.token_ids) for c in message.choices)
            return count

        requests = [p["prompt_token_ids"] for p in prompts(batch)]
        await one(requests[0][:4], 1)  # connects the channel
        started()
        counts = await asyncio.gather(*(one(ids, max_tokens) for ids in requests))
    return sum(counts)


def served(model_dir: Path, batch: int, max_tokens: int, checkout: Path | None,
           extra: tuple[str, ...] = ()) -> dict:
    env = dict(ONE_THREAD)
    if checkout is not None:
        # Its own cache: the CPU extension built from another checkout's sources in the shared
        # cache would be rebuilt there (ninja's build file names the source paths), and ours
        # again after it.
        env["PAGEDGEN_CACHE_DIR"] = str(checkout / ".cache" / "pagedgen")
    env_before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        engine = EngineProcess(model_dir, [*engine_args(batch), *extra, "--insecure"])
        if checkout is not None:  # another checkout's server: its code first on the path
            boot = (f"import sys; sys.path.insert(0, {str(checkout)!r}); "
                    "from engine_service.serving.server import main; main()")
            engine.command = lambda: [sys.executable, "-c", boot,
                                      "--model", str(model_dir), "--host", engine.host,
                                      "--port", str(engine.port), *engine_args(batch),
                                      *extra, *baseline_flags(checkout)]
        with engine:
            pid = engine.proc.pid
            # Warm-up outside the measurement (first requests compile nothing on the CPU, but
            # the tokenizer and the first batches are slower).
            asyncio.run(stream_all(engine.target, 4, 16))
            start: dict[str, float] = {}

            def started() -> None:  # the client connected: from here on it is measured
                start["cpu"], start["wall"] = process_cpu_s(pid), time.perf_counter()

            tokens = asyncio.run(stream_all(engine.target, batch, max_tokens, started))
            wall = time.perf_counter() - start["wall"]
            cpu = process_cpu_s(pid) - start["cpu"]
    finally:
        for key, value in env_before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return {"tokens": tokens, "wall_s": wall, "cpu_s": cpu}


def baseline_flags(checkout: Path) -> list[str]:
    """What another checkout's server is told to serve as this bench measures, where it has
    the flag (an older one refuses a flag it lacks): plain text (--insecure, since TLS came
    with trust/cli_args.py; before it plain text needed no flag) and one torch thread in its
    core (--torch-threads 1: from the front/core split to 13c7dc3 the core's default, every
    core but one, overrode the OMP_NUM_THREADS this bench sets, so on a machine of more than
    2 cores the baseline's core computed on several threads against one here)."""
    def has(path: str, flag: str) -> bool:
        file = checkout / path
        return file.is_file() and f'"{flag}"' in file.read_text()

    flags = ["--insecure"] if has("trust/cli_args.py", "--insecure") else []
    if has("engine_service/serving/server.py", "--torch-threads"):
        flags += ["--torch-threads", "1"]
    return flags


def figures(run: dict) -> dict:
    return {"tokens_per_s": run["tokens"] / run["wall_s"],
            "cpu_us_per_token": 1e6 * run["cpu_s"] / run["tokens"], **run}


def best(runs: list[dict]) -> dict:
    return {"tokens_per_s": max(r["tokens_per_s"] for r in runs),
            "cpu_us_per_token": min(r["cpu_us_per_token"] for r in runs),
            "runs": runs}


def measure(batch: int, max_tokens: int, repeats: int, baseline: Path | None,
            stream_interval: int = 1) -> dict:
    model_dir = tiny_llama(CACHE / "models" / "step-loop-tiny", MAX_MODEL_LEN)
    runs: dict[str, list[dict]] = {"offline": [], "served": []}
    if baseline is not None:
        runs["baseline_served"] = []
    interval_run = f"served_interval_{stream_interval}"
    if stream_interval > 1:
        runs[interval_run] = []
    for _ in range(repeats):
        runs["offline"].append(figures(offline(model_dir, batch, max_tokens)))
        runs["served"].append(figures(served(model_dir, batch, max_tokens, None)))
        if baseline is not None:
            runs["baseline_served"].append(
                figures(served(model_dir, batch, max_tokens, baseline)))
        if stream_interval > 1:
            runs[interval_run].append(figures(served(
                model_dir, batch, max_tokens, None, ("--stream-interval", str(stream_interval)))))
    result = {name: best(r) for name, r in runs.items()}
    off = result["offline"]
    for name in [n for n in result if n != "offline"]:
        result[name]["cpu_vs_offline"] = result[name]["cpu_us_per_token"] / off["cpu_us_per_token"]
        result[name]["throughput_vs_offline"] = (result[name]["tokens_per_s"]
                                                 / off["tokens_per_s"])
    result["setup"] = {"batch": batch, "max_tokens": max_tokens, "repeats": repeats,
                       "baseline": str(baseline) if baseline else None,
                       "stream_interval": stream_interval}
    return result


def report(result: dict) -> str:
    lines = ["| run | tokens/s | CPU µs/token | CPU vs offline | throughput vs offline |",
             "|---|---:|---:|---:|---:|"]
    for name in [n for n in result if n != "setup"]:
        r = result[name]
        lines.append(f"| {name} | {r['tokens_per_s']:,.0f} | {r['cpu_us_per_token']:.0f} | "
                     f"{r.get('cpu_vs_offline', 1.0):.2f}x | "
                     f"{r.get('throughput_vs_offline', 1.0):.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.front_overhead",
                                description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, default=BATCH)
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--baseline", type=Path, default=None,
                   help="a checkout whose server to measure too (e.g. a git worktree of main)")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="above 1: also a server with --stream-interval this many tokens")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    result = measure(args.batch, args.max_tokens, args.repeats, args.baseline,
                     args.stream_interval)
    print(report(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
