"""What every section of pagedgen-bench shares: the run's settings (RunContext), its sizes, the
workloads built from them, the engine launch, and the progress log.

Sections (bench/sections/*.py) take a RunContext and import nothing from the command line."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from bench.workloads import Workload, fixed_random, shared_prefix, sharegpt_like

# Peer names carry the dtype as a suffix; float32 keeps the historical names.
DTYPE_SUFFIX = {"float32": "", "bfloat16": "_bf16", "float16": "_fp16"}


@dataclass(frozen=True, slots=True)
class Sizes:
    num_prompts: int  # throughput workload
    output_len: int
    batch1_prompts: int
    serving_prompts: int
    serving_scale: float  # ShareGPT-like lengths scaled down for a CPU
    prefix_tenants: int
    prefix_per_tenant: int
    prefix_system_len: int
    prefix_output_len: int
    memory_requests: int
    zero_hit_repeats: int
    pinning_repeats: int  # runs of each pinning policy, alternated


FULL = Sizes(32, 64, 4, 32, 0.2, 4, 4, 1024, 16, 300, 2, 2)
QUICK = Sizes(8, 16, 2, 8, 0.1, 2, 3, 256, 8, 100, 1, 1)


@dataclass(frozen=True, slots=True)
class RunContext:
    """One run's settings, as every section reads them."""

    model: str  # a local HF directory
    quick: bool = False
    seed: int = 0
    rate: float = 2.0  # Poisson rate of the serving run
    dtypes: tuple[str, ...] = ("float32",)
    skip: frozenset[str] = field(default_factory=frozenset)  # parts not taken
    router_shape: object = None  # a bench.router.RouterShape, or None for the default one

    @property
    def sizes(self) -> Sizes:
        return QUICK if self.quick else FULL

    def takes(self, part: str) -> bool:
        return part not in self.skip

    def make_engine(self, **overrides):
        """An in-process engine on the run's model. The prefix, memory and index sections
        compare configurations of one dtype: the run's first."""
        from engine_service import LLM

        overrides.setdefault("dtype", self.dtypes[0])
        return LLM(model=self.model, **overrides).llm_engine

    # The workloads, the same for a seed in every section that uses them.
    def throughput_workload(self) -> Workload:
        return fixed_random(self.sizes.num_prompts, 16, 200, self.sizes.output_len, self.seed)

    def batch1_workload(self) -> Workload:
        return fixed_random(self.sizes.batch1_prompts, 16, 200, self.sizes.output_len,
                            self.seed + 1)

    def serving_workload(self) -> Workload:
        return sharegpt_like(self.sizes.serving_prompts, 2048, self.seed + 2,
                             scale=self.sizes.serving_scale)

    def shared_prefix_workload(self, grouped: bool = False) -> Workload:
        s = self.sizes
        return shared_prefix(s.prefix_tenants, s.prefix_per_tenant, s.prefix_system_len,
                             output_len=s.prefix_output_len, seed=self.seed + 3, grouped=grouped)


def log(msg: str) -> None:
    load = os.getloadavg()[0]
    print(f"[bench {time.strftime('%H:%M:%S')} load {load:.2f}] {msg}", flush=True)


def workload_info(w: Workload) -> dict:
    return {
        "name": w.name,
        "seed": w.seed,
        "num_requests": len(w.requests),
        "num_prompt_tokens": w.num_prompt_tokens,
        "num_output_tokens": w.num_output_tokens,
    }


def machine(meta: dict) -> dict:
    """The part of a run's metadata that names the machine and software."""
    return {k: meta.get(k) for k in ("model", "cpu", "num_cpus", "versions")}
