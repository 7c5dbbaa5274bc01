"""Roofline: this machine's dense matmul FLOP/s and memory read bandwidth, measured in the same
run as the engine, and the model's work per token, so a throughput reads as a fraction of what
the hardware allows (gpt-fast's habit: every run is a roofline check).

Model cost (float32, the Llama family):
    FLOPs per token  = 2 * (weights a token multiplies) + 4 * layers * context * q_heads * head_dim
    bytes per step   = every weight matrix once (decode is a pass over the weights)
                       + each sequence's K/V read for attention
The embedding lookup reads one row, so it is not counted as a matmul; with tied embeddings the
lm_head reads the same matrix, which is counted once, as the lm_head.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.metrics import RequestRecord
from engine_service.model.huge_pages import huge_page_zeros


@dataclass(slots=True)
class MachinePeaks:
    matmul_flops: float  # FLOP/s, best of the shapes tried
    matmul_shapes: dict[str, float]  # "MxKxN" -> FLOP/s
    # bytes/s, streaming sum over a buffer far larger than the caches: the better of 4 KiB
    # and huge pages (the engine keeps its weights and KV pool on huge pages, so its batch-1
    # bound is read against what they allow)
    read_bandwidth: float
    copy_bandwidth: float  # bytes/s counted as read + write
    num_threads: int
    # bf16 matmul FLOP/s, best of the same shapes: measured when bf16 peers run (a bf16 run
    # reads against this peak, not float32's; None in results from before it was recorded)
    matmul_flops_bf16: float | None = None
    # the same read from torch's own allocation (4 KiB pages where THP is `madvise`); None in
    # results from before huge pages were measured
    read_bandwidth_small_pages: float | None = None


@dataclass(slots=True)
class ModelCost:
    num_params: int
    matmul_params: int  # weights a token multiplies (everything but the embedding lookup)
    weight_bytes_per_step: int
    kv_bytes_per_token: int  # K and V of one token, every layer
    attention_flops_per_context_token: int  # per query token, per token of context

    def flops_per_token(self, context_len: float = 0.0) -> float:
        return 2 * self.matmul_params + self.attention_flops_per_context_token * context_len


def _best_time(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _matmul_flops(shapes, dtype: torch.dtype, repeats: int) -> dict[str, float]:
    results = {}
    for m, k, n in shapes:
        a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
        seconds = _best_time(lambda a=a, b=b: torch.mm(a, b), repeats)
        results[f"{m}x{k}x{n}"] = 2 * m * k * n / seconds
    return results


def measure_peaks(quick: bool = False, bf16: bool = False) -> MachinePeaks:
    shapes = [(2048, 2048, 2048), (256, 576, 1536), (32, 576, 49152)]
    if quick:
        shapes = shapes[1:]
    repeats = 3 if quick else 7
    with torch.inference_mode():
        results = _matmul_flops(shapes, torch.float32, repeats)
        # torch's bf16 mm (oneDNN) on the same shapes: native where the CPU has bf16 matmul,
        # emulated (slower than float32) elsewhere, as the bf16 peers run.
        bf16_flops = max(_matmul_flops(shapes, torch.bfloat16, repeats).values()) if bf16 else None
        # 512 MiB (quick: 128 MiB): far beyond the last-level cache.
        numel = (32 if quick else 128) * 2**20
        buf = torch.ones(numel)
        out = torch.empty_like(buf)
        read_small = _best_time(lambda: buf.sum(), 3 if quick else 5)
        copy = _best_time(lambda: out.copy_(buf), 3 if quick else 5)
        huge = huge_page_zeros((numel,), torch.float32)
        huge.fill_(1)
        read_huge = _best_time(lambda: huge.sum(), 3 if quick else 5)
    nbytes = numel * 4
    return MachinePeaks(
        matmul_flops=max(results.values()),
        matmul_shapes=results,
        read_bandwidth=nbytes / min(read_small, read_huge),
        copy_bandwidth=2 * nbytes / copy,
        num_threads=torch.get_num_threads(),
        matmul_flops_bf16=bf16_flops,
        read_bandwidth_small_pages=nbytes / read_small,
    )


def model_cost(model_path: str, dtype_bytes: int = 4) -> ModelCost:
    from safetensors import safe_open

    from engine_service.model.config import load_model_config

    mc = load_model_config(model_path)
    num_params = 0
    embedding_params = mc.vocab_size * mc.hidden_size
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                num_params += math.prod(f.get_slice(name).get_shape())
    # Tied: the one matrix is multiplied as the lm_head. Untied: the lm_head is its own
    # matrix and the input embedding is only looked up.
    matmul_params = num_params if mc.tie_word_embeddings else num_params - embedding_params
    kv_bytes_per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * dtype_bytes
    return ModelCost(
        num_params=num_params,
        matmul_params=matmul_params,
        weight_bytes_per_step=matmul_params * dtype_bytes,
        kv_bytes_per_token=kv_bytes_per_token,
        # QK^T and PV: 2 matmuls * 2 FLOPs * q_heads * head_dim per context token per layer.
        attention_flops_per_context_token=4 * mc.num_layers * mc.num_heads * mc.head_dim,
    )


@dataclass(slots=True)
class RooflineFigures:
    compute_bound_tok_s: float  # peak FLOP/s / FLOPs per token (any batch, no attention)
    batch1_bound_tok_s: float  # read bandwidth / weight bytes per step
    achieved_flops: float
    achieved_bytes_per_s: float
    flops_fraction: float
    bandwidth_fraction: float


def achieved(
    records: list[RequestRecord],
    duration_s: float,
    num_steps: int,
    cost: ModelCost,
    peaks: MachinePeaks,
    matmul_flops: float | None = None,
) -> RooflineFigures:
    """Model FLOPs and bytes a run had to perform, over its wall time. Prompt tokens count
    with their mean causal context; output token i of a request attends prompt + i tokens.
    matmul_flops: the peak of the run's dtype (default: float32's)."""
    peak = matmul_flops or peaks.matmul_flops
    flops = 0.0
    kv_read = 0.0
    for r in records:
        computed_prompt = r.prompt_len - r.num_cached_tokens
        flops += computed_prompt * cost.flops_per_token(r.num_cached_tokens + computed_prompt / 2)
        n = len(r.token_times)
        # Output tokens fed back: n - 1 of them (the last one is never run through the model).
        mean_ctx = r.prompt_len + n / 2
        flops += max(0, n - 1) * cost.flops_per_token(mean_ctx)
        kv_read += max(0, n - 1) * mean_ctx * cost.kv_bytes_per_token
    bytes_moved = num_steps * cost.weight_bytes_per_step + kv_read
    achieved_flops = flops / duration_s
    achieved_bytes = bytes_moved / duration_s
    return RooflineFigures(
        compute_bound_tok_s=peak / cost.flops_per_token(),
        batch1_bound_tok_s=peaks.read_bandwidth / cost.weight_bytes_per_step,
        achieved_flops=achieved_flops,
        achieved_bytes_per_s=achieved_bytes,
        flops_fraction=achieved_flops / peak,
        bandwidth_fraction=achieved_bytes / peaks.read_bandwidth,
    )
