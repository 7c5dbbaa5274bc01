"""The card's limits, measured by a method fixed in advance, and the spec they are read against.

    python -m bench.gpu_limits --out DIR [--dry]

- Read bandwidth: a read-only reduction (torch.sum) over a 4 GiB float32 tensor, best of 10.
  Read-only because a decode step reads weights and KV and writes almost nothing; a copy
  also writes, and its figure mixes the two directions. 4 GiB is 80x the L2, so no repeat
  hits the cache. Best of 10: the limit is what the card can do, not its average.
- bf16 GEMM peak: one 8192 x 8192 x 8192 bf16 matmul, best of 10: large enough to run at
  the tensor cores' sustained rate (the square shape cuBLAS tunes best).
- A device-to-device copy's bandwidth (bytes read + written), for reference only.
Each figure is also read against the vendor's spec (bench/gpu_common.CARD_SPECS). The other
stages' ratios are taken against the measured figures in this file, from the same run.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import sys
from pathlib import Path

import torch

from bench.gpu_common import StageReport, card_spec, device_slug, log, time_ms

READ_BYTES = 4 << 30
GEMM_SIZE = 8192
REPEATS = 10
DRY_READ_BYTES = 64 << 20
DRY_GEMM_SIZE = 256


def read_bandwidth(nbytes: int, repeats: int, device: str) -> dict:
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    out = torch.empty((), dtype=torch.float32, device=device)
    times = time_ms(lambda: torch.sum(x, dim=0, out=out), repeats, warmup=2, device=device)
    best = min(times)
    return {"bytes": nbytes, "times_ms": times, "best_ms": best,
            "gb_per_s": nbytes / best / 1e6}


def copy_bandwidth(nbytes: int, repeats: int, device: str) -> dict:
    src = torch.ones(nbytes // 2 // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    times = time_ms(lambda: dst.copy_(src), repeats, warmup=2, device=device)
    best = min(times)
    # Half the bytes are read and half written.
    return {"bytes_moved": nbytes, "best_ms": best, "gb_per_s": nbytes / best / 1e6}


def gemm_peak(n: int, repeats: int, device: str) -> dict:
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=gen)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=gen)
    c = torch.empty(n, n, device=device, dtype=torch.bfloat16)
    times = time_ms(lambda: torch.mm(a, b, out=c), repeats, warmup=3, device=device)
    best = min(times)
    flops = 2 * n**3
    return {"size": n, "flops": flops, "times_ms": times, "best_ms": best,
            "tflops": flops / best / 1e9}


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def device_facts(device: str) -> dict:
    facts = {"python": sys.version.split()[0], "torch": torch.__version__,
             "host": platform.node()}
    facts.update({name: _version(name) for name in ("triton", "transformers", "grpcio",
                                                    "protobuf")})
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        facts.update(name=p.name, sms=p.multi_processor_count, memory_mib=p.total_memory >> 20,
                     l2_mib=getattr(p, "L2_cache_size", 0) / 2**20,
                     capability=f"{p.major}.{p.minor}")
    else:
        facts.update(name=f"cpu ({platform.processor() or platform.machine()})", sms=None,
                     memory_mib=None)
    return facts


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_limits",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="directory for limits.json")
    p.add_argument("--dry", action="store_true",
                   help="tiny sizes on the CPU: checks the plumbing, measures nothing")
    args = p.parse_args(argv)
    device = "cpu" if args.dry else "cuda"
    report = StageReport(args.out / "limits.json", "limits", args.dry)
    facts = device_facts(device)
    spec = card_spec(facts["name"]) if device == "cuda" else None
    report.set("device", facts)
    report.set("device_slug", device_slug(facts["name"]) if device == "cuda" else "cpu-dry")
    report.set("spec", None if spec is None else {"name": spec.name,
                                                   "read_gb_per_s": spec.read_gb_per_s,
                                                   "bf16_tflops": spec.bf16_tflops})
    log(f"device {facts['name']}, spec {spec}")
    read = read_bandwidth(DRY_READ_BYTES if args.dry else READ_BYTES, REPEATS, device)
    report.set("read", read)
    log(f"read bandwidth {read['gb_per_s']:.0f} GB/s (best of {REPEATS}, "
        f"{read['bytes'] >> 20} MiB float32 sum)")
    copy = copy_bandwidth(DRY_READ_BYTES if args.dry else READ_BYTES, 5, device)
    report.set("copy", copy)
    log(f"copy bandwidth {copy['gb_per_s']:.0f} GB/s (read + written)")
    gemm = gemm_peak(DRY_GEMM_SIZE if args.dry else GEMM_SIZE, REPEATS, device)
    report.set("gemm", gemm)
    log(f"bf16 GEMM {gemm['tflops']:.0f} TFLOP/s (best of {REPEATS}, {gemm['size']}^3)")
    report.done()


if __name__ == "__main__":
    main()
