"""What the GPU check's stages (bench/gpu_check.sh) share: the card's spec sheet, one timer,
the byte and FLOP counts of a Llama-shaped forward, and stage JSON written as it grows.

Kept free of heavy imports at module level (torch is imported inside the functions that time
something), so bench/gpu_summary.py and the tests can use the counting without torch.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# The engine settings of every engine the check starts (the decode stage's offline engine and
# the served one), so the offline and gRPC figures come from the same configuration. 4,096
# tokens a step lets a 2,048-token chunk ride with 64 decodes in one step (the mixed step),
# which the default 2,048 would cut to 1,984.
ENGINE_SETTINGS = {"max_num_batched_tokens": 4096, "max_num_seqs": 256}

# The fixed workload of the peer and serving comparisons: 64 requests, seeded prompt lengths
# uniform in 128-1,024, 256 output tokens each, forced (ignore_eos).
FIXED_WORKLOAD = {"num_requests": 64, "min_input": 128, "max_input": 1024, "output_len": 256,
                  "seed": 0}
DRY_WORKLOAD = {"num_requests": 8, "min_input": 8, "max_input": 32, "output_len": 8, "seed": 0}


@dataclass(frozen=True, slots=True)
class CardSpec:
    """The vendor's figures: what each measured limit is also read against."""

    name: str
    read_gb_per_s: float  # HBM bandwidth, GB/s (1e9 bytes)
    bf16_tflops: float  # dense bf16 tensor-core peak, no sparsity


# Most specific first: "H100" alone is the SXM5 part ("NVIDIA H100 80GB HBM3" in torch).
CARD_SPECS = (
    ("H200 NVL", CardSpec("H200 NVL", 4800, 835)),
    ("H200", CardSpec("H200 SXM", 4800, 989)),
    ("H100 NVL", CardSpec("H100 NVL", 3900, 835)),
    ("H100 PCIe", CardSpec("H100 PCIe", 2000, 756)),
    ("H100", CardSpec("H100 SXM5", 3350, 989)),
    ("A100-SXM4-80GB", CardSpec("A100 SXM4 80GB", 2039, 312)),
    ("A100", CardSpec("A100 40GB", 1555, 312)),
)


def card_spec(device_name: str) -> CardSpec | None:
    for fragment, spec in CARD_SPECS:
        if fragment.lower() in device_name.lower():
            return spec
    return None


def device_slug(device_name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100-80gb-hbm3': the folder under bench/results/gpu/."""
    name = re.sub(r"^nvidia\s+", "", device_name.strip(), flags=re.IGNORECASE)
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


@dataclass(frozen=True, slots=True)
class DecoderShape:
    """A Llama-family decoder's sizes, from its config.json."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    dtype_bytes: int = 2

    @classmethod
    def from_config(cls, config: dict, dtype_bytes: int = 2) -> DecoderShape:
        heads = config["num_attention_heads"]
        return cls(
            hidden=config["hidden_size"],
            intermediate=config["intermediate_size"],
            layers=config["num_hidden_layers"],
            heads=heads,
            kv_heads=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            vocab=config["vocab_size"],
            tied=bool(config.get("tie_word_embeddings", False)),
            dtype_bytes=dtype_bytes,
        )

    @property
    def layer_linear_params(self) -> int:
        """q, k, v, o, gate, up, down of one layer."""
        qkv = self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
        o = self.heads * self.head_dim * self.hidden
        return qkv + o + 3 * self.hidden * self.intermediate

    @property
    def lm_head_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def num_params(self) -> int:
        """Every parameter, tied embeddings once (what HF counts)."""
        embed = 0 if self.tied else self.vocab * self.hidden
        norms = (2 * self.layers + 1) * self.hidden
        return self.layers * self.layer_linear_params + norms + self.lm_head_params + embed

    @property
    def weight_bytes_read(self) -> int:
        """Bytes a forward must read of the weights: every layer, the norms, the LM head. The
        input embedding is a row gather (a few KB a token), so an untied table is not read
        whole and is left out; tied, it is read once, as the LM head."""
        embed = 0 if self.tied else self.vocab * self.hidden
        return (self.num_params - embed) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token in every layer."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def forward_flops(self, num_tokens: int, sample_rows: int, attention_pairs: float) -> float:
        """Multiply-adds x 2 of one forward: every token through every layer's linears, the LM
        head for the rows that sample, and QK^T plus PV over `attention_pairs` (query, key)
        pairs per layer and head."""
        linears = 2 * self.layers * self.layer_linear_params * num_tokens
        head = 2 * self.lm_head_params * sample_rows
        attention = 4 * self.layers * self.heads * self.head_dim * attention_pairs
        return linears + head + attention


def causal_pairs(num_new: int, num_cached: int = 0) -> int:
    """(query, key) pairs of `num_new` tokens appended after `num_cached` under a causal mask."""
    return num_new * num_cached + num_new * (num_new + 1) // 2


def time_ms(fn: Callable[[], object], repeats: int, warmup: int = 1,
            device: str = "cuda") -> list[float]:
    """Milliseconds of each of `repeats` calls after `warmup` untimed ones. On CUDA each call
    is bracketed by CUDA events (the device's time, not the host's launch time); on the CPU
    (dry runs) by perf_counter."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    if device == "cuda":
        torch.cuda.synchronize()
        for _ in range(repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return times
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def finite(value):
    """JSON has no NaN or infinity: None in their place, recursively."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


class StageReport:
    """One stage's JSON, rewritten (atomically) after every measurement, so a stage stopped
    by its time limit still leaves what it measured before."""

    def __init__(self, path: Path, stage: str, dry: bool) -> None:
        self.path = Path(path)
        self.data: dict = {"stage": stage, "dry": dry, "complete": False}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.write()

    def set(self, key: str, value) -> None:
        self.data[key] = value
        self.write()

    def append(self, key: str, value) -> None:
        self.data.setdefault(key, []).append(value)
        self.write()

    def done(self) -> None:
        self.set("complete", True)

    def write(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(finite(self.data), indent=2) + "\n")
        os.replace(tmp, self.path)


def failure(row: dict, error: BaseException) -> dict:
    """`row` (what names the measurement) with the error that stopped it; the traceback is
    printed, and the stage goes on to its next measurement."""
    import traceback

    traceback.print_exc()
    return {**row, "error": f"{type(error).__name__}: {str(error).strip()[:300]}"}


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)
