"""Import point for Triton: compiled kernels on CUDA, the Triton interpreter everywhere else.

Triton fixes compiled vs interpreted when a function is *defined* (TRITON_INTERPRET is read at
decoration time), and that includes its own standard library (`tl.max`, `tl.cdiv`, ...),
which is defined when `triton` is first imported. So on a machine without CUDA:

- if nothing has imported triton yet, this module sets TRITON_INTERPRET=1 before importing it
  (the interpreter is the only way Triton runs without a GPU);
- if triton was already imported in compiled mode (transformers' Llama import does that), the
  kernels could not run, so importing them fails here with a message that says what to do.
"""

import os
import sys

import torch

_HAS_CUDA = torch.cuda.is_available()
if not _HAS_CUDA and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402  (must follow the TRITON_INTERPRET decision above)
import triton.language as tl  # noqa: E402

# The standard library tells how triton.language was really defined; the knob alone can lie
# when the variable was set after triton had been imported.
INTERPRETED = not isinstance(tl.cdiv, triton.runtime.jit.JITFunction)

if not _HAS_CUDA and not INTERPRETED:
    raise ImportError(
        "the Triton kernels need a CUDA device or the Triton interpreter, but triton was already "
        "imported in compiled mode on a machine without CUDA. Set TRITON_INTERPRET=1 in the "
        "environment (or before anything imports triton or transformers' models), or use the "
        "torch kernel backend."
    )

jit = triton.jit

__all__ = ["INTERPRETED", "jit", "tl", "triton"]
