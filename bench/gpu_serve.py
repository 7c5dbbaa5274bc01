"""The engine served end to end over gRPC: 64 concurrent streams of the fixed workload.

    python -m bench.gpu_serve --model DIR --out DIR [--dry]

`pagedgen-engine` runs as its own process with the offline run's settings
(bench/gpu_common.ENGINE_SETTINGS; no prefix index: the local LRU, as offline), and a
grpc.aio client in this process opens one GenerateStream per request, all 64 at once, every
token stamped on arrival (bench/peers_grpc.py). Output tokens per second over the run is read
against the offline API's figure on the same workload (bench/gpu_decode.py, same check run).
An untimed run of 8 short requests first: the first streams of a server pay one-off costs.
"""

from __future__ import annotations

import argparse
import signal
import tempfile
import time
from pathlib import Path

from bench.gpu_common import DRY_WORKLOAD, ENGINE_SETTINGS, FIXED_WORKLOAD, StageReport, log


def engine_args(dry: bool) -> list[str]:
    args = ["--prefix-index", "none", "--log-level", "WARNING"]
    for key, value in ENGINE_SETTINGS.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    if dry:
        return args + ["--device", "cpu", "--num-blocks", "1024"]
    return args + ["--device", "cuda", "--dtype", "bfloat16"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_serve",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--out", type=Path, required=True, help="directory for serve.json")
    p.add_argument("--dry", action="store_true", help="tiny model on the CPU (plumbing only)")
    p.add_argument("--log", type=Path, default=None, help="the engine's log (default: a temp)")
    args = p.parse_args(argv)
    from bench.metrics import summarize
    from bench.peers_grpc import run_grpc
    from bench.workloads import fixed_random
    from engine_service.tools.launch import EngineProcess

    report = StageReport(args.out / "serve.json", "serve", args.dry)
    spec = DRY_WORKLOAD if args.dry else FIXED_WORKLOAD
    workload = fixed_random(**spec)
    extra = engine_args(args.dry)
    report.set("engine_args", extra)
    log_path = args.log or Path(tempfile.mkdtemp(prefix="gpu_serve_")) / "engine.log"
    # The stage's time limit arrives as SIGTERM. Python's default would end this process
    # without leaving the `with` below, and the engine, draining for up to 30 s, would hold
    # most of the GPU's memory into the next stage: exit through it instead, and kill the
    # engine at once (its figures are lost anyway).
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    t0 = time.perf_counter()
    with EngineProcess(args.model, [*extra, "--insecure"], start_timeout_s=240,
                       log_path=log_path) as server:
        report.set("engine_start_s", time.perf_counter() - t0)
        log(f"engine serving at {server.target} after {time.perf_counter() - t0:.1f} s")
        try:
            run_grpc(server.target, fixed_random(8, 16, 64, 8, spec["seed"] + 99), "warmup",
                     progress=False)
            run = run_grpc(server.target, workload, "grpc",
                           max_concurrency=spec["num_requests"], progress=False)
        except SystemExit:
            server.kill()
            raise
    summary = summarize(run.records, run.duration_s)
    report.set("grpc", {"workload": spec, "duration_s": run.duration_s,
                        "output_tokens": summary.num_output_tokens,
                        "output_tok_per_s": summary.output_throughput,
                        "num_steps": run.num_forward_passes,
                        "ttft_p50_ms": summary.ttft["p50_ms"],
                        "tpot_p50_ms": summary.tpot["p50_ms"]})
    log(f"gRPC: {summary.output_throughput:.0f} output tok/s over {run.duration_s:.1f} s "
        f"({summary.num_output_tokens} tokens); engine log {log_path}")
    report.done()


def _exit_on_sigterm(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    main()
