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
- A prompt chunk of 256 new tokens after 30,720 cached (few query tiles over a long context),
  with and without the split policy (not a target; the figure the policy is for).
- Prefill: one sequence of 8,192 and of 32,768 new tokens, causal, through the paged kernel;
  against torch SDPA with is_causal=True on contiguous K/V (the FlashAttention-class
  baseline: no mask tensor, which would rule out the flash and cuDNN backends), on each
  backend that runs, the best taken. Both in TFLOP/s of the same causal count.
Times are medians of CUDA-event timings (the limits they are read against are best-of).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

from bench.gpu_common import StageReport, causal_pairs, failure, log, median, time_ms
from bench.kernels import GPU_MODEL, ModelShape
from kernels import get_kernel_backend
from kernels.attention_splits import (
    NO_SPLITS,
    PROGRAMS_PER_SM,
    KVSplitPolicy,
    decode_tile_n,
    default_split_policy,
    plan_splits,
)
from kernels.attention_tiles import prefill_candidates

BLOCK_SIZE = 16
DECODE_SHAPES = (
    ("decode 1x8192", [8192]),
    ("decode 8x2048", [2048] * 8),
    ("decode 64x1024", [1024] * 64),
    ("decode 256x512", [512] * 256),
    ("decode skewed 1x32768+63x512", [32768] + [512] * 63),
)
PREFILL_LENGTHS = (8192, 32768)
CHUNK_SHAPE = (256, 30720)  # a prompt chunk of 256 new tokens after 30,720 cached
DRY_CHUNK_SHAPE = (16, 240)
DRY_MODEL = ModelShape(num_heads=4, num_kv_heads=2, head_size=16, num_layers=2)
DRY_DECODE_SHAPES = (("decode 2x64", [64] * 2), ("decode skewed 1x256+3x32", [256] + [32] * 3))
DRY_PREFILL_LENGTHS = (64, 128)
DECODE_REPEATS = 10
PROGRAMS_PER_SM_SWEEP = (2, 4, 8)  # the split policy's target, besides the engine's own
DRY_SMS = 2  # the dry run's stand-in SM count (its Triton kernels run interpreted)
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
    """The decode shape through the engine's split policy (per sequence, chosen on the device
    from the lengths) and, on Triton, through the uniform split count the kernel used before
    (one count for every sequence, from the widest table: `old_uniform_splits`) and the policy
    at other program targets. Each variant is timed as its own graph over the same caches."""
    layers = model.num_layers
    caches, tables, seq_lens_t = _paged_kv(model, layers, seq_lens, device, dtype)
    n = len(seq_lens)
    qsl = torch.arange(n + 1, dtype=torch.int32, device=device)
    query = torch.randn(n, model.num_heads, model.head_size, device=device, dtype=dtype)
    scale = model.head_size**-0.5
    elem = torch.empty((), dtype=dtype).element_size()
    kv_bytes = 2 * sum(seq_lens) * model.num_kv_heads * model.head_size * elem
    qo_bytes = 2 * n * model.num_heads * model.head_size * elem
    nbytes = layers * (kv_bytes + qo_bytes)

    def timed(**kwargs) -> list[float]:
        def all_layers() -> None:
            for layer in range(layers):
                backend.paged_attention(query, caches[layer, 0], caches[layer, 1], tables,
                                        seq_lens_t, qsl, scale, **kwargs)

        all_layers()  # compiles the variant outside the capture
        if device != "cuda":
            return time_ms(all_layers, DECODE_REPEATS, warmup=1, device=device)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            all_layers()
        times = time_ms(graph.replay, DECODE_REPEATS, warmup=2, device=device)
        del graph
        return times

    triton = backend.name == "triton"
    policy = _policy(device, model) if triton else None
    times = timed(**({"kv_splits": policy} if triton else {}))
    ms = median(times)
    row = {"name": name, "num_seqs": n, "context_tokens": sum(seq_lens),
           "max_context": max(seq_lens), "layers": layers, "cuda_graph": device == "cuda",
           "num_kv_splits": None, "times_ms": times, "median_ms": ms, "bytes": nbytes,
           "gb_per_s": nbytes / ms / 1e6}
    if not triton:
        return row
    tile_n = decode_tile_n(BLOCK_SIZE)
    splits = plan_splits(policy, seq_lens, model.num_kv_heads, tile_n)
    row["num_kv_splits"] = _describe_splits(splits)
    row["split_policy"] = {"target_programs": policy.target_programs,
                           "max_splits": policy.max_splits,
                           "min_keys_per_split": policy.min_keys_per_split}
    old = old_uniform_splits(n, model.num_kv_heads, tables.shape[1] * BLOCK_SIZE,
                             _num_sms(device))
    old_policy = NO_SPLITS if old == 1 else KVSplitPolicy(
        target_programs=1, max_splits=old,
        keys_per_split=-(-tables.shape[1] * BLOCK_SIZE // old))
    old_ms = median(timed(kv_splits=old_policy))
    row.update(old_uniform_splits=old, old_median_ms=old_ms, old_gb_per_s=nbytes / old_ms / 1e6)
    sweep = {}
    for per_sm in PROGRAMS_PER_SM_SWEEP:
        other = dataclasses.replace(policy, target_programs=per_sm * _num_sms(device))
        if other != policy:
            sweep[per_sm] = round(nbytes / median(timed(kv_splits=other)) / 1e6, 1)
    row["gb_per_s_by_programs_per_sm"] = sweep
    return row


def old_uniform_splits(num_seqs: int, num_kv_heads: int, max_context_bound: int,
                       num_sms: int) -> int:
    """The split count the kernel used before splits per sequence (its kv_splits_for, gone
    with kernels/attention_splits.py): one count for every sequence, doubled while the grid
    had under two programs per SM and each split of the widest table kept 256 keys, at most
    16."""
    programs, splits = max(1, num_seqs * num_kv_heads), 1
    while splits < 16 and programs * splits <= num_sms and \
            max_context_bound // (splits * 2) >= 256:
        splits *= 2
    return splits


def _describe_splits(splits: list[int]) -> str:
    """'33 + 63x1': each distinct count with how many sequences have it, largest first."""
    counts = Counter(splits)
    return " + ".join(f"{c}x{s}" if c > 1 else f"{s}" for s, c in
                      sorted(counts.items(), reverse=True))


def _num_sms(device: str) -> int:
    if device != "cuda":
        return DRY_SMS
    return torch.cuda.get_device_properties(0).multi_processor_count


def _policy(device: str, model: ModelShape) -> KVSplitPolicy:
    """The engine's policy on the GPU; in the dry run one that splits the tiny shapes."""
    if device == "cuda":
        return default_split_policy(torch.device(device))
    return KVSplitPolicy(target_programs=PROGRAMS_PER_SM * DRY_SMS, min_keys_per_split=32)


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


def prefill_case(backend, model: ModelShape, length: int, device: str, dtype: torch.dtype,
                 tile_shapes: list) -> dict:
    """One layer's call (a prefill chunk is tens of ms: graphs and L2 do not matter), in each
    of tile_shapes (Triton; the first is the default) or the backend's own (others)."""
    caches, tables, seq_lens_t = _paged_kv(model, 1, [length], device, dtype)
    qsl = torch.tensor([0, length], dtype=torch.int32, device=device)
    query = torch.randn(length, model.num_heads, model.head_size, device=device, dtype=dtype)
    scale = model.head_size**-0.5

    by_tiles: dict[str, float | str] = {}
    for tiles in tile_shapes or [None]:
        def paged(tiles=tiles) -> None:
            extra = {} if tiles is None else {"prefill_tiles": tiles}
            backend.paged_attention(query, caches[0, 0], caches[0, 1], tables, seq_lens_t, qsl,
                                    scale, **extra)

        key = "default" if tiles is None else tiles.describe()
        try:
            by_tiles[key] = median(time_ms(paged, PREFILL_REPEATS, warmup=1, device=device))
        except Exception as error:  # a shape this GPU cannot run
            by_tiles[key] = f"failed: {str(error).splitlines()[0][:160]}"
    timed_tiles = {k: v for k, v in by_tiles.items() if isinstance(v, float)}
    best_tiles = min(timed_tiles, key=timed_tiles.get)
    ours_ms = timed_tiles[best_tiles]
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
    first = next(iter(by_tiles))
    result = {"name": f"prefill {length}", "tokens": length, "flops": flops,
              "paged_ms": ours_ms, "paged_tflops": flops / ours_ms / 1e9,
              "paged_tiles": best_tiles, "paged_ms_by_tiles": by_tiles,
              "paged_default_tflops": (flops / by_tiles[first] / 1e9
                                       if isinstance(by_tiles[first], float) else None),
              "sdpa_ms": sdpa, "sdpa_best_backend": best_name}
    if best_name is not None:
        result["sdpa_best_ms"] = timed[best_name]
        result["sdpa_best_tflops"] = flops / timed[best_name] / 1e9
    return result


def chunk_case(backend, model: ModelShape, new: int, cached: int, device: str,
               dtype: torch.dtype) -> dict:
    """A short prompt chunk at a long position (few query tiles): with the engine's split
    policy (the chunk's tiles split their keys when the grid is small) and without (Triton;
    other backends once). One layer's call, in TFLOP/s and in K/V bytes read / time."""
    caches, tables, seq_lens_t = _paged_kv(model, 1, [cached + new], device, dtype)
    qsl = torch.tensor([0, new], dtype=torch.int32, device=device)
    query = torch.randn(new, model.num_heads, model.head_size, device=device, dtype=dtype)
    flops = 4 * model.num_heads * model.head_size * causal_pairs(new, cached)
    elem = torch.empty((), dtype=dtype).element_size()
    nbytes = 2 * (cached + new) * model.num_kv_heads * model.head_size * elem
    policies = {"default": None}
    if backend.name == "triton":
        policies = {"split": _policy(device, model), "unsplit": NO_SPLITS}
    row = {"name": f"chunk {new} at {cached}", "new_tokens": new, "cached_tokens": cached,
           "flops": flops, "bytes": nbytes}
    for label, policy in policies.items():
        extra = {} if policy is None else {"kv_splits": policy}

        def call(extra=extra) -> None:
            backend.paged_attention(query, caches[0, 0], caches[0, 1], tables, seq_lens_t, qsl,
                                    model.head_size**-0.5, **extra)

        ms = median(time_ms(call, PREFILL_REPEATS, warmup=1, device=device))
        row[label] = {"ms": ms, "tflops": flops / ms / 1e9, "gb_per_s": nbytes / ms / 1e6}
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_attention",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="directory for attention.json")
    p.add_argument("--dry", action="store_true", help="tiny shapes on the CPU (plumbing only)")
    p.add_argument("--backend", default="auto", choices=("auto", "triton"),
                   help="kernel backend (triton with --dry: the Triton paths, interpreted)")
    args = p.parse_args(argv)
    device = "cpu" if args.dry else "cuda"
    model = DRY_MODEL if args.dry else GPU_MODEL
    backend = get_kernel_backend(args.backend, device)
    report = StageReport(args.out / "attention.json", "attention", args.dry)
    report.set("backend", backend.name)
    report.set("model", {"heads": model.num_heads, "kv_heads": model.num_kv_heads,
                         "head_size": model.head_size, "layers": model.num_layers,
                         "block_size": BLOCK_SIZE, "dtype": "bfloat16"})
    dtype = torch.bfloat16
    for name, seq_lens in DRY_DECODE_SHAPES if args.dry else DECODE_SHAPES:
        try:
            row = decode_case(backend, model, name, seq_lens, device, dtype)
            old = (f"; uniform {row['old_uniform_splits']} splits (before): "
                   f"{row['old_gb_per_s']:.0f} GB/s; by programs/SM "
                   f"{row['gb_per_s_by_programs_per_sm']}" if "old_gb_per_s" in row else "")
            log(f"{name}: {row['median_ms']:.3f} ms for {row['layers']} layers, "
                f"{row['gb_per_s']:.0f} GB/s (splits {row['num_kv_splits']}){old}")
        except Exception as error:  # the next shape may still run
            row = failure({"name": name, "layers": model.num_layers}, error)
        report.append("decode", row)
        _release(device)
    # Triton: every tile shape a warm-up would time on the first length, then the default and
    # the fastest of those on the others (the engine's warm-up picks on 2,048 tokens).
    shapes = []
    if backend.name == "triton":
        head_pad = max(16, 1 << (model.head_size - 1).bit_length())
        shapes = prefill_candidates(dtype, head_pad, BLOCK_SIZE,
                                    model.num_heads // model.num_kv_heads,
                                    torch.cuda.get_device_capability()[0] if not args.dry
                                    else 9)
    for length in DRY_PREFILL_LENGTHS if args.dry else PREFILL_LENGTHS:
        try:
            row = prefill_case(backend, model, length, device, dtype, shapes)
            log(f"prefill {length}: paged {row['paged_tflops']:.1f} TFLOP/s "
                f"({row['paged_tiles']}; default tiles "
                f"{row.get('paged_default_tflops') or float('nan'):.1f}), SDPA best "
                f"{row.get('sdpa_best_tflops', float('nan')):.1f} "
                f"({row['sdpa_best_backend']}); all: {row['sdpa_ms']}; ours by tiles (ms): "
                f"{row['paged_ms_by_tiles']}")
            if shapes:
                best = next(t for t in shapes if t.describe() == row["paged_tiles"])
                shapes = list(dict.fromkeys([shapes[0], best]))
        except Exception as error:
            row = failure({"name": f"prefill {length}", "tokens": length}, error)
        report.append("prefill", row)
        _release(device)
    new, cached = DRY_CHUNK_SHAPE if args.dry else CHUNK_SHAPE
    try:
        row = chunk_case(backend, model, new, cached, device, dtype)
        log(f"{row['name']}: " + "; ".join(
            f"{label} {row[label]['tflops']:.1f} TFLOP/s, {row[label]['gb_per_s']:.0f} GB/s"
            for label in ("split", "unsplit", "default") if label in row))
    except Exception as error:
        row = failure({"name": f"chunk {new} at {cached}"}, error)
    report.append("chunk", row)
    report.done()


def _release(device: str) -> None:
    """The last case's tensors back to the device before the next allocates its own."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
