"""The CPU linear (float32: kernels/csrc/linear_cpu.cpp; bfloat16 on AVX512-BF16:
kernels/csrc/linear_bf16_cpu.cpp, on AMX tiles where the CPU has them: linear_bf16_amx.cpp;
the results record which) against what it replaced, oneDNN's packed linear, and against
plain `F.linear` (MKL), side by side in one run, at SmolLM2's linear shapes and at 1 row (a
batch-1 decode), 4, 32 (a batch-32 decode), 256 and 2048 (prefill
chunks).

    python -m bench.linear [--threads 1,2] [--dtype float32|bfloat16] [--quick]

Each figure is the median of repeated calls on the same weights and input (the weights of the
LM head, 113 MB, stream from memory each call; the layer weights, 1.3 to 7 MB, may sit in the
L3 cache between calls, as they do not in a decode step, where 30 layers pass between two uses
of one). Reported: microseconds per call, weight bytes read per second (the batch-1 roofline
figure) and GFLOP/s (the batch-32 and prefill one), and ours over each baseline. Writes
bench/results/linear.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

RESULTS = Path(__file__).resolve().parent / "results" / "linear.json"
# SmolLM2-135M: qkv (576 -> 960), o (576 -> 576), gate_up (576 -> 3072), down (1536 -> 576),
# LM head (576 -> 49152); (in_features, out_features)
SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152))
ROWS = (1, 4, 32, 256, 2048)  # 2048: a whole prefill chunk (max_num_batched_tokens)


def _median_s(fn: Callable[[], object], min_time_s: float) -> float:
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    for _ in range(3):
        fn()
    times: list[float] = []
    spent = 0.0
    while spent < min_time_s or len(times) < 5:
        start = clock()
        fn()
        elapsed = clock() - start
        times.append(elapsed)
        spent += elapsed
    return statistics.median(times)


def measure(threads: int, rows_list: tuple[int, ...], min_time_s: float,
            dtype: torch.dtype = torch.float32) -> list[dict]:
    from engine_service.model.models.packed_linear import pack_weight
    from kernels.cpu_extension import cpu_attention_available

    if not cpu_attention_available():
        raise SystemExit("the C++ extension does not build here: nothing to compare")
    if dtype == torch.bfloat16 and not torch.ops.pagedgen_cpu_linear.bf16_native():
        raise SystemExit("no AVX512-BF16 build here: the bfloat16 linear is oneDNN's, nothing to "
                         "compare")
    torch.set_num_threads(threads)
    rows_out = []
    for in_features, out_features in SHAPES:
        weight = torch.randn(out_features, in_features).to(dtype)
        ours_packed = torch.ops.pagedgen_cpu_linear.pack_weight(weight)
        onednn_packed = pack_weight(weight) if torch.backends.mkldnn.is_available() else None
        for rows in rows_list:
            x = torch.randn(rows, in_features).to(dtype)
            calls = {
                "ours": partial(torch.ops.pagedgen_cpu_linear.linear, x, ours_packed, None,
                                out_features),
                "mkl": partial(F.linear, x, weight),
            }
            if onednn_packed is not None:
                calls["onednn"] = partial(torch.ops.mkldnn._linear_pointwise, x, onednn_packed,
                                          None, "none", [], "")
            seconds = {name: _median_s(call, min_time_s) for name, call in calls.items()}
            seconds.setdefault("onednn", float("nan"))  # (a torch without oneDNN)
            weight_bytes = weight.numel() * weight.element_size()
            flops = 2 * rows * in_features * out_features
            rows_out.append({
                "threads": threads, "dtype": str(dtype).removeprefix("torch."),
                "in_features": in_features, "out_features": out_features,
                "rows": rows,
                **{f"{name}_us": s * 1e6 for name, s in seconds.items()},
                "ours_gb_s": weight_bytes / seconds["ours"] / 1e9,
                "ours_gflop_s": flops / seconds["ours"] / 1e9,
                "ours_over_onednn": seconds["onednn"] / seconds["ours"],
                "ours_over_mkl": seconds["mkl"] / seconds["ours"],
            })
    return rows_out


def _our_kernel(dtype: str) -> str:
    if dtype == "float32":
        return "panels of 16 columns (linear_cpu.cpp)"
    if torch.ops.pagedgen_cpu_linear.bf16_amx():
        return "AMX tiles (linear_bf16_amx.cpp)"
    return "VDPBF16PS (linear_bf16_cpu.cpp)"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.linear", description=__doc__.split("\n")[0])
    p.add_argument("--threads", default="1,2", help="torch thread counts, comma-separated")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--quick", action="store_true", help="rows 1 and 32, short timings")
    p.add_argument("--out", type=Path, default=None,
                   help="default: bench/results/linear.json (float32), linear_bf16.json")
    args = p.parse_args(argv)
    rows_list = (1, 32) if args.quick else ROWS
    min_time_s = 0.05 if args.quick else 0.3
    results = []
    print(f"load {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print(f"{'threads':>7} {'shape':>12} {'rows':>5} {'ours us':>9} {'oneDNN us':>10} "
          f"{'MKL us':>9} {'GB/s':>6} {'GFLOP/s':>8} {'vs oneDNN':>9} {'vs MKL':>7}")
    for threads in (int(t) for t in args.threads.split(",")):
        for r in measure(threads, rows_list, min_time_s, getattr(torch, args.dtype)):
            results.append(r)
            print(f"{r['threads']:>7} {r['in_features']:>5}x{r['out_features']:<6} "
                  f"{r['rows']:>5} {r['ours_us']:>9.1f} {r['onednn_us']:>10.1f} "
                  f"{r['mkl_us']:>9.1f} {r['ours_gb_s']:>6.1f} {r['ours_gflop_s']:>8.1f} "
                  f"{r['ours_over_onednn']:>8.2f}x {r['ours_over_mkl']:>6.2f}x", flush=True)
    from bench.metadata import machine_metadata

    if args.out is None:
        args.out = RESULTS if args.dtype == "float32" else RESULTS.with_name("linear_bf16.json")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    meta = machine_metadata("random weights at SmolLM2-135M's linear shapes")
    kernel = _our_kernel(args.dtype)
    print(f"ours: {kernel}")
    args.out.write_text(json.dumps({"meta": meta, "load_end": list(os.getloadavg()),
                                    "ours_kernel": kernel, "rows": results}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
