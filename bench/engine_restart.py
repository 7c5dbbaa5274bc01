"""How long pagedgen-engine takes to start and to stop: what a rolling restart, a crash's
restart and every test that starts an engine wait for.

    python -m bench.engine_restart                          # this tree, SmolLM2, 5 runs
    python -m bench.engine_restart --baseline-ref cee7697   # and that commit, alternated
    python -m bench.engine_restart --json out.json

Each run spawns `python -m engine_service.serving.server` (`--prefix-index none`, plain text,
the shipped defaults otherwise) and measures:
- **ready_s**: from the spawn to health SERVING (polled every 10 ms);
- **first_reply_s**: one greedy 8-token Generate of a text prompt after that;
- **stop_s**: from SIGTERM to the process's exit (nothing live: the drain has nothing to wait
  for, so this is the teardown alone).
`--baseline-ref` checks that commit out in a git worktree (in a temporary folder) and runs its
engine the same way, alternating run by run with this tree's in one process, so both see the
same machine load; the medians and their ratios are printed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from prefix_index.tools.redis_process import free_port

REPO_ROOT = Path(__file__).resolve().parents[1]
MEASURES = ("ready_s", "first_reply_s", "stop_s")


def one_run(tree: Path, model: str) -> dict:
    port = free_port("127.0.0.1")
    target = f"127.0.0.1:{port}"
    command = [sys.executable, "-m", "engine_service.serving.server", "--model", model,
               "--port", str(port), "--prefix-index", "none", "--insecure",
               "--log-level", "WARNING"]
    # The tree's own modules first (an editable install of another tree comes after).
    env = {**os.environ, "PYTHONPATH": str(tree)}
    started = time.monotonic()
    proc = subprocess.Popen(command, cwd=tree, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        with grpc.insecure_channel(target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"the engine exited with {proc.returncode}:\n"
                                       f"{proc.stderr.read()[-3000:]}")
                with contextlib.suppress(grpc.RpcError):
                    reply = health.Check(health_pb2.HealthCheckRequest(), timeout=0.5)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        break
                time.sleep(0.01)
            ready_s = time.monotonic() - started
            asked = time.monotonic()
            pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(
                text="Hello", sampling=pb.SamplingParams(temperature=0, max_tokens=8)),
                timeout=120)
            first_reply_s = time.monotonic() - asked
        stopping = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
        stop_s = time.monotonic() - stopping
        if code != 0:
            raise RuntimeError(f"the engine exited with {code} after SIGTERM")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return {"ready_s": ready_s, "first_reply_s": first_reply_s, "stop_s": stop_s}


@contextlib.contextmanager
def worktree(ref: str) -> Iterator[Path]:
    """`ref` checked out in a temporary git worktree (removed after)."""
    with tempfile.TemporaryDirectory(prefix="pagedgen-baseline-") as folder:
        path = Path(folder) / "tree"
        subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "add", "--detach", "-q",
                        str(path), ref], check=True)
        try:
            yield path
        finally:
            subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "remove", "--force",
                            str(path)], check=False)


def medians(runs: list[dict]) -> dict:
    return {key: statistics.median(r[key] for r in runs) for key in MEASURES}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.engine_restart",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None,
                   help="model directory or GGUF file (default: SmolLM2, prepared once)")
    p.add_argument("--runs", type=int, default=5, help="starts and stops of each tree")
    p.add_argument("--baseline-ref", default=None,
                   help="a commit to measure too, alternated with this tree")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    model = args.model
    if model is None:
        from engine_service.tools.prepare_model import ensure_default_model

        model = str(ensure_default_model(quiet=True))
    result: dict = {"model": model, "load_average": os.getloadavg(), "runs": {}}
    with contextlib.ExitStack() as stack:
        trees = {"this tree": REPO_ROOT}
        if args.baseline_ref:
            trees[args.baseline_ref] = stack.enter_context(worktree(args.baseline_ref))
        for name in trees:
            one_run(trees[name], model)  # a first start warms the page cache: not counted
        for i in range(args.runs):
            for name, tree in trees.items():
                run = one_run(tree, model)
                result["runs"].setdefault(name, []).append(run)
                print(f"{name} #{i + 1}: ready {run['ready_s']:.2f} s, first reply "
                      f"{run['first_reply_s']:.2f} s, stop {run['stop_s']:.2f} s", flush=True)
    result["medians"] = {name: medians(runs) for name, runs in result["runs"].items()}
    for name, m in result["medians"].items():
        print(f"{name}: median ready {m['ready_s']:.2f} s, first reply "
              f"{m['first_reply_s']:.2f} s, stop {m['stop_s']:.2f} s")
    if args.baseline_ref:
        mine, base = result["medians"]["this tree"], result["medians"][args.baseline_ref]
        result["ratios"] = {key: mine[key] / base[key] for key in MEASURES}
        print("this tree / baseline: " + ", ".join(
            f"{key} {value:.2f}x" for key, value in result["ratios"].items()))
    result["load_average_after"] = os.getloadavg()
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
