"""Paged KV-cache kernels: a C++ kernel for the CPU, a Triton path for CUDA, and the torch
path that is the reference both are tested against (and the CPU fallback).

`get_kernel_backend(name, device)` returns the set of functions the model runner calls: "auto"
picks Triton on CUDA and, on the CPU, the C++ paged attention when it builds here (else torch);
"torch" and "triton" force one.
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels import reference
from kernels.layer_ops import CPU_LAYER_OPS, TORCH_LAYER_OPS, LayerOps

KERNEL_BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class KernelBackend:
    name: str
    reshape_and_cache: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    copy_blocks: Callable[..., None]
    # Builds per-step index tensors shared by all layers (torch path); None when not needed.
    build_attention_plan: Callable[..., object] | None
    # Norms, rotary embedding, SiLU * up: torch ops unless a backend fuses them.
    layer_ops: LayerOps = TORCH_LAYER_OPS
    # The model may run its layers as one C++ call of this backend's kernels
    # (engine_service/model/models/fused_decoder.py): the CPU backend's own.
    fused_layers: bool = False


TORCH_BACKEND = KernelBackend(
    name="torch",
    reshape_and_cache=reference.reshape_and_cache,
    paged_attention=reference.paged_attention,
    copy_blocks=reference.copy_blocks,
    build_attention_plan=reference.build_attention_plan,
)


def _cpu_backend() -> KernelBackend:
    from kernels import cpu_attention  # the op itself is registered by loading the extension

    # Block copies stay on torch: one index_copy_ per step already touches each byte once.
    return KernelBackend(
        name="cpu",
        reshape_and_cache=cpu_attention.reshape_and_cache,
        paged_attention=cpu_attention.paged_attention,
        copy_blocks=reference.copy_blocks,
        build_attention_plan=None,
        layer_ops=CPU_LAYER_OPS,
        fused_layers=True,
    )


def get_kernel_backend(name: str, device: torch.device | str) -> KernelBackend:
    """The kernels to use: "auto" means Triton on CUDA, the C++ kernel (or, when it cannot be
    built here, torch) on the CPU."""
    if name not in KERNEL_BACKENDS:
        raise ValueError(f"kernel backend must be one of {KERNEL_BACKENDS}, got {name!r}")
    device = torch.device(device)
    if name == "torch":
        return TORCH_BACKEND
    if name == "auto" and device.type != "cuda":
        from kernels.cpu_extension import cpu_attention_available

        return _cpu_backend() if cpu_attention_available() else TORCH_BACKEND
    from kernels.triton_backend import TRITON_BACKEND  # imported lazily: needs triton

    return TRITON_BACKEND
