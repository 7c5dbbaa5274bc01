"""Attention on the GPU: decode against the measured bandwidth, prefill against SDPA.

    python -m bench.gpu_attention --out DIR [--dry]

Llama-3-8B's heads (32 query / 8 KV heads of 128), bf16, blocks of 16 tokens, scattered
through the pool as after some churn.
- Decode: one query token per sequence over its whole context, at 1 x 8,192, 8 x 2,048,
  64 x 1,024, 256 x 512 and a skewed batch (one 32,768-token sequence with 63 of 512). The 32
  layers' calls, each over its own layer's K/V, are captured in one CUDA graph and the graph
  is timed, as a decode step runs them: no host launch gaps, and 32 layers' K/V (1 GB and
  more) never fit the L2, so every byte comes from HBM. Figure: bytes the calls must move
  (all K/V once, Q in, O out) / time, read against the measured read bandwidth.
- Prefill: one sequence of 8,192 and of 32,768 new tokens, causal, through the paged kernel;
  against torch SDPA with is_causal=True on contiguous K/V (the FlashAttention-class
  baseline: no mask tensor, which would rule out the flash and cuDNN backends), on each
  backend that runs, the best taken. Both in TFLOP/s of the same causal count.
Times are medians of CUDA-event timings (the limits they are read against are best-of).
"""

from __future__ import annotations

import argparse
import gc
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.gpu_common import StageReport, causal_pairs, failure, log, median, time_ms
from bench.kernels import GPU_MODEL, ModelShape
from kernels import get_kernel_backend

BLOCK_SIZE = 16
DECODE_SHAPES = (
    ("decode 1x8192", [8192]),
    ("decode 8x2048", [2048] * 8),
    ("decode 64x1024", [1024] * 64),
    ("decode 256x512", [512] * 256),
    ("decode skewed 1x32768+63x512", [32768] + [512] * 63),
)
PREFILL_LENGTHS = (8192, 32768)
DRY_MODEL = ModelShape(num_heads=4, num_kv_heads=2, head_size=16, num_layers=2)
DRY_DECODE_SHAPES = (("decode 2x64", [64] * 2), ("decode skewed 1x256+3x32", [256] + [32] * 3))
DRY_PREFILL_LENGTHS = (64, 128)
DECODE_REPEATS = 10
PREFILL_REPEATS = 5
# The math backend materializes the score matrix (137 GB at 32k tokens): never the best on a
# GPU, so it runs in the dry run only.
SDPA_BACKENDS = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION")
DRY_SDPA_BACKENDS = SDPA_BACKENDS + ("MATH",)


def _paged_kv(model: ModelShape, layers: int, seq_lens: list[int], device: str,
              dtype: torch.dtype, seed: int = 0):
    """K/V caches of `layers` layers holding every sequence, and block tables that scatter
    each sequence's blocks over the pool."""
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks = [-(-n // BLOCK_SIZE) for n in seq_lens]
    num_blocks = sum(blocks)
    caches = torch.empty(layers, 2, num_blocks, BLOCK_SIZE, model.num_kv_heads,
                         model.head_size, device=device, dtype=dtype)
    caches.normal_(generator=gen)
    order = torch.randperm(num_blocks, device=device, generator=gen).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device=device)
    start = 0
    for row, n in enumerate(blocks):
        tables[row, :n] = order[start:start + n]
        start += n
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return caches, tables, seq_lens_t


def decode_case(backend, model: ModelShape, name: str, seq_lens: list[int], device: str,
                dtype: torch.dtype) -> dict:
    layers = model.num_layers
    caches, tables, seq_lens_t = _paged_kv(model, layers, seq_lens, device, dtype)
    n = len(seq_lens)
    qsl = torch.arange(n + 1, dtype=torch.int32, device=device)
    query = torch.randn(n, model.num_heads, model.head_size, device=device, dtype=dtype)
    scale = model.head_size**-0.5

    def all_layers() -> None:
        for layer in range(layers):
            backend.paged_attention(query, caches[layer, 0], caches[layer, 1], tables,
                                    seq_lens_t, qsl, scale)

    all_layers()  # compiles the variant outside the capture
    run = all_layers
    if device == "cuda":
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            all_layers()
        run = graph.replay
    times = time_ms(run, DECODE_REPEATS, warmup=2, device=device)
    elem = torch.empty((), dtype=dtype).element_size()
    kv_bytes = 2 * sum(seq_lens) * model.num_kv_heads * model.head_size * elem
    qo_bytes = 2 * n * model.num_heads * model.head_size * elem
    nbytes = layers * (kv_bytes + qo_bytes)
    ms = median(times)
    splits = None
    if device == "cuda" and backend.name == "triton":
        from kernels.triton_attention import choose_num_kv_splits

        splits = choose_num_kv_splits(n, n, model.num_kv_heads, tables.shape[1] * BLOCK_SIZE,
                                      torch.device(device))
    return {"name": name, "num_seqs": n, "context_tokens": sum(seq_lens),
            "max_context": max(seq_lens), "layers": layers, "cuda_graph": device == "cuda",
            "num_kv_splits": splits, "times_ms": times, "median_ms": ms, "bytes": nbytes,
            "gb_per_s": nbytes / ms / 1e6}


def _sdpa_times(q, k, v, device: str) -> dict[str, float | str]:
    """Median ms of SDPA (is_causal=True) on each backend, K/V as grouped heads
    (enable_gqa) and expanded to every query head, the better of the two per backend; a
    backend that refuses the inputs gets its error's first line."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = q.shape[1] // k.shape[1]
    expanded = (k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1))
    results: dict[str, float | str] = {}
    for backend_name in SDPA_BACKENDS if device == "cuda" else DRY_SDPA_BACKENDS:
        backend = getattr(SDPBackend, backend_name)
        best = None
        errors = []
        for kk, vv, gqa in ((k, v, True), (*expanded, False)):
            def call(kk=kk, vv=vv, gqa=gqa):
                return F.scaled_dot_product_attention(q, kk, vv, is_causal=True,
                                                      enable_gqa=gqa)
            try:
                with sdpa_kernel(backend):
                    ms = median(time_ms(call, PREFILL_REPEATS, warmup=1, device=device))
            except RuntimeError as error:
                errors.append(str(error).strip().splitlines()[0][:160])
                continue
            best = ms if best is None else min(best, ms)
        results[backend_name] = best if best is not None else "; ".join(dict.fromkeys(errors))
    return results


def prefill_case(backend, model: ModelShape, length: int, device: str,
                 dtype: torch.dtype) -> dict:
    """One layer's call (a prefill chunk is tens of ms: graphs and L2 do not matter)."""
    caches, tables, seq_lens_t = _paged_kv(model, 1, [length], device, dtype)
    qsl = torch.tensor([0, length], dtype=torch.int32, device=device)
    query = torch.randn(length, model.num_heads, model.head_size, device=device, dtype=dtype)
    scale = model.head_size**-0.5

    def paged() -> None:
        backend.paged_attention(query, caches[0, 0], caches[0, 1], tables, seq_lens_t, qsl,
                                scale)

    ours_ms = median(time_ms(paged, PREFILL_REPEATS, warmup=1, device=device))
    # Contiguous [1, heads, tokens, head_size]: the same K/V values, gathered once, untimed.
    flat = tables[0].long()
    k = caches[0, 0][flat].reshape(-1, model.num_kv_heads, model.head_size)[:length]
    v = caches[0, 1][flat].reshape(-1, model.num_kv_heads, model.head_size)[:length]
    q4 = query.transpose(0, 1).unsqueeze(0).contiguous()
    k4 = k.transpose(0, 1).unsqueeze(0).contiguous()
    v4 = v.transpose(0, 1).unsqueeze(0).contiguous()
    sdpa = _sdpa_times(q4, k4, v4, device)
    timed = {name: ms for name, ms in sdpa.items() if isinstance(ms, float)}
    best_name = min(timed, key=timed.get) if timed else None
    flops = 4 * model.num_heads * model.head_size * causal_pairs(length)
    result = {"name": f"prefill {length}", "tokens": length, "flops": flops,
              "paged_ms": ours_ms, "paged_tflops": flops / ours_ms / 1e9, "sdpa_ms": sdpa,
              "sdpa_best_backend": best_name}
    if best_name is not None:
        result["sdpa_best_ms"] = timed[best_name]
        result["sdpa_best_tflops"] = flops / timed[best_name] / 1e9
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_attention",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="directory for attention.json")
    p.add_argument("--dry", action="store_true", help="tiny shapes on the CPU (plumbing only)")
    args = p.parse_args(argv)
    device = "cpu" if args.dry else "cuda"
    model = DRY_MODEL if args.dry else GPU_MODEL
    backend = get_kernel_backend("auto", device)
    report = StageReport(args.out / "attention.json", "attention", args.dry)
    report.set("backend", backend.name)
    report.set("model", {"heads": model.num_heads, "kv_heads": model.num_kv_heads,
                         "head_size": model.head_size, "layers": model.num_layers,
                         "block_size": BLOCK_SIZE, "dtype": "bfloat16"})
    dtype = torch.bfloat16
    for name, seq_lens in DRY_DECODE_SHAPES if args.dry else DECODE_SHAPES:
        try:
            row = decode_case(backend, model, name, seq_lens, device, dtype)
            log(f"{name}: {row['median_ms']:.3f} ms for {row['layers']} layers, "
                f"{row['gb_per_s']:.0f} GB/s (splits {row['num_kv_splits']})")
        except Exception as error:  # the next shape may still run
            row = failure({"name": name, "layers": model.num_layers}, error)
        report.append("decode", row)
        _release(device)
    for length in DRY_PREFILL_LENGTHS if args.dry else PREFILL_LENGTHS:
        try:
            row = prefill_case(backend, model, length, device, dtype)
            log(f"prefill {length}: paged {row['paged_tflops']:.1f} TFLOP/s, SDPA best "
                f"{row.get('sdpa_best_tflops', float('nan')):.1f} "
                f"({row['sdpa_best_backend']}); all: {row['sdpa_ms']}")
        except Exception as error:
            row = failure({"name": f"prefill {length}", "tokens": length}, error)
        report.append("prefill", row)
        _release(device)
    report.done()


def _release(device: str) -> None:
    """The last case's tensors back to the device before the next allocates its own."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
