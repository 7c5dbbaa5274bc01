"""What the engine publishes each step (LLMEngine.snapshot), as plain data.

Its own module, without torch: the serving front receives it from the engine core's process
every step and builds metrics and EngineStats replies from it, and runs no model.
"""

from dataclasses import dataclass


@dataclass(slots=True)
class EngineStats:
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    kv_cache_usage: float  # fraction of blocks held by running sequences
    num_running: int
    num_waiting: int
    num_swapped: int
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # of those, served from the cache
    num_preemptions: int
    num_steps: int
    num_pinned_blocks: int = 0  # idle blocks the prefix policy keeps from eviction
    pin_budget_blocks: int = 0  # blocks pins may hold now (core/pin_budget.py)
    num_pinned_in_budget: int = 0  # pinned blocks, idle or in use (what the budget counts)
    num_pins_released: int = 0  # pinned blocks unpinned so a lone request could run
    num_waiting_prefill_tokens: int = 0  # prompt tokens not computed yet (waiting + running)
    num_prefill_deferrals: int = 0  # admissions put off a step for a prefix being computed
    tensor_parallel_size: int = 1  # ranks the model is split over
