"""How long pagedgen-engine takes to start and to stop: what a rolling restart, a crash's
restart and every test that starts an engine wait for.

    pagedgen-bench engine-restart                          # this tree, SmolLM2, 5 runs
    pagedgen-bench engine-restart --baseline-ref cee7697   # and that commit, alternated
    pagedgen-bench engine-restart --json out.json          # (or python -m bench.engine_restart)

Each run spawns `python -m engine_service.serving.server` (`--prefix-index none`, plain text,
the shipped defaults otherwise) and measures:
- **ready_s**: from the spawn to health SERVING (polled every 10 ms);
- **first_reply_s**: one greedy 8-token Generate of a text prompt after that;
- **stop_s**: from SIGTERM to the process's exit (nothing live: the drain has nothing to wait
  for, so this is the teardown alone).
`--baseline-ref` checks that commit out in a git worktree (in a temporary folder) and runs its
engine the same way, alternating run by run with this tree's in one process, so both see the
same machine load; the medians and their ratios are printed. The worktree builds its own CPU
extension, in that temporary folder (~25 s, in the first start, which is not counted).
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
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc
from prefix_index.tools.redis_process import free_port

REPO_ROOT = Path(__file__).resolve().parents[1]
MEASURES = ("ready_s", "first_reply_s", "stop_s")
START_TIMEOUT_S = 300.0  # a GGUF model's start takes ~30 s here


@dataclass(frozen=True, slots=True)
class Tree:
    """A checkout to run the engine from, and where its CPU extension builds (None: the
    usual cache)."""

    path: Path
    extensions_dir: Path | None = None


def one_run(tree: Tree, model: str, log_path: Path) -> dict:
    port = free_port("127.0.0.1")
    target = f"127.0.0.1:{port}"
    command = [sys.executable, "-m", "engine_service.serving.server", "--model", model,
               "--port", str(port), "--prefix-index", "none", "--insecure",
               "--log-level", "WARNING"]
    # The tree's own modules first (an editable install of another tree comes after).
    env = {**os.environ, "PYTHONPATH": str(tree.path)}
    if tree.extensions_dir is not None:
        env["PAGEDGEN_EXTENSIONS_DIR"] = str(tree.extensions_dir)
    started = time.monotonic()
    with log_path.open("w") as log:
        proc = subprocess.Popen(command, cwd=tree.path, env=env, stdout=subprocess.DEVNULL,
                                stderr=log)
    try:
        with grpc.insecure_channel(target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                if proc.poll() is not None or time.monotonic() - started > START_TIMEOUT_S:
                    said = "exited with" if proc.poll() is not None else "did not serve in"
                    what = proc.returncode if proc.poll() is not None else f"{START_TIMEOUT_S} s"
                    raise RuntimeError(f"the engine {said} {what}:\n"
                                       f"{log_path.read_text()[-3000:]}")
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
def worktree(ref: str, folder: Path) -> Iterator[Tree]:
    """`ref` checked out in a git worktree in `folder` (removed after), its CPU extension
    built there too: the usual cache keeps no build for a path used once."""
    path = folder / "tree"
    subprocess.run(["git", "-C", str(REPO_ROOT), "worktree", "add", "--detach", "-q",
                    str(path), ref], check=True)
    try:
        yield Tree(path, folder / "extensions")
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
    with tempfile.TemporaryDirectory(prefix="pagedgen-restart-") as scratch, \
            contextlib.ExitStack() as stack:
        log_path = Path(scratch) / "engine.log"
        trees = {"this tree": Tree(REPO_ROOT)}
        if args.baseline_ref:
            trees[args.baseline_ref] = stack.enter_context(
                worktree(args.baseline_ref, Path(scratch)))
        for tree in trees.values():
            # Not counted: it warms the page cache (and builds a worktree's extension).
            one_run(tree, model, log_path)
        for i in range(args.runs):
            for name, tree in trees.items():
                run = one_run(tree, model, log_path)
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
