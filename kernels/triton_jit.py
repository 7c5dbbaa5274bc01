"""Import point for Triton: compiled kernels on CUDA, the Triton interpreter everywhere else.

Triton fixes compiled vs interpreted when a function is *defined* (TRITON_INTERPRET is read
at decoration time). Without a GPU the interpreter is the only way the kernels can run, so
`jit` defines them interpreted whenever this process has no CUDA device (or TRITON_INTERPRET=1),
whatever the environment said when `triton` was first imported: transformers' Llama import
pulls triton in early, and a test session or server cannot always order imports around that.

Triton's own standard library (`tl.max`, `tl.sum`, `tl.cdiv`) is made of jit functions defined
at that first import, so in compiled mode they refuse to run in the interpreter. The kernels
therefore reduce with the builtin `tl.reduce` and the standard combine functions (which the
interpreter maps to numpy in both modes) and write ceil-division out.

Integer arguments that change from step to step (sequence and row counts, the block-table row
stride) are listed in each kernel's `do_not_specialize`: Triton otherwise compiles a separate
variant for a value of 1 and for multiples of 16, so new variants would compile while serving.
"""

from collections.abc import Callable
from typing import Any

import torch
import triton
import triton.language as tl

INTERPRETED = bool(triton.knobs.runtime.interpret) or not torch.cuda.is_available()

# Combine functions for tl.reduce: tl.reduce(x, axis, MAX_COMBINE) is tl.max(x, axis).
MAX_COMBINE = tl.standard._elementwise_max
SUM_COMBINE = tl.standard._sum_combine


def jit(fn: Callable[..., Any] | None = None, **options: Any) -> Any:
    """Define a Triton kernel or device function: compiled on CUDA, interpreted otherwise.

    Used bare (`@jit`) or with triton.jit's options (`@jit(do_not_specialize=[...])`).
    """
    if fn is None:
        return lambda f: jit(f, **options)
    if not INTERPRETED:
        return triton.jit(fn, **options)
    # Scoped, so that kernels other modules define later keep their own choice.
    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = True
        return triton.jit(fn, **options)
