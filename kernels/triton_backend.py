"""The Triton kernel backend: what `get_kernel_backend("triton" | "auto", cuda)` returns.

Importing this module imports triton (see kernels/triton_jit.py for how the interpreter is
chosen on machines without CUDA), so `kernels/__init__.py` imports it lazily.
"""

from kernels import KernelBackend
from kernels.triton_attention import paged_attention
from kernels.triton_cache_ops import copy_blocks, reshape_and_cache

TRITON_BACKEND = KernelBackend(
    name="triton",
    reshape_and_cache=reshape_and_cache,
    paged_attention=paged_attention,
    copy_blocks=copy_blocks,
    # The kernel reads block tables and lengths directly: no per-step plan to build.
    build_attention_plan=None,
)
