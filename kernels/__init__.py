"""Paged KV-cache kernels: a torch path (CPU, reference) and a Triton path (CUDA).

`get_kernel_backend(name, device)` returns the set of functions the model runner calls, so the
engine picks Triton on CUDA and torch on CPU through one interface ("auto"), or is forced to one.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import reference

KERNEL_BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class KernelBackend:
    name: str
    reshape_and_cache: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    copy_blocks: Callable[..., None]
    # Builds per-step index tensors shared by all layers (torch path); None when not needed.
    build_attention_plan: Callable[..., object] | None


TORCH_BACKEND = KernelBackend(
    name="torch",
    reshape_and_cache=reference.reshape_and_cache,
    paged_attention=reference.paged_attention,
    copy_blocks=reference.copy_blocks,
    build_attention_plan=reference.build_attention_plan,
)


def get_kernel_backend(name: str, device: torch.device | str) -> KernelBackend:
    """The kernels to use: "auto" means Triton on CUDA, torch elsewhere."""
    if name not in KERNEL_BACKENDS:
        raise ValueError(f"kernel backend must be one of {KERNEL_BACKENDS}, got {name!r}")
    device = torch.device(device)
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TORCH_BACKEND
    from kernels.triton_backend import TRITON_BACKEND  # imported lazily: needs triton

    return TRITON_BACKEND
