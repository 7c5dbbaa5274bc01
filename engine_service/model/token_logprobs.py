"""One output token's logprobs, as plain data.

Made by the sampler (engine_service/model/sampler.py) and carried in CompletionOutput; its own
module, without torch, because the engine core sends it to the serving front every step, and
the front (which runs no model) unpickles it.
"""

from dataclasses import dataclass


@dataclass(slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float  # of the sampled token, under the model's raw distribution
    top: dict[int, float]  # the `params.logprobs` most likely tokens -> logprob, plus the sampled
    rank: int = 1  # 1 + how many tokens are strictly more likely than the sampled one
