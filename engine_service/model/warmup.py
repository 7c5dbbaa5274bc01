"""Warm-up: run every kernel variant the engine will launch once, before it serves.

On CUDA the first launch of each Triton kernel variant compiles it (seconds) and builds
Triton's launcher; a request must never wait for that, so the server goes SERVING only after
this has run (the engine calls it while it is constructed). A variant is fixed by the model's
shapes and dtype plus a few step-dependent switches: decode-only vs mixed batches (tile
height) and, for decode, the split-KV count. Per-step integers are not specialized on
(kernels/triton_jit.py), so these few steps cover every launch. On the CPU the same steps
run at small sizes: there is nothing to compile, only first-call allocations to get done.
"""

import logging
import time
from dataclasses import dataclass, field

import torch

from engine_service.model.runner import ModelRunner
from engine_service.model.step_inputs import decode_batch, prefill_batch

log = logging.getLogger(__name__)

CPU_WARMUP_TOKENS = 32  # enough for a multi-block prefill, small enough to take milliseconds


@dataclass(slots=True)
class WarmupReport:
    steps: list[str] = field(default_factory=list)  # what ran, in order
    seconds: float = 0.0
    # Triton only: compiled variants per kernel after the warm-up (all 0 in the interpreter).
    compiled_variants: dict[str, int] = field(default_factory=dict)


@torch.inference_mode()
def warm_up(
    runner: ModelRunner, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int
) -> WarmupReport:
    """Run a mixed (prefill) step, a decode step and, on CUDA with Triton, the attention
    kernel at every split count it can choose, through the runner's allocated KV pool.

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
        report.steps += _warm_attention_splits(runner, max_num_seqs, max_model_len)
    if on_cuda:
        torch.cuda.synchronize(runner.device)
    if runner.kernels.name == "triton":
        from kernels.triton_backend import compiled_variant_counts

        report.compiled_variants = compiled_variant_counts()
    report.seconds = time.perf_counter() - start
    log.info("warm-up done in %.2f s: %s; compiled kernel variants: %s", report.seconds,
             "; ".join(report.steps), report.compiled_variants or "none (no Triton)")
    return report


def _warm_attention_splits(runner: ModelRunner, max_num_seqs: int, max_model_len: int) -> list:
    """Each split-KV variant (and its combine kernel) on a one-token decode of layer 0."""
    from kernels.triton_attention import reachable_kv_splits

    config, bs = runner.config, runner.block_size
    num_sms = torch.cuda.get_device_properties(runner.device).multi_processor_count
    bound = -(-max_model_len // bs) * bs
    splits = reachable_kv_splits(max_num_seqs, config.num_kv_heads, bound, num_sms)
    batch = decode_batch(1, min(bs + 1, max_model_len), bs).inputs
    dev = runner.device
    query = torch.zeros(1, config.num_heads, config.head_dim, dtype=runner.dtype, device=dev)
    tables = torch.tensor(batch.block_tables, dtype=torch.int32, device=dev)
    seq_lens = torch.tensor(batch.seq_lens, dtype=torch.int32, device=dev)
    query_start_loc = torch.tensor(batch.query_start_loc, dtype=torch.int32, device=dev)
    key_cache, value_cache = runner.kv_caches[0, 0], runner.kv_caches[0, 1]
    for num_splits in splits:
        runner.kernels.paged_attention(
            query, key_cache, value_cache, tables, seq_lens, query_start_loc,
            config.head_dim**-0.5, num_kv_splits=num_splits,
        )
    # Copy-on-write copies run on the first fork; block 1 is free, so copy 0 -> 1.
    runner.kernels.copy_blocks(
        runner.kv_caches, torch.tensor([[0, 1]], dtype=torch.int64, device=dev)
    )
    return [f"attention at split-KV counts {splits}", "copy_blocks"]
