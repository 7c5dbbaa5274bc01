"""Start a tensor-parallel engine's ranks: the workers, the rendezvous, rank 0's shards."""

import logging
import os

import torch

from engine_service.model.config import ModelConfig
from engine_service.model.parallel.rank import RankOf, WorkerSpec
from engine_service.model.parallel.shard import check_tensor_parallel, plan_shard
from engine_service.model.parallel.tp_runner import TensorParallelRunner
from engine_service.model.parallel.workers import Workers
from engine_service.model.runner import ModelRunner

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_THREADS_PER_RANK = 1  # on the CPU: N ranks of one thread each use N cores


def _env_int(name: str, default: int, low: int) -> int:
    raw = os.environ.get(name)
    if raw is None:
        return default
    if not raw.isdigit() or int(raw) < low:
        raise ValueError(f"{name} must be an int >= {low}, got {raw!r}")
    return int(raw)


def start_tensor_parallel(config, model_config: ModelConfig,
                          max_model_len: int) -> TensorParallelRunner:
    """config: the engine's EngineConfig (tensor_parallel_size > 1)."""
    world_size = config.tensor_parallel_size
    check_tensor_parallel(model_config, world_size)
    if config.device == "cuda" and torch.cuda.device_count() < world_size:
        raise ValueError(f"tensor_parallel_size must be at most the {torch.cuda.device_count()} "
                         f"visible CUDA devices, got {world_size}")
    host = os.environ.get("PAGEDGEN_TP_HOST", DEFAULT_HOST)
    port = _env_int("PAGEDGEN_TP_PORT", 0, 0)
    threads = _env_int("PAGEDGEN_TP_THREADS", DEFAULT_THREADS_PER_RANK, 1)
    if config.device == "cpu":
        torch.set_num_threads(threads)  # rank 0 is this process
    spec = WorkerSpec(config, max_model_len, config.tensor_parallel_timeout_s, threads)
    workers = Workers(spec, world_size, host, port)
    try:
        workers.wait_up()
        device = torch.device("cuda:0" if config.device == "cuda" else "cpu")
        group = workers.connect(device, config.tensor_parallel_timeout_s)
        local = ModelRunner(
            model_config, dtype=config.dtype, device=str(device),
            kernel_backend=config.kernel_backend, block_size=config.block_size,
            max_model_len=max_model_len,
            parallel=RankOf(plan_shard(model_config, 0, world_size), group),
        )
        workers.wait_ready()
        if device.type == "cpu":
            workers.close_store()
    except BaseException:
        workers.kill()
        raise
    log.info("tensor parallel: %d ranks on %s, %d torch thread(s) each on the CPU",
             world_size, config.device, threads)
    return TensorParallelRunner(local, group, workers, config.gpu_memory_utilization)
