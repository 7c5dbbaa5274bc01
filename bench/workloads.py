"""Benchmark workloads, generated offline from a seed: token-id prompts with fixed output lengths.

Prompts are random token ids (no dataset download, no tokenizer round trip), so every peer sees
exactly the same input lengths; outputs are forced to their target length (`ignore_eos`), so
every peer does exactly the same work.

Length distributions follow what the PagedAttention paper (Kwon et al., SOSP 2023, Fig. 11)
reports for its traces: ShareGPT has long, heavy-tailed conversations (mean input ~161 tokens,
mean output ~338), Alpaca short instructions (mean input ~19, output ~58). We draw from
log-normals with those means and clip to the context we serve.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

# Token ids drawn for prompts: above SmolLM2's special tokens (0..16), inside every Llama-family
# vocabulary we bench with (49152 for SmolLM2 and the tiny test models).
TOKEN_ID_LOW = 100
TOKEN_ID_HIGH = 32000

SHAREGPT_MEAN_INPUT = 161.3
SHAREGPT_MEAN_OUTPUT = 338.0
ALPACA_MEAN_INPUT = 19.3
ALPACA_MEAN_OUTPUT = 58.5
# Spread of the log-normals (sigma of log length); heavy tails like the traces' histograms.
SHAREGPT_SIGMA = 0.9
ALPACA_SIGMA = 0.6


@dataclass(frozen=True, slots=True)
class BenchRequest:
    prompt_token_ids: tuple[int, ...]
    output_len: int
    cache_salt: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    seed: int
    requests: tuple[BenchRequest, ...]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(TOKEN_ID_LOW, TOKEN_ID_HIGH) for _ in range(n))


def _lognormal_len(rng: random.Random, mean: float, sigma: float, low: int, high: int) -> int:
    # mu chosen so the (unclipped) mean is `mean`: E[X] = exp(mu + sigma^2 / 2).
    mu = math.log(mean) - sigma * sigma / 2
    return max(low, min(high, round(rng.lognormvariate(mu, sigma))))


def fixed_random(
    num_requests: int, min_input: int, max_input: int, output_len: int, seed: int = 0
) -> Workload:
    """Uniform input lengths in [min_input, max_input], one output length for all."""
    rng = random.Random(seed)
    requests = tuple(
        BenchRequest(_tokens(rng, rng.randint(min_input, max_input)), output_len)
        for _ in range(num_requests)
    )
    return Workload(f"fixed_random_{min_input}-{max_input}x{output_len}", seed, requests)


def sharegpt_like(
    num_requests: int, max_model_len: int = 2048, seed: int = 0, scale: float = 1.0
) -> Workload:
    """ShareGPT-shaped lengths; `scale` < 1 shrinks both means for a CPU-sized run."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        prompt_len = _lognormal_len(
            rng, SHAREGPT_MEAN_INPUT * scale, SHAREGPT_SIGMA, 4, max_model_len // 2
        )
        output_len = _lognormal_len(
            rng, SHAREGPT_MEAN_OUTPUT * scale, SHAREGPT_SIGMA, 4, max_model_len - prompt_len
        )
        requests.append(BenchRequest(_tokens(rng, prompt_len), output_len))
    return Workload("sharegpt_like", seed, tuple(requests))


def alpaca_like(num_requests: int, max_model_len: int = 2048, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        prompt_len = _lognormal_len(rng, ALPACA_MEAN_INPUT, ALPACA_SIGMA, 4, max_model_len // 2)
        output_len = _lognormal_len(
            rng, ALPACA_MEAN_OUTPUT, ALPACA_SIGMA, 4, max_model_len - prompt_len
        )
        requests.append(BenchRequest(_tokens(rng, prompt_len), output_len))
    return Workload("alpaca_like", seed, tuple(requests))


def shared_prefix(
    num_tenants: int,
    requests_per_tenant: int,
    system_prompt_len: int = 1024,
    user_len: tuple[int, int] = (16, 48),
    output_len: int = 16,
    seed: int = 0,
    grouped: bool = False,
) -> Workload:
    """One long system prompt followed by short user turns. Every tenant uses the same system
    prompt but its own cache_salt, so tenants never share blocks with each other (isolation)
    while requests of one tenant do. Requests interleave tenants in arrival order, or come
    tenant by tenant when `grouped` (the same requests)."""
    rng = random.Random(seed)
    system = _tokens(rng, system_prompt_len)
    requests = []
    for _ in range(requests_per_tenant):
        for tenant in range(num_tenants):
            user = _tokens(rng, rng.randint(*user_len))
            requests.append(BenchRequest(system + user, output_len, cache_salt=f"tenant-{tenant}"))
    name = f"shared_prefix_{num_tenants}x{requests_per_tenant}"
    if grouped:
        requests.sort(key=lambda r: int(r.cache_salt.removeprefix("tenant-")))  # stable
        name += "_grouped"
    return Workload(name, seed, tuple(requests))


def zipf_weights(num_items: int, s: float) -> list[float]:
    """Zipf popularity of items 1..n: weight of rank k proportional to k^-s, summing to 1."""
    if num_items < 1 or s < 0:
        raise ValueError(f"zipf_weights needs num_items >= 1 and s >= 0, got {num_items}, {s}")
    raw = [1.0 / (k + 1) ** s for k in range(num_items)]
    total = sum(raw)
    return [w / total for w in raw]


def multi_tenant(
    num_tenants: int,
    num_requests: int,
    system_prompt_len: int,
    user_len: int,
    output_len: int,
    zipf_s: float = 1.1,
    hot_share: float | None = None,
    seed: int = 0,
) -> Workload:
    """Tenants with distinct long system prompts, each request one tenant's system prompt + a
    unique user turn; tenants drawn by Zipf popularity (tenant 0 the most popular). `hot_share`:
    tenant 0 takes that share of the requests and the rest are Zipf over the others. The tenant
    is the request's cache_salt, `tenant-<k>`, as a multi-tenant deployment would salt it."""
    if hot_share is not None and not 0 < hot_share < 1:
        raise ValueError(f"hot_share must be in (0, 1) or None, got {hot_share}")
    rng = random.Random(seed)
    systems = [_tokens(rng, system_prompt_len) for _ in range(num_tenants)]
    if hot_share is None:
        weights = zipf_weights(num_tenants, zipf_s)
    else:
        weights = [hot_share] + [(1 - hot_share) * w
                                 for w in zipf_weights(num_tenants - 1, zipf_s)]
    tenants = rng.choices(range(num_tenants), weights, k=num_requests)
    requests = tuple(
        BenchRequest(systems[t] + _tokens(rng, user_len), output_len, cache_salt=f"tenant-{t}")
        for t in tenants
    )
    shape = f"hot{round(100 * hot_share)}" if hot_share is not None else f"zipf{zipf_s:g}"
    return Workload(f"multi_tenant_{num_tenants}x{system_prompt_len}_{shape}", seed, requests)


def poisson_arrivals(num_requests: int, rate: float, seed: int = 0) -> list[float]:
    """Arrival offsets in seconds for an open-loop Poisson process; rate inf = all at t=0."""
    if math.isinf(rate):
        return [0.0] * num_requests
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s (or inf), got {rate}")
    rng = random.Random(seed + 1_000_003)  # independent of the length draws
    t = 0.0
    offsets = []
    for _ in range(num_requests):
        t += rng.expovariate(rate)
        offsets.append(t)
    return offsets
