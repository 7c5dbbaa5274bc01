"""pagedgen's generation engine: `from engine_service import LLM, SamplingParams` (and
`BeamSearchParams` for `LLM.beam_search`).

Imported lazily, so light entry points (pagedgen-prepare-model) do not pay for torch.
"""

__all__ = ["LLM", "BeamSearchParams", "SamplingParams"]


def __getattr__(name: str):
    if name == "LLM":
        from engine_service.llm import LLM

        return LLM
    if name == "SamplingParams":
        from engine_service.model.sampling_params import SamplingParams

        return SamplingParams
    if name == "BeamSearchParams":
        from engine_service.model.beam_search_params import BeamSearchParams

        return BeamSearchParams
    raise AttributeError(f"module 'engine_service' has no attribute {name!r}")
