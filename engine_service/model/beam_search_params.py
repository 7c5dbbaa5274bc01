"""Offline beam search parameters, vLLM's idiom: `LLM.beam_search(prompts, BeamSearchParams(...))`.

A thin front over SamplingParams (which validates everything and carries beam search through
the engine and the wire API); the defaults differ where beam search needs them to: temperature
0, and every beam returned unless `n` says fewer.
"""

from dataclasses import dataclass

from engine_service.model.sampling_params import SamplingParams


@dataclass(slots=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    n: int | None = None  # best beams returned; None: all beam_width of them, as in vLLM
    length_penalty: float = 1.0  # HF's: finished beams score cum_logprob / len ** this
    early_stopping: bool | str = False  # HF's: True, False or "never"
    ignore_eos: bool = False
    temperature: float = 0.0  # must be 0 (kept for vLLM's signature)
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self.sampling_params()  # a bad value fails here, naming its field

    def sampling_params(self) -> SamplingParams:
        n = self.n
        if n is None:
            width_ok = type(self.beam_width) is int and self.beam_width >= 1
            n = self.beam_width if width_ok else 1  # a bad beam_width is named below
        return SamplingParams(
            n=n,
            temperature=self.temperature,
            max_tokens=self.max_tokens,
            min_tokens=self.min_tokens,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            beam_width=self.beam_width,
            length_penalty=self.length_penalty,
            early_stopping=self.early_stopping,
        )
