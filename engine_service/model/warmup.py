"""Warm-up: run every kernel variant the engine will launch once, before it serves.

On CUDA the first launch of each Triton kernel variant compiles it (seconds) and builds
Triton's launcher; a request must never wait for that, so the server goes SERVING only after
this has run (the engine calls it while it is constructed). A variant is fixed by the model's
shapes and dtype plus a few step-dependent switches: decode-only vs mixed batches (tile
height; decode splits each sequence's keys with one variant whatever the batch, see
kernels/attention_splits.py). Per-step integers are not specialized on (kernels/triton_jit.py),
so these few steps cover every launch. On CUDA with Triton the prefill tile shape is also
timed here, once per model (kernels/attention_tiles.py), and the fastest kept. On the CPU
the same steps run at small sizes: there is nothing to compile, only first-call allocations
to get done.
"""

import dataclasses
import functools
import logging
import time
from dataclasses import dataclass, field

import torch

from engine_service.model.runner import ModelRunner
from engine_service.model.step_inputs import decode_batch, prefill_batch

log = logging.getLogger(__name__)

CPU_WARMUP_TOKENS = 32  # enough for a multi-block prefill, small enough to take milliseconds
TUNE_TOKENS = 2048  # the prompt chunk prefill tiles are timed on (at most the token budget)
TUNE_REPEATS = 3


@dataclass(slots=True)
class WarmupReport:
    steps: list[str] = field(default_factory=list)  # what ran, in order
    seconds: float = 0.0
    # Triton only: compiled variants per kernel after the warm-up (all 0 in the interpreter).
    compiled_variants: dict[str, int] = field(default_factory=dict)
    # CUDA + Triton only: the prefill tile shape chosen, and each candidate's best time (ms)
    # or why it could not run.
    prefill_tiles: str = ""
    prefill_timings_ms: dict[str, float | str] = field(default_factory=dict)


@torch.inference_mode()
def warm_up(
    runner: ModelRunner, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int
) -> WarmupReport:
    """Run a mixed (prefill) step and a decode step through the runner's allocated KV pool;
    on CUDA with Triton, also a block copy and the prefill tile tuning.

    Only free blocks are written (nothing is allocated yet), and every block is written by
    its owner before anything reads it, so the pool's contents after this do not matter.
    """
    start = time.perf_counter()
    report = WarmupReport()
    bs = runner.block_size
    pool_tokens = runner.kv_caches.shape[2] * bs
    on_cuda = runner.device.type == "cuda"
    tokens = max_num_batched_tokens if on_cuda else min(max_num_batched_tokens, CPU_WARMUP_TOKENS)
    tokens = min(tokens, pool_tokens, max_model_len)
    seqs = min(max_num_seqs, tokens)
    batch = prefill_batch(tokens, seqs, bs)
    while batch.num_blocks > runner.kv_caches.shape[2]:  # partial blocks: shrink to fit
        tokens, seqs = max(1, tokens // 2), max(1, seqs // 2)
        batch = prefill_batch(tokens, seqs, bs)
    runner.run_batch(batch.inputs)
    report.steps.append(f"mixed step: {tokens} prompt tokens over {seqs} sequences")

    # Decode: as many sequences as fit in the pool with two blocks each (context bs + 1).
    decode_seqs = max(1, min(max_num_seqs, pool_tokens // (2 * bs)))
    context = min(bs + 1, max_model_len)
    runner.run_batch(decode_batch(decode_seqs, context, bs).inputs)
    report.steps.append(f"decode step: {decode_seqs} sequences of {context} tokens")

    if on_cuda and runner.kernels.name == "triton":
        report.steps += _warm_copy_blocks(runner)
        if isinstance(runner, ModelRunner):  # tensor-parallel ranks keep the default tiles
            report.steps += _tune_prefill_tiles(runner, max_num_batched_tokens, max_model_len,
                                                report)
    if on_cuda:
        torch.cuda.synchronize(runner.device)
    if runner.kernels.name == "triton":
        from kernels.triton_backend import compiled_variant_counts

        report.compiled_variants = compiled_variant_counts()
    report.seconds = time.perf_counter() - start
    log.info("warm-up done in %.2f s: %s; compiled kernel variants: %s", report.seconds,
             "; ".join(report.steps), report.compiled_variants or "none (no Triton)")
    if report.prefill_timings_ms:
        log.info("prefill tile timings (best of %d, ms): %s", TUNE_REPEATS,
                 report.prefill_timings_ms)
    return report


def _warm_copy_blocks(runner: ModelRunner) -> list[str]:
    """Copy-on-write copies run on the first fork; block 1 is free, so copy 0 -> 1."""
    runner.kernels.copy_blocks(
        runner.kv_caches, torch.tensor([[0, 1]], dtype=torch.int64, device=runner.device)
    )
    return ["copy_blocks"]


def _tune_prefill_tiles(runner: ModelRunner, max_num_batched_tokens: int, max_model_len: int,
                        report: WarmupReport) -> list[str]:
    """Time the attention kernel's prefill tile shapes (kernels/attention_tiles.py) on one
    prompt chunk of this model's heads through layer 0 of the pool, and make the fastest the
    runner's (its kernel backend's paged_attention, bound to those tiles). The graphs, captured
    after this, replay it. Timing reads the pool only, whatever it holds."""
    from kernels.attention_tiles import prefill_candidates
    from kernels.triton_attention import paged_attention

    config, bs, dev = runner.config, runner.block_size, runner.device
    pool_tokens = runner.kv_caches.shape[2] * bs
    tokens = min(TUNE_TOKENS, max_num_batched_tokens, max_model_len, pool_tokens)
    head_pad = max(16, 1 << (config.head_dim - 1).bit_length())
    candidates = prefill_candidates(runner.dtype, head_pad, bs,
                                    config.num_heads // config.num_kv_heads,
                                    torch.cuda.get_device_capability(dev)[0])
    query = torch.randn(tokens, config.num_heads, config.head_dim, dtype=runner.dtype,
                        device=dev)
    num_blocks = -(-tokens // bs)
    tables = torch.arange(num_blocks, dtype=torch.int32, device=dev).view(1, num_blocks)
    seq_lens = torch.tensor([tokens], dtype=torch.int32, device=dev)
    query_start_loc = torch.tensor([0, tokens], dtype=torch.int32, device=dev)
    key_cache, value_cache = runner.kv_caches[0, 0], runner.kv_caches[0, 1]
    scale = config.head_dim**-0.5
    timings: dict[str, float | str] = {}
    best, best_ms = candidates[0], float("inf")
    for tiles in candidates:
        def call(tiles=tiles) -> None:
            paged_attention(query, key_cache, value_cache, tables, seq_lens, query_start_loc,
                            scale, prefill_tiles=tiles)
        try:
            call()  # compiles the variant
            ms = _best_of_ms(call, TUNE_REPEATS, dev)
        except Exception as error:  # a shape this GPU cannot run (shared memory, registers)
            timings[tiles.describe()] = f"failed: {str(error).splitlines()[0][:120]}"
            continue
        timings[tiles.describe()] = round(ms, 4)
        if ms < best_ms:
            best, best_ms = tiles, ms
    runner.kernels = dataclasses.replace(
        runner.kernels, paged_attention=functools.partial(paged_attention, prefill_tiles=best))
    report.prefill_tiles = best.describe()
    report.prefill_timings_ms = timings
    return [f"prefill tiles tuned on {tokens} tokens: {best.describe()} ({best_ms:.3f} ms; "
            f"{len(candidates)} timed)"]


def _best_of_ms(call, repeats: int, device: torch.device) -> float:
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        torch.cuda.synchronize(device)
        best = min(best, start.elapsed_time(end))
    return best
