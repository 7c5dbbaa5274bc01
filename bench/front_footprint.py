"""What the processes that run no model cost to start: import time and memory (issue 36).

    python -m bench.front_footprint                 # 5 imports a module, 2 served engines
    python -m bench.front_footprint --json out.json
    python -m bench.front_footprint --front-imports-torch   # and a front that imports torch

- **imports**: each light entry point's module (the engine's serving front, the router, the
  prefix index) imported in a fresh interpreter under `-X importtime`: the total (the
  cumulative time of the top-level imports), torch's part, the process's wall time and peak
  RSS (VmHWM), whether torch got loaded. Median of `--repeats`.
- **served**: a real `pagedgen-engine` (`--prefix-index none`, float32) on the random
  one-layer Llama of bench/step_loop.py, 8 greedy requests (every other one with logprobs), then
  VmRSS of the front and of its engine core from /proc, the front's CPU seconds until it
  served, and whether the front maps libtorch. `--front-imports-torch` alternates it with a
  front started as `python -c "import torch; ...main()"`: the front as it was before it stopped
  importing torch (its core, spawned from `-c`, then also skips importing the front's modules
  as `__mp_main__`, ~13 MiB less than the pagedgen-engine script's core).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import grpc

from bench.step_loop import tiny_llama
from engine_service.tools.launch import EngineProcess
from pagedgen_api import generation_pb2 as pb
from pagedgen_api import generation_pb2_grpc as pb_grpc

MODULES = ("engine_service.serving.server", "router.server", "prefix_index.server.main")
CACHE = Path(os.environ.get("PAGEDGEN_CACHE_DIR", Path.home() / ".cache" / "pagedgen"))
MAX_MODEL_LEN = 1024
# The peak RSS of the interpreter itself: VmHWM (ru_maxrss would keep this process's own peak
# across the fork and exec).
REPORT = ("import sys; peak = [line.split()[1] for line in open('/proc/self/status') "
          "if line.startswith('VmHWM:')][0]; print(peak, int('torch' in sys.modules))")
# A top-level line of -X importtime: self us | cumulative us | one space, then the name.
IMPORT_LINE = re.compile(r"import time:\s+\d+ \|\s+(\d+) \| (\S.*)")


def import_cost(module: str) -> dict:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {module}; {REPORT}"],
                          capture_output=True, text=True, check=True)
    wall_s = time.perf_counter() - started
    total_us = torch_us = 0
    for line in done.stderr.splitlines():
        match = IMPORT_LINE.match(line)
        if match and not match.group(2).startswith(" "):
            total_us += int(match.group(1))
        if match and match.group(2).strip() == "torch":
            torch_us = int(match.group(1))
    max_rss_kib, torch_loaded = done.stdout.split()
    return {"total_s": total_us / 1e6, "torch_s": torch_us / 1e6, "wall_s": wall_s,
            "max_rss_mib": int(max_rss_kib) / 1024, "torch": bool(int(torch_loaded))}


def imports(repeats: int) -> dict:
    out = {}
    for module in MODULES:
        runs = [import_cost(module) for _ in range(repeats)]
        out[module] = {key: statistics.median(r[key] for r in runs)
                       for key in ("total_s", "torch_s", "wall_s", "max_rss_mib")}
        out[module]["total_s_range"] = [min(r["total_s"] for r in runs),
                                        max(r["total_s"] for r in runs)]
        out[module]["torch"] = any(r["torch"] for r in runs)
    return out


class TorchFront(EngineProcess):
    """pagedgen-engine whose front imports torch first, as it did before issue 36's change."""

    def command(self) -> list[str]:
        script = ("import sys, torch; sys.argv[0] = 'pagedgen-engine'; "
                  "from engine_service.serving.server import main; main()")
        return [sys.executable, "-c", script, *super().command()[1:]]


def vm_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def core_pid(front: int) -> int | None:
    """The front's child that runs the engine (multiprocessing's spawn_main; not its
    resource tracker)."""
    for task in Path(f"/proc/{front}/task").iterdir():
        for child in (task / "children").read_text().split():
            command = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"spawn_main" in command:
                return int(child)
    return None


def served(model_dir: Path, process_type: type[EngineProcess]) -> dict:
    args = ["--prefix-index", "none", "--dtype", "float32", "--num-blocks", "256",
            "--max-model-len", str(MAX_MODEL_LEN), "--log-level", "WARNING", "--insecure"]
    started = time.monotonic()
    with process_type(model_dir, args) as engine:
        front = engine.proc.pid
        ready_s, front_cpu_ready_s = time.monotonic() - started, cpu_s(front)
        with grpc.insecure_channel(engine.target) as channel:
            stub = pb_grpc.GenerationStub(channel)
            for i in range(8):
                sampling = pb.SamplingParams(max_tokens=16, temperature=0.0,
                                             logprobs=2 if i % 2 else None)
                stub.Generate(pb.GenerateRequest(text=f"Hello number {i}", sampling=sampling),
                              timeout=120)
        core = core_pid(front)
        return {"ready_s": ready_s, "front_cpu_to_ready_s": front_cpu_ready_s,
                "front_rss_mib": vm_rss_mib(front),
                "core_rss_mib": vm_rss_mib(core) if core else None,
                "front_maps_libtorch": "libtorch" in Path(f"/proc/{front}/maps").read_text()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.front_footprint",
                                description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5, help="imports of each module")
    p.add_argument("--served-repeats", type=int, default=2, help="engines started (each kind)")
    p.add_argument("--front-imports-torch", action="store_true",
                   help="alternate with a front that imports torch (the state before)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    result = {"load_average": os.getloadavg(), "imports": imports(args.repeats)}
    for module, cost in result["imports"].items():
        print(f"{module}: import {cost['total_s']:.2f} s (torch {cost['torch_s']:.2f} s), "
              f"process {cost['wall_s']:.2f} s, max RSS {cost['max_rss_mib']:.0f} MiB, "
              f"torch loaded: {cost['torch']}", flush=True)
    model_dir = tiny_llama(CACHE / "models" / "step-loop-tiny", MAX_MODEL_LEN)
    kinds = {"front": EngineProcess}
    if args.front_imports_torch:
        kinds["front_imports_torch"] = TorchFront
    result["served"] = {name: [] for name in kinds}
    for _ in range(args.served_repeats):
        for name, process_type in kinds.items():
            run = served(model_dir, process_type)
            result["served"][name].append(run)
            print(f"{name}: ready in {run['ready_s']:.1f} s (front CPU "
                  f"{run['front_cpu_to_ready_s']:.2f} s), front VmRSS "
                  f"{run['front_rss_mib']:.0f} MiB, core VmRSS {run['core_rss_mib']:.0f} MiB, "
                  f"front maps libtorch: {run['front_maps_libtorch']}", flush=True)
    result["load_average_after"] = os.getloadavg()
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
