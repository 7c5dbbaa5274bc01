"""Kernel benchmark: paged attention, reshape_and_cache and copy_blocks against contiguous-KV
baselines, at several batch / context shapes.

    python -m bench.kernels [--backend auto|torch|triton] [--dtype float16] [--quick]

On CUDA the engine's kernels are the Triton ones; on CPU the torch path (the Triton kernels
would run in the interpreter, which measures nothing useful). Each row reports the time, the
achieved bandwidth (bytes the operation must move / time, the roofline figure for these
memory-bound kernels) and the speed relative to the baseline, which moves the same bytes
without paging:
    paged attention   torch SDPA over contiguous [batch, kv_heads, context, head_size] K/V
    reshape_and_cache one contiguous copy of the new K and V into a cache slice
    copy_blocks       one contiguous copy of the same number of bytes
Writes bench/results/kernels.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from kernels import KernelBackend, get_kernel_backend

RESULTS = Path(__file__).resolve().parent / "results" / "kernels.json"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class ModelShape:
    num_heads: int
    num_kv_heads: int
    head_size: int
    num_layers: int  # for copy_blocks, which copies a block in every layer


# Llama-3-8B-like on a GPU; SmolLM2-135M (the default model) on a CPU.
GPU_MODEL = ModelShape(num_heads=32, num_kv_heads=8, head_size=128, num_layers=32)
CPU_MODEL = ModelShape(num_heads=9, num_kv_heads=3, head_size=64, num_layers=30)

# (label, num_seqs, query_len, context_len)
GPU_ATTENTION = [
    ("decode", 1, 1, 8192), ("decode", 8, 1, 2048), ("decode", 64, 1, 1024),
    ("decode", 256, 1, 512), ("prefill", 1, 2048, 2048), ("prefill", 4, 512, 4096),
]
CPU_ATTENTION = [
    ("decode", 1, 1, 2048), ("decode", 8, 1, 512), ("decode", 32, 1, 256),
    ("prefill", 1, 256, 256), ("prefill", 2, 64, 512),
]
GPU_TOKENS = [16, 512, 8192]  # reshape_and_cache: new tokens per step
CPU_TOKENS = [16, 512]
GPU_COPIES = [4, 64]  # copy_blocks: (src, dst) pairs per call
CPU_COPIES = [4, 32]


@dataclass
class Row:
    kernel: str
    shape: str
    time_us: float
    gb_per_s: float
    baseline_time_us: float
    baseline_gb_per_s: float
    speed_vs_baseline: float  # baseline time / kernel time: > 1 means faster than the baseline


def _time_s(fn: Callable[[], object], device: torch.device, min_time_s: float) -> float:
    """Seconds per call: do_bench's median on CUDA; the fastest sample on CPU, where the
    cores are shared and a preempted sample measures the neighbours, not the kernel."""
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=max(50, int(min_time_s * 1000))) / 1e3
    fn()  # warm-up (allocator, thread pool)
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < 3 or time.perf_counter() - start < min_time_s:
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return min(samples)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _copy_all(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for dst, src in pairs:
        dst.copy_(src)


def _row(kernel: str, shape: str, nbytes: int, t: float, t_base: float) -> Row:
    return Row(kernel, shape, t * 1e6, nbytes / t / 1e9, t_base * 1e6, nbytes / t_base / 1e9,
               t_base / t)


def bench_attention(backend: KernelBackend, model: ModelShape, cases: list, block_size: int,
                    dtype: torch.dtype, device: torch.device, min_time_s: float) -> list[Row]:
    rows = []
    elem = torch.empty((), dtype=dtype).element_size()
    h, kvh, d = model.num_heads, model.num_kv_heads, model.head_size
    for label, num_seqs, q_len, ctx in tqdm(cases, desc="paged attention", leave=False):
        blocks_per_seq = -(-ctx // block_size)
        num_blocks = num_seqs * blocks_per_seq
        key_cache = torch.randn(num_blocks, block_size, kvh, d, device=device, dtype=dtype)
        value_cache = torch.randn_like(key_cache)
        # Scattered physical blocks, as after some churn in the pool.
        tables = torch.randperm(num_blocks, device=device).view(num_seqs, blocks_per_seq)
        tables = tables.to(torch.int32)
        seq_lens = torch.full((num_seqs,), ctx, dtype=torch.int32, device=device)
        qsl = torch.arange(0, (num_seqs + 1) * q_len, q_len, dtype=torch.int32, device=device)
        query = torch.randn(num_seqs * q_len, h, d, device=device, dtype=dtype)
        scale = d**-0.5
        plan = None
        if backend.build_attention_plan is not None:
            plan = backend.build_attention_plan(tables, seq_lens, qsl, block_size)

        paged = partial(backend.paged_attention, query, key_cache, value_cache, tables,
                        seq_lens, qsl, scale, plan=plan)

        # Baseline: the same K/V already contiguous per sequence.
        k = torch.randn(num_seqs, kvh, ctx, d, device=device, dtype=dtype)
        v = torch.randn_like(k)
        q = query.view(num_seqs, q_len, h, d).transpose(1, 2)
        mask = None
        if q_len > 1:  # causal, bottom-right aligned: query i sees keys <= ctx - q_len + i
            q_pos = torch.arange(ctx - q_len, ctx, device=device)
            mask = torch.arange(ctx, device=device)[None, :] <= q_pos[:, None]

        contiguous = partial(F.scaled_dot_product_attention, q, k, v, attn_mask=mask,
                             scale=scale, enable_gqa=h != kvh)

        # Bytes the operation must move: all K/V once, Q in, O out.
        nbytes = elem * (2 * num_seqs * ctx * kvh * d + 2 * num_seqs * q_len * h * d)
        shape = f"{label} seqs={num_seqs} q={q_len} ctx={ctx}"
        rows.append(_row("paged_attention", shape, nbytes, _time_s(paged, device, min_time_s),
                         _time_s(contiguous, device, min_time_s)))
    return rows


def bench_reshape_and_cache(backend: KernelBackend, model: ModelShape, token_counts: list[int],
                            block_size: int, dtype: torch.dtype, device: torch.device,
                            min_time_s: float) -> list[Row]:
    rows = []
    elem = torch.empty((), dtype=dtype).element_size()
    kvh, d = model.num_kv_heads, model.head_size
    for num_tokens in tqdm(token_counts, desc="reshape_and_cache", leave=False):
        num_blocks = 4 * -(-num_tokens // block_size)
        key_cache = torch.zeros(num_blocks, block_size, kvh, d, device=device, dtype=dtype)
        value_cache = torch.zeros_like(key_cache)
        key = torch.randn(num_tokens, kvh, d, device=device, dtype=dtype)
        value = torch.randn_like(key)
        slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]

        paged = partial(backend.reshape_and_cache, key, value, key_cache, value_cache, slots)
        contiguous = partial(_copy_all, [(key_cache.view(-1, kvh, d)[:num_tokens], key),
                                         (value_cache.view(-1, kvh, d)[:num_tokens], value)])

        nbytes = 2 * 2 * num_tokens * kvh * d * elem  # K and V, read and written
        rows.append(_row("reshape_and_cache", f"tokens={num_tokens}", nbytes,
                         _time_s(paged, device, min_time_s),
                         _time_s(contiguous, device, min_time_s)))
    return rows


def bench_copy_blocks(backend: KernelBackend, model: ModelShape, pair_counts: list[int],
                      block_size: int, dtype: torch.dtype, device: torch.device,
                      min_time_s: float) -> list[Row]:
    rows = []
    elem = torch.empty((), dtype=dtype).element_size()
    for num_pairs in tqdm(pair_counts, desc="copy_blocks", leave=False):
        num_blocks = 4 * num_pairs
        kv_caches = torch.zeros(model.num_layers, 2, num_blocks, block_size, model.num_kv_heads,
                                model.head_size, device=device, dtype=dtype)
        ids = torch.randperm(num_blocks, device=device)
        mapping = torch.stack([ids[:num_pairs], ids[num_pairs:2 * num_pairs]], dim=1)

        paged = partial(backend.copy_blocks, kv_caches, mapping)
        copied = model.num_layers * 2 * num_pairs * kv_caches[0, 0, 0].numel()
        src = torch.randn(copied, device=device, dtype=dtype)
        contiguous = partial(_copy_all, [(torch.empty_like(src), src)])

        rows.append(_row("copy_blocks", f"pairs={num_pairs} layers={model.num_layers}",
                         2 * copied * elem, _time_s(paged, device, min_time_s),
                         _time_s(contiguous, device, min_time_s)))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", choices=("auto", "torch", "triton"), default="auto")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                        help="default: float16 on CUDA, float32 on CPU")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--min-time-s", type=float, default=0.3, help="per measurement")
    parser.add_argument("--quick", action="store_true", help="first shape of each kernel only")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (1 gives stable figures on shared cores)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.type == "cuda"
    dtype = DTYPES[args.dtype or ("float16" if on_gpu else "float32")]
    backend = get_kernel_backend(args.backend, device)
    model = GPU_MODEL if on_gpu else CPU_MODEL
    attention = GPU_ATTENTION if on_gpu else CPU_ATTENTION
    tokens = GPU_TOKENS if on_gpu else CPU_TOKENS
    copies = GPU_COPIES if on_gpu else CPU_COPIES
    if args.quick:
        attention, tokens, copies = attention[:1], tokens[:1], copies[:1]
    common = (args.block_size, dtype, device, args.min_time_s)
    rows = (bench_attention(backend, model, attention, *common)
            + bench_reshape_and_cache(backend, model, tokens, *common)
            + bench_copy_blocks(backend, model, copies, *common))

    name = torch.cuda.get_device_name(device) if on_gpu else _cpu_name()
    report = {
        "device": f"{device.type}: {name}",
        "torch_threads": torch.get_num_threads(),
        "backend": backend.name,
        "dtype": str(dtype).removeprefix("torch."),
        "block_size": args.block_size,
        "model_shape": asdict(model),
        "results": [asdict(r) for r in rows],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")

    print(f"{report['device']}  backend={backend.name}  dtype={report['dtype']}  "
          f"block_size={args.block_size}  heads={model.num_heads}/{model.num_kv_heads}x"
          f"{model.head_size}")
    print(f"{'kernel':<18} {'shape':<34} {'time us':>10} {'GB/s':>8} {'base us':>10} "
          f"{'base GB/s':>9} {'speed':>6}")
    for r in rows:
        print(f"{r.kernel:<18} {r.shape:<34} {r.time_us:>10.1f} {r.gb_per_s:>8.2f} "
              f"{r.baseline_time_us:>10.1f} {r.baseline_gb_per_s:>9.2f} "
              f"{r.speed_vs_baseline:>5.2f}x")
    print(f"speed = baseline time / kernel time (> 1: faster than the contiguous baseline); "
          f"wrote {args.out}")


if __name__ == "__main__":
    main()
