"""Keep the C allocator from handing a step's large buffers back to the kernel every step.

On the CPU every step allocates and frees the same large tensors: the logits alone are
batch x vocabulary float32 (64 x 49,152: 12.6 MB). glibc serves a request that large with a
fresh mmap (or from the top of the heap, which it trims back after the free), so each step
paid for its buffers twice in the kernel: the first touch faults in every 4 KiB page (zeroed),
and the free unmaps them. Measured on the step-loop model (bench/README.md, host work per
step): 90-900 page faults and 0.1-2 ms of system time a step, against a few (tests/engine/
test_cpu_malloc.py) with the settings below, which make those frees stay in the heap for the
next step to reuse.

The settings are per process and stay for its life (in a user's process running the offline
LLM too): a CPU model runner applies them once its weights are loaded, after trimming the heap
(glibc only; elsewhere nothing happens). The memory they keep is the heap's free memory: up to
TRIM_THRESHOLD_BYTES at its top, and whatever a step freed inside it. Requests above
MMAP_THRESHOLD_BYTES, the largest glibc accepts on 64-bit, are still mapped per call: a logits
buffer past 32 MiB (a batch above ~170 on a 49k vocabulary) pays the faults again.
"""

import ctypes
import ctypes.util
import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024  # glibc's cap on 64-bit (4 MiB * sizeof(long))
# Free memory at the heap's top kept for reuse rather than returned: room for the largest
# step's temporaries, not a bound on what the heap holds free.
TRIM_THRESHOLD_BYTES = 512 * 1024 * 1024


@dataclass(slots=True, frozen=True)
class MallocTuning:
    applied: bool
    detail: str


def keep_step_buffers() -> MallocTuning:
    """Return the heap's free memory to the kernel, then raise glibc's mmap and trim thresholds
    for this process (idempotent). Call it once the weights are loaded: the load's temporaries,
    freed inside the heap, are what the trim gives back (with the thresholds already raised, by
    an earlier engine of the same process, ~225 MiB of them on SmolLM2 stayed held)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return MallocTuning(False, "no C library found")
    try:
        libc = ctypes.CDLL(name)
        mallopt, malloc_trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        return MallocTuning(False, f"{name} has no mallopt or malloc_trim (not glibc)")
    malloc_trim.argtypes = [ctypes.c_size_t]
    malloc_trim(0)  # every arena's free pages, not only the top's
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success; a fixed threshold also turns off glibc's adjusting it.
    if not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
            and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)):
        return MallocTuning(False, "mallopt refused the thresholds")
    return MallocTuning(True, f"mmap threshold {MMAP_THRESHOLD_BYTES >> 20} MiB, trim threshold "
                              f"{TRIM_THRESHOLD_BYTES >> 20} MiB")
