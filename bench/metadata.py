"""Machine and version metadata stored with every result: a figure without its machine,
load and versions cannot be compared with anything."""

from __future__ import annotations

import os
import platform
import subprocess
import time
from importlib import metadata


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5, check=True
        )
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def machine_metadata(model: str, light: bool = False) -> dict:
    """`light`: only the time and load (for the end of a run)."""
    info = {
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "load_average_1_5_15": list(os.getloadavg()),
    }
    if light:
        return info
    import torch

    info.update(
        {
            "model": model,
            "cpu": _cpu_model(),
            "num_cpus": os.cpu_count(),
            "torch_num_threads": torch.get_num_threads(),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "versions": {
                p: _version(p) for p in ("pagedgen", "torch", "transformers", "grpcio", "numpy")
            },
            "git_commit": _git_commit(),
            "cuda_available": torch.cuda.is_available(),
            "cpu_bf16_linear": _bf16_linear_kernel(),
        }
    )
    return info


def _bf16_linear_kernel() -> str:
    """amx / vdpbf16ps / onednn / torch: which kernel the engine's bf16 linears run here (the
    bf16 figures of two machines differ by it first)."""
    from engine_service.model.models.packed_linear import bf16_linear_kernel

    return bf16_linear_kernel()
