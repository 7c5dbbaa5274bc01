"""One rank's place in a tensor-parallel group: what it holds and how it talks to the rest."""

from dataclasses import dataclass

from engine_service.model.parallel.group import TensorParallelGroup
from engine_service.model.parallel.shard import TensorShard


@dataclass(frozen=True, slots=True)
class RankOf:
    shard: TensorShard
    group: TensorParallelGroup


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What rank 0 hands every worker through the rendezvous store (pickled)."""

    engine_config: object  # core.config.EngineConfig (the engine's, as given)
    max_model_len: int
    timeout_s: float  # the compute group's collective timeout
    threads: int  # torch threads per rank on the CPU
