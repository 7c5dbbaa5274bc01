"""Sizes, allocates and warms up the KV pool once the weights are loaded.

Order, as in vLLM's GPU worker: the weights are already on the device; one profiling forward
at the largest step (`max_num_batched_tokens`) measures the activation peak; the pool gets what
`gpu_memory_utilization` leaves after both (engine_service/model/memory_plan.py holds the
arithmetic); then every kernel variant is compiled by a warm-up (engine_service/model/warmup.py).
An explicit size (`num_blocks`, then `kv_cache_memory`) skips the profile. On the CPU the pool
is `kv_cache_memory` or 1 GiB.
"""

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine_service.core.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig
from engine_service.model.memory_plan import (
    DEFAULT_MARGIN_BYTES,
    MemoryPlan,
    blocks_in,
    plan_kv_cache,
)
from engine_service.model.runner import ModelRunner, kv_bytes_per_block
from engine_service.model.warmup import WarmupReport, warm_up

log = logging.getLogger(__name__)


@dataclass(slots=True)
class KVCacheSetup:
    num_blocks: int
    plan: MemoryPlan | None  # None when the size was given (or on the CPU)
    warmup: WarmupReport


def profile_memory_plan(
    device: torch.device,
    utilization: float,
    block_bytes: int,
    run_profile_forward: Callable[[], int],
    margin_bytes: int = DEFAULT_MARGIN_BYTES,
    cuda_graphs: bool = False,
) -> MemoryPlan:
    """Measure the loaded model and one profiling forward with torch's CUDA memory stats,
    then plan. `run_profile_forward` runs the forward and returns the bytes of any scratch
    buffers it allocated that are not activations (the scratch KV pool).

    cuda_graphs: keep room for the CUDA graphs, captured after the pool is allocated. They
    hold one private memory pool as large as their largest forward and one logits buffer. The
    profiled forward runs max_num_batched_tokens tokens over as many sequences as a step
    can hold, each with a row of logits; no decode graph has more rows than that (the engine
    captures up to min(max_num_seqs, max_num_batched_tokens)) and no mixed-step graph more
    tokens or logits rows: its peak bounds theirs, so it is kept a second time."""
    torch.cuda.synchronize(device)
    weights_bytes = torch.cuda.memory_allocated(device)  # the loaded model (and RoPE tables)
    torch.cuda.reset_peak_memory_stats(device)
    scratch_bytes = run_profile_forward()
    torch.cuda.synchronize(device)
    peak_bytes = torch.cuda.max_memory_allocated(device)
    activation_bytes = max(0, peak_bytes - weights_bytes - scratch_bytes)
    # Blocks the profile left cached in torch's allocator would count twice below.
    torch.cuda.empty_cache()
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    # Used on the device but not by torch's allocator: CUDA context, library workspaces,
    # other processes.
    non_torch_bytes = max(0, total_bytes - free_bytes - torch.cuda.memory_reserved(device))
    plan = plan_kv_cache(
        total_bytes=total_bytes,
        utilization=utilization,
        weights_bytes=weights_bytes,
        peak_activation_bytes=activation_bytes,
        cuda_graph_bytes=activation_bytes if cuda_graphs else 0,
        non_torch_bytes=non_torch_bytes,
        block_bytes=block_bytes,
        margin_bytes=margin_bytes,
    )
    log.info("%s", plan.describe())
    return plan


def uses_cuda_graphs(config: EngineConfig, runner: ModelRunner) -> bool:
    """Steps run as CUDA graphs (decode steps, cuda_graphs.py, and steps with prefill chunks,
    mixed_graphs.py): on CUDA with the Triton kernels, unless enforce_eager. (The torch
    backend builds per-step index tensors on the host, which a graph cannot replay.)

    Not under tensor parallelism yet. The graphs' inputs do reach every rank (rank 0 sends
    the writes it made into its buffers, each worker applies them: parallel/tp_runner.py,
    tested on the CPU, where the same buffers run the forward eagerly). But a graph per rank
    would capture the forward's NCCL collectives, and that needs a communicator that can be
    captured, a host-side deadline on each replay (the process group's watchdog does not see
    a replayed all-reduce: a hung rank would hang the others) and the captures issued as
    broadcast calls in every rank's memory plan; none can be checked without two GPUs
    (bench/README.md, "Tensor parallelism on the CPU")."""
    return (runner.device.type == "cuda" and not config.enforce_eager
            and runner.kernels.name == "triton" and config.tensor_parallel_size == 1)


def graph_rows(config: EngineConfig) -> int:
    """Rows of the largest decode graph: no decode step runs more sequences than the step's
    token budget."""
    return min(config.max_num_seqs, config.max_num_batched_tokens)


def setup_kv_cache(
    runner: ModelRunner, config: EngineConfig, num_cpu_blocks: int, max_model_len: int
) -> KVCacheSetup:
    """Size the pool, allocate it in the runner, and warm up."""
    block_bytes = kv_bytes_per_block(runner.config, config.block_size, runner.dtype)
    plan = None
    if config.num_blocks is not None:
        num_blocks = config.num_blocks
    elif config.kv_cache_memory is not None:
        num_blocks = blocks_in(config.kv_cache_memory, block_bytes)
    elif runner.device.type == "cuda":
        plan = profile_memory_plan(
            runner.device,
            config.gpu_memory_utilization,
            block_bytes,
            lambda: runner.profile_run(config.max_num_batched_tokens, config.max_num_seqs),
            cuda_graphs=uses_cuda_graphs(config, runner),
        )
        num_blocks = plan.num_blocks
    else:
        num_blocks = blocks_in(DEFAULT_CPU_KV_CACHE_BYTES, block_bytes)
    runner.allocate_kv_cache(num_blocks, num_cpu_blocks)
    num_blocks = runner.kv_caches.shape[2]  # under tensor parallelism: the smallest rank's
    report = warm_up(runner, config.max_num_seqs, config.max_num_batched_tokens, max_model_len)
    return KVCacheSetup(num_blocks, plan, report)
