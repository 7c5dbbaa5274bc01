"""pagedgen's generation engine: `from engine_service import LLM, SamplingParams`."""

from engine_service.llm import LLM
from engine_service.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
