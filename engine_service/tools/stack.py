"""pagedgen-stack: the whole stack on this machine, no Docker: Redis, the prefix index and the
engine on the default model, each a real process on a free loopback port; then one chat prompt
streamed through the generated gRPC stubs, printed as the deltas arrive; then a clean shutdown.

    pagedgen-stack [--prompt TEXT] [--max-tokens N] [--keep-running]
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import grpc

from engine_service.tools.launch import EngineProcess
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from prefix_index.tools.launch import IndexProcess
from prefix_index.tools.redis_process import RedisProcess, free_port

log = logging.getLogger("engine_service.tools.stack")
DEFAULT_PROMPT = "What is a KV cache in a language model? Answer in two sentences."


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pagedgen-stack", description=__doc__.split("\n")[0])
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="the user message to complete")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--model", default=None,
                   help="local HF directory or GGUF file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--engine-port", type=int, default=0, help="0 = a free port")
    p.add_argument("--index-port", type=int, default=0, help="0 = a free port")
    p.add_argument("--metrics-port", type=int, default=0, help="engine Prometheus port (0 = off)")
    p.add_argument("--keep-running", action="store_true",
                   help="after the completion, serve until Ctrl-C / SIGTERM")
    p.add_argument("--log-dir", type=Path, default=None,
                   help="where the engine's log goes (default: a temporary folder)")
    args = p.parse_args(argv)
    if args.max_tokens < 1:
        p.error(f"--max-tokens must be >= 1, got {args.max_tokens}")
    return args


def stream_completion(target: str, prompt: str, max_tokens: int, temperature: float,
                      out=sys.stdout) -> pb.Usage:
    """One chat prompt through GenerateStream; deltas printed as they arrive."""
    request = pb.GenerateRequest(
        chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=prompt)]),
        sampling=pb.SamplingParams(temperature=temperature, max_tokens=max_tokens),
    )
    usage = pb.Usage()
    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        for chunk in stub.GenerateStream(request, timeout=600):
            for choice in chunk.choices:
                out.write(choice.text)
                out.flush()
            usage = chunk.usage
    out.write("\n")
    return usage


def wait_for_signal() -> None:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()


def run(args: argparse.Namespace) -> int:
    model = args.model
    if model is None:
        from engine_service.tools.prepare_model import ensure_default_model

        print("preparing the default model (converted once, then cached) ...", flush=True)
        model = str(ensure_default_model(quiet=False))
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pagedgen-stack-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with ExitStack() as stack:
        redis = stack.enter_context(RedisProcess())
        print(f"redis         {redis.url}", flush=True)
        index = IndexProcess(redis.url, ["--log-level", "WARNING"], port=args.index_port or None)
        stack.enter_context(index)
        print(f"prefix index  {index.target}", flush=True)
        engine_args = ["--device", args.device, "--prefix-index", index.target,
                       "--engine-id", f"stack-{free_port()}"]
        if args.metrics_port:
            engine_args += ["--metrics-port", str(args.metrics_port)]
        engine = EngineProcess(model, engine_args, port=args.engine_port or None,
                               log_path=log_dir / "engine.log")
        stack.enter_context(engine)
        print(f"engine        {engine.target}  (model {model}, log {log_dir / 'engine.log'})")
        print(f"stack up in {time.monotonic() - started:.1f}s\n", flush=True)
        print(f"user: {args.prompt}\nassistant: ", end="", flush=True)
        usage = stream_completion(engine.target, args.prompt, args.max_tokens,
                                  args.temperature)
        print(f"\n[usage: {usage.prompt_tokens} prompt tokens ({usage.cached_tokens} cached), "
              f"{usage.completion_tokens} completion tokens]", flush=True)
        if args.keep_running:
            print(f"serving on {engine.target}; Ctrl-C to stop", flush=True)
            wait_for_signal()
        print("shutting down ...", flush=True)
        # ExitStack stops them in reverse: the engine drains first, then the index, then Redis.
        code = engine.terminate()
        if code != 0:
            print(f"engine exited with {code}; see {log_dir / 'engine.log'}", file=sys.stderr)
            return 1
    print("stopped cleanly", flush=True)
    return 0


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    try:
        sys.exit(run(args))
    except (RuntimeError, TimeoutError, grpc.RpcError) as error:
        print(f"pagedgen-stack failed: {error}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
