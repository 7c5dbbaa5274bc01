"""HTTP against gRPC through the router (issue 31): the same 32 concurrent streaming chat
requests over the router's OpenAI-compatible HTTP API and over its gRPC API, alternated, three
runs each; median output throughput within 5% and TTFT p50 within 10% of gRPC's.

    python -m bench.http_vs_grpc [--concurrency 32] [--max-tokens 64] [--runs 3]

One engine replica on the default model (or --model) behind pagedgen-router, a prefix index
and its Redis, all real processes on loopback. Every request is greedy with ignore_eos, so each
produces exactly --max-tokens tokens; each run's prompts are new (a run's number leads each
user message), so no run reuses another's cached blocks beyond the shared chat template. The
HTTP client is the official `openai` package (AsyncOpenAI, stream with include_usage), the gRPC
one grpc.aio with the generated stubs, both in this process, each kept across its runs. Writes
bench/results/http_vs_grpc.json and bench/results/http_vs_grpc.md.
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
import openai

from bench.metrics import percentile
from bench.results_json import write_results
from bench.router_stack import PolicyStack, ReplicaShape
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from prefix_index.tools.launch import IndexProcess
from prefix_index.tools.redis_process import RedisProcess, free_port

RESULTS = Path(__file__).resolve().parent / "results"
THROUGHPUT_TOLERANCE = 0.05  # HTTP's median output throughput at least 95% of gRPC's
TTFT_TOLERANCE = 0.10  # HTTP's TTFT p50 at most 110% of gRPC's
TOPICS = ("a KV cache", "paged attention", "continuous batching", "prefix caching",
          "speculative decoding", "beam search", "top-p sampling", "a router")


def prompt(run: int, i: int) -> str:
    return (f"Run {run}, question {i}: explain {TOPICS[i % len(TOPICS)]} to a new engineer, "
            f"in plain words.")


async def grpc_request(stub, run: int, i: int, max_tokens: int) -> tuple[float, float, int]:
    """(time to first token, end, tokens) of one streamed chat request over gRPC."""
    request = pb.GenerateRequest(
        chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=prompt(run, i))]),
        sampling=pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    sent = time.monotonic()
    first = None
    tokens = 0
    async for message in stub.GenerateStream(request, timeout=600):
        if first is None and any(c.token_ids for c in message.choices):
            first = time.monotonic()
        tokens = message.usage.completion_tokens
    return first - sent, time.monotonic(), tokens


async def http_request(client: openai.AsyncOpenAI, model: str, run: int, i: int,
                       max_tokens: int) -> tuple[float, float, int]:
    """The same request over HTTP: time to the first chunk with content."""
    sent = time.monotonic()
    first = None
    tokens = 0
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt(run, i)}],
        max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.monotonic()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return first - sent, time.monotonic(), tokens


async def one_run(protocol: str, clients: dict, model: str, run: int, concurrency: int,
                  max_tokens: int) -> dict:
    started = time.monotonic()
    if protocol == "grpc":
        results = await asyncio.gather(*(grpc_request(clients["grpc"], run, i, max_tokens)
                                         for i in range(concurrency)))
    else:
        results = await asyncio.gather(*(http_request(clients["http"], model, run, i,
                                                      max_tokens)
                                         for i in range(concurrency)))
    duration = max(end for _, end, _ in results) - started
    tokens = sum(n for _, _, n in results)
    ttfts = [ttft for ttft, _, _ in results]
    return {"protocol": protocol, "run": run, "duration_s": duration, "output_tokens": tokens,
            "output_throughput": tokens / duration,
            "ttft_p50_ms": percentile(ttfts, 50) * 1e3,
            "ttft_p90_ms": percentile(ttfts, 90) * 1e3}


async def all_runs(schedule: list[tuple[str, bool]], grpc_target: str, http_url: str,
                   model: str, concurrency: int, max_tokens: int) -> list[dict]:
    """Every run on one event loop, each protocol's client kept across its runs (as a real
    client keeps its channel, or its pool of connections: the warm-up opens them)."""
    http = openai.AsyncOpenAI(base_url=f"{http_url}/v1", api_key="none", max_retries=0,
                              timeout=600)
    runs = []
    async with grpc.aio.insecure_channel(grpc_target) as channel:
        clients = {"grpc": pb_grpc.GenerationStub(channel), "http": http}
        try:
            for number, (protocol, warmup) in enumerate(schedule):
                run = await one_run(protocol, clients, model, number, concurrency, max_tokens)
                run["warmup"] = warmup
                runs.append(run)
                print(f"run {number:2d} {protocol:4s}{' (warm-up)' if warmup else '':10s} "
                      f"{run['output_throughput']:7.1f} tok/s, TTFT p50 "
                      f"{run['ttft_p50_ms']:6.0f} ms", flush=True)
        finally:
            await http.close()
    return runs


def summary(runs: list[dict]) -> dict:
    out = {}
    for protocol in ("grpc", "http"):
        mine = [r for r in runs if r["protocol"] == protocol and not r.get("warmup")]
        out[protocol] = {
            "median_output_throughput": statistics.median(r["output_throughput"] for r in mine),
            "median_ttft_p50_ms": statistics.median(r["ttft_p50_ms"] for r in mine),
        }
    throughput_ratio = (out["http"]["median_output_throughput"]
                        / out["grpc"]["median_output_throughput"])
    ttft_ratio = out["http"]["median_ttft_p50_ms"] / out["grpc"]["median_ttft_p50_ms"]
    out["throughput_ratio"] = throughput_ratio
    out["ttft_p50_ratio"] = ttft_ratio
    out["throughput_met"] = throughput_ratio >= 1 - THROUGHPUT_TOLERANCE
    out["ttft_met"] = ttft_ratio <= 1 + TTFT_TOLERANCE
    return out


def markdown(result: dict) -> str:
    s = result["summary"]
    c = result["config"]
    lines = [
        f"HTTP vs gRPC through the router ({c['concurrency']} concurrent streaming chat "
        f"requests, {c['max_tokens']} tokens each, {c['runs']} runs each alternated, "
        f"{c['model']}):",
        "",
        "| protocol | median output tok/s | median TTFT p50 (ms) |",
        "|---|---:|---:|",
    ]
    for protocol in ("grpc", "http"):
        p = s[protocol]
        lines.append(f"| {protocol} | {p['median_output_throughput']:.1f} | "
                     f"{p['median_ttft_p50_ms']:.0f} |")
    lines += ["",
              f"- HTTP / gRPC output throughput: {s['throughput_ratio']:.3f} (target >= "
              f"{1 - THROUGHPUT_TOLERANCE:.2f}: {'met' if s['throughput_met'] else 'not met'})",
              f"- HTTP / gRPC TTFT p50: {s['ttft_p50_ratio']:.3f} (target <= "
              f"{1 + TTFT_TOLERANCE:.2f}: {'met' if s['ttft_met'] else 'not met'})",
              "", "| run | protocol | tok/s | TTFT p50 (ms) | TTFT p90 (ms) |",
              "|---:|---|---:|---:|---:|"]
    for r in result["runs"]:
        tag = " (warm-up)" if r.get("warmup") else ""
        lines.append(f"| {r['run']}{tag} | {r['protocol']} | {r['output_throughput']:.1f} | "
                     f"{r['ttft_p50_ms']:.0f} | {r['ttft_p90_ms']:.0f} |")
    return "\n".join(lines) + "\n"


def measure(args: argparse.Namespace) -> dict:
    model = args.model
    if model is None:
        from engine_service.tools.prepare_model import ensure_default_model

        model = str(ensure_default_model(quiet=True))
    log_dir = Path(tempfile.mkdtemp(prefix="pagedgen-http-vs-grpc-"))
    http_port = free_port()
    with ExitStack() as stack:
        redis = stack.enter_context(RedisProcess())
        index = stack.enter_context(IndexProcess(redis.url,
            ["--log-level", "WARNING", "--insecure"]))
        shape = ReplicaShape(num_engines=1, num_blocks=args.num_blocks, block_size=16)
        routed = stack.enter_context(PolicyStack(
            model, index.target, "kv-aware", shape, f"httpgrpc-{http_port}", log_dir,
            router_args=("--http-port", str(http_port))))
        http_url = f"http://127.0.0.1:{http_port}"
        served = Path(model).name if not model.endswith(".gguf") else Path(model).stem
        # Alternated, each pair in the other order than the one before (ABBA): a drift of the
        # shared machine over the sitting weighs on both protocols alike.
        order = [("grpc", "http") if k % 2 == 0 else ("http", "grpc") for k in range(args.runs)]
        schedule = [("grpc", True), ("http", True)] + [(p, False) for pair in order
                                                        for p in pair]
        runs = asyncio.run(all_runs(schedule, routed.target, http_url, served,
                                    args.concurrency, args.max_tokens))
    config = {"concurrency": args.concurrency, "max_tokens": args.max_tokens,
              "runs": args.runs, "model": Path(model).name, "num_blocks": args.num_blocks,
              "replicas": 1}
    return {"config": config, "runs": runs, "summary": summary(runs)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.http_vs_grpc",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3, help="measured runs per protocol")
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--out", type=Path, default=RESULTS / "http_vs_grpc.json")
    args = p.parse_args(argv)
    for name in ("concurrency", "max_tokens", "runs", "num_blocks"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    result = measure(args)
    text = markdown(result)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_results(args.out, result)
    args.out.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
