"""Start a tensor-parallel engine's ranks: the workers, the rendezvous, rank 0's shards."""

import logging
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

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


# torch's ProcessGroupNCCL features that go on using the rendezvous store once the
# communicator is made: the flight recorder's dump on a timeout or error (on by default: the
# first process group's heartbeat monitor polls the store for another rank's dump signal
# about once a second while the ranks idle, and the watchdog writes that signal on a
# failure), error propagation between ranks (its watchdog reads and writes a key per
# group), and desync debugging (TORCH_DISTRIBUTED_DEBUG=DETAIL turns it on too).
NCCL_STORE_FEATURES = ("TORCH_NCCL_DUMP_ON_TIMEOUT", "TORCH_NCCL_PROPAGATE_ERROR",
                       "TORCH_NCCL_DESYNC_DEBUG")
_OFF = ("", "0", "false", "no", "n", "off")


def nccl_store_users(env: Mapping[str, str]) -> list[str]:
    """The NCCL features `env` turns on that need the store after the start (as 'NAME=value');
    a value other than a clear 'off' counts as on, an unset one as off (TORCH_NCCL_DUMP_ON_
    TIMEOUT is on by torch's default: start_tensor_parallel asks with nccl_environment's
    value added)."""
    users = [f"{name}={env[name]}" for name in NCCL_STORE_FEATURES
             if name in env and env[name].strip().lower() not in _OFF]
    if env.get("TORCH_DISTRIBUTED_DEBUG", "").strip().upper() == "DETAIL":
        users.append("TORCH_DISTRIBUTED_DEBUG=DETAIL")
    return users


def nccl_environment(device_type: str, env: Mapping[str, str]) -> dict[str, str]:
    """What the ranks' NCCL groups are made under beyond `env`: on CUDA the flight recorder's
    dump off (TORCH_NCCL_DUMP_ON_TIMEOUT=0) unless `env` sets it. The dump signal goes
    through the store, which closes after the start; a timeout is reported by the engine
    (TensorParallelError) either way."""
    if device_type != "cuda" or "TORCH_NCCL_DUMP_ON_TIMEOUT" in env:
        return {}
    return {"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"}


@contextmanager
def environ_set(values: Mapping[str, str]) -> Iterator[None]:
    """`values` in os.environ while the block runs, then each name as it was (unset if it
    was). For rank 0's NCCL group, which reads its settings as it is made: an offline LLM
    lives in the user's process, whose own NCCL groups made later keep their defaults."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


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
    # In the workers' environment, and in rank 0's only while its group is made.
    nccl_env = nccl_environment(config.device, os.environ)
    keeps_store = (nccl_store_users({**os.environ, **nccl_env}) if config.device == "cuda"
                   else [])
    spec = WorkerSpec(config, max_model_len, config.tensor_parallel_timeout_s, threads)
    workers = Workers(spec, world_size, host, port, extra_env=nccl_env)
    try:
        workers.wait_up()
        device = torch.device("cuda:0" if config.device == "cuda" else "cpu")
        with environ_set(nccl_env):
            group = workers.connect(device, config.tensor_parallel_timeout_s)
        local = ModelRunner(
            model_config, dtype=config.dtype, device=str(device),
            kernel_backend=config.kernel_backend, block_size=config.block_size,
            max_model_len=max_model_len,
            parallel=RankOf(plan_shard(model_config, 0, world_size), group),
        )
        workers.wait_ready()
        if keeps_store:
            log.warning("tensor parallel: the rendezvous store stays open on %s:%d for the "
                        "engine's life (%s use it after the start): any local process can "
                        "fill rank 0's memory through it (docs/security.md)", host,
                        workers.store_port, ", ".join(keeps_store))
        else:
            workers.close_store()
    except BaseException:
        workers.kill()
        raise
    log.info("tensor parallel: %d ranks on %s, %d torch thread(s) each on the CPU",
             world_size, config.device, threads)
    return TensorParallelRunner(local, group, workers, config.gpu_memory_utilization)
