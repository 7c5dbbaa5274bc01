"""The Triton kernel backend: what `get_kernel_backend("triton" | "auto", cuda)` returns.

Importing this module imports triton (see kernels/triton_jit.py for how the interpreter is
chosen on machines without CUDA), so `kernels/__init__.py` imports it lazily.
"""

from kernels import KernelBackend
from kernels.triton_attention import _combine_splits_kernel, paged_attention, paged_attention_kernel
from kernels.triton_cache_ops import (
    copy_blocks,
    copy_blocks_kernel,
    reshape_and_cache,
    reshape_and_cache_kernel,
)
from kernels.triton_layer_ops import JIT_KERNELS as LAYER_KERNELS
from kernels.triton_layer_ops import TRITON_LAYER_OPS

TRITON_BACKEND = KernelBackend(
    name="triton",
    reshape_and_cache=reshape_and_cache,
    paged_attention=paged_attention,
    copy_blocks=copy_blocks,
    # The kernel reads block tables and lengths directly: no per-step plan to build.
    build_attention_plan=None,
    # Norms, rotary and SiLU * up one launch each (kernels/triton_layer_ops.py).
    layer_ops=TRITON_LAYER_OPS,
)

JIT_KERNELS = {
    "paged_attention": paged_attention_kernel,
    "combine_splits": _combine_splits_kernel,
    "reshape_and_cache": reshape_and_cache_kernel,
    "copy_blocks": copy_blocks_kernel,
    **LAYER_KERNELS,
}


def compiled_variant_counts() -> dict[str, int]:
    """Compiled variants of each kernel in this process, over all devices (0 everywhere in
    the interpreter, which compiles nothing): what a warm-up must have covered."""
    counts = {}
    for name, kernel in JIT_KERNELS.items():
        # JITFunction.device_caches: device -> (kernel cache, key cache, target, backend, binder)
        caches = getattr(kernel, "device_caches", {})
        counts[name] = sum(len(entry[0]) for entry in caches.values())
    return counts
