"""Which floating-point type the engine runs in: `dtype="auto"` resolved once, in one place.

The resolved name is what the engine loads weights and allocates the KV cache in, what
ModelInfo reports, and what seeds the block-hash identity (KV computed in bfloat16 is not the
KV computed in float32, so the two must never share prefix blocks).

Names only, without torch: the serving front validates and resolves dtypes with this module and
runs no model, so it never pays for importing torch. `DTYPES` (name -> torch.dtype) imports torch
when it is first read, in the processes that load a model.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DTYPE_NAMES = ("float32", "float16", "bfloat16")
DTYPE_CHOICES = ("auto", *DTYPE_NAMES)

# CPU feature flags that mean bfloat16 matmul runs in hardware: AVX512-BF16 and AMX-BF16 on x86
# (/proc/cpuinfo "flags"), the BF16 extension on Arm (/proc/cpuinfo "Features": "bf16").
_X86_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
_ARM_BF16_FEATURES = frozenset({"bf16"})


def cpu_feature_flags(cpuinfo_text: str) -> frozenset[str]:
    """Every word of the first "flags" (x86) or "Features" (Arm) line of /proc/cpuinfo."""
    for line in cpuinfo_text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags from /proc/cpuinfo; empty where there is none (macOS, Windows)."""
    try:
        return cpu_feature_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        return frozenset()


def cpu_has_native_bf16(cpuinfo_text: str | None = None) -> bool:
    """True when this CPU multiplies bfloat16 in hardware.

    Why the cpuinfo flags and not torch: torch.backends.cpu.get_cpu_capability() reports the
    vector ISA ("AVX512"), which plenty of CPUs without BF16 instructions also have, and
    oneDNN's own bf16 check accepts any AVX512 core because it can emulate bf16 there. Emulated
    bf16 matmul is slower than fp32, so only the hardware flags decide. On a system without
    /proc/cpuinfo (macOS, Windows) we cannot tell reliably and say no: fp32 is always correct.
    """
    flags = cpu_flags() if cpuinfo_text is None else cpu_feature_flags(cpuinfo_text)
    if not flags:
        return False
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return bool(flags & _ARM_BF16_FEATURES)
    return bool(flags & _X86_BF16_FLAGS)


def checkpoint_dtype(model: str | Path) -> str | None:
    """The dtype a HF checkpoint directory declares in config.json (torch_dtype, or dtype in
    newer transformers), when it is one we run; None for GGUF files or when it says nothing."""
    config_file = Path(model) / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None
    declared = config.get("torch_dtype") or config.get("dtype")
    return declared if declared in DTYPE_NAMES else None


def resolve_dtype(dtype: str, device: str, model: str | Path) -> str:
    """The concrete dtype name for `dtype` ("auto" or one of DTYPE_NAMES) on `device`.

    auto on CPU: bfloat16 where the CPU has native bf16 matmul (half the bytes for weights and
    KV, ~2x the matmul rate), float32 elsewhere (bf16 emulation is slower than fp32).
    auto on CUDA: the checkpoint's own dtype; bfloat16 when it declares none.
    """
    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, got {dtype!r}")
    if dtype != "auto":
        return dtype
    if device == "cuda":
        return checkpoint_dtype(model) or "bfloat16"
    return "bfloat16" if cpu_has_native_bf16() else "float32"


def torch_dtypes() -> dict[str, torch.dtype]:
    """Each dtype name's torch.dtype."""
    import torch

    return {name: getattr(torch, name) for name in DTYPE_NAMES}


def __getattr__(name: str):
    # `from engine_service.model.dtype import DTYPES` keeps working where a model is loaded,
    # and is the only way this module imports torch.
    if name == "DTYPES":
        return torch_dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
