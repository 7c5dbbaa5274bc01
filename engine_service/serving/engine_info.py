"""What the serving front knows of its engine, fixed for the engine's life: ModelInfo, the checks a
request must pass, the block-hash chain. Built by the engine core and handed to the front once
(in-process, or over the core process's channel)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from engine_service.core.block_hash import BlockHasher
from engine_service.core.request_limits import RequestLimits
from engine_service.model.config import ModelConfig

if TYPE_CHECKING:  # the front imports no torch: the engine is the core's
    from engine_service.core.engine import LLMEngine


@dataclass(frozen=True, slots=True)
class EngineInfo:
    limits: RequestLimits
    model_config: ModelConfig  # the front loads its own tokenizer from it
    model_identity: str  # what block hashes are seeded with (BlockHasher.identity)
    served_model_name: str  # what clients name the model by
    eos_token_ids: tuple[int, ...]
    dtype: str
    device: str
    tensor_parallel_size: int = 1

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineInfo:
        config = engine.config
        return cls(engine.limits, engine.model_config, engine.hasher.identity,
                   config.served_model_name, tuple(sorted(engine.eos_token_ids)),
                   config.dtype, config.device, config.tensor_parallel_size)

    @property
    def hasher(self) -> BlockHasher:
        return BlockHasher.for_identity(self.model_identity, self.limits.block_size)

    # What RequestValidator reads.
    @property
    def vocab_size(self) -> int:
        return self.limits.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    def validate_request(self, prompt_token_ids: list[int], params) -> None:
        self.limits.validate(prompt_token_ids, params)
