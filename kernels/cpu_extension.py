"""Build (once) and load the CPU kernels, a torch C++ extension: paged attention, the fused
per-layer ops (RMSNorm, residual add + RMSNorm, rotary, SiLU * up; kernels/layer_ops.py), the
float32 and bfloat16 (AVX512-BF16, AMX) linear layers over weights packed once
(engine_service/model/models/packed_linear.py) and the decoder layers in one call
(engine_service/model/models/fused_decoder.py).

Why a C++ extension built at set-up time: it is the one option that reads the paged cache in
place on every CPU torch runs on, with nothing new to install beyond a C++ compiler (PyPI has no
CPU paged-attention kernel library for torch 2.13), and torch.compile cannot express "walk this
block table" without materializing the gather. scripts/setup.sh runs `python -m
kernels.cpu_extension`, which compiles it into a cache directory keyed by the source, torch
version and CPU, so the README's set-up command stays the only step and a second run is a no-op.
If the build is unavailable (no compiler, no ninja), the engine logs one line and uses the torch
reference path instead.

That fallback is right for a machine with no compiler, and wrong where one exists: there a failed
build is a bug that would otherwise pass unseen (the engine runs, slower, and the kernel tests
skip). So `python -m kernels.cpu_extension --require`, or $PAGEDGEN_REQUIRE_CPU_EXTENSION=1, exits
non-zero with the compiler's output on a failed build, and the kernel tests fail instead of
skipping (tests/kernels/conftest.py); scripts/run_tests.sh sets the variable where a C++ compiler
is on the PATH. Without the flag set-up stays lenient, so the README's one set-up command works
on a machine without a compiler.
"""

import argparse
import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import platform
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# Paged attention, the fused per-layer ops (norms, rotary, SiLU * up) of kernels/layer_ops.py,
# the float32 and bfloat16 linear layers, and the decoder layer loop that calls them all.
SOURCES = tuple(Path(__file__).resolve().parent / "csrc" / name
                for name in ("paged_attention_cpu.cpp", "layer_ops_cpu.cpp", "linear_cpu.cpp",
                             "linear_bf16_cpu.cpp", "linear_bf16_amx.cpp",
                             "decoder_cpu.cpp"))
HEADERS = tuple(Path(__file__).resolve().parent / "csrc" / name
                for name in ("cpu_math.h", "cpu_ops.h", "linear_blocks.h",
                             "linear_bf16_store.h"))  # in the cache key too
EXTENSION_NAME = "pagedgen_cpu_attention"
# "1": a failed build is an error (the CLI exits non-zero, the kernel tests fail), not a fallback.
REQUIRE_ENV = "PAGEDGEN_REQUIRE_CPU_EXTENSION"
# -march=native: the cache key includes this CPU's flags, so a copy of the cache moved to
# another kind of CPU rebuilds instead of crashing on an unknown instruction.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno"]


# Where builds go, when the cache is not the place: an image mounts the cache (the model)
# read-only, and compiles where it may write (docker/Dockerfile).
EXTENSIONS_DIR_ENV = "PAGEDGEN_EXTENSIONS_DIR"


def _cache_root() -> Path:
    if os.environ.get(EXTENSIONS_DIR_ENV):
        return Path(os.environ[EXTENSIONS_DIR_ENV])
    base = os.environ.get("PAGEDGEN_CACHE_DIR") or Path.home() / ".cache" / "pagedgen"
    return Path(base) / "extensions"


def _cpu_signature() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return value.strip()
    return platform.machine()


def build_directory() -> Path:
    """Where this source, torch, Python and CPU build their copy of the extension. The
    sources' folder is in the key too: torch's build file names the sources by path, so two
    checkouts of the same code sharing a folder rebuilt it (~25 s) each time the other had
    loaded it last."""
    key = hashlib.sha256()
    for part in (str(SOURCES[0].parent).encode(),
                 *(source.read_bytes() for source in SOURCES + HEADERS),
                 torch.__version__.encode(),
                 sys.version.encode(),
                 " ".join(CFLAGS).encode(), _cpu_signature().encode()):
        key.update(part)
    return _cache_root() / f"{EXTENSION_NAME}-{key.hexdigest()[:16]}"


def build_and_load(verbose: bool = False) -> None:
    """Compile (when the cache has no current build) and load the extension; raises on failure."""
    from torch.utils import cpp_extension

    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    with build_lock(directory):
        # torch's own lock is a file that only its holder removes: a process killed inside
        # load() (an engine stopped while starting) leaves it, and every later load() waits
        # for it forever. While we hold ours no process of ours is inside load() here, so a
        # file found now is such a leftover.
        stale = directory / TORCH_LOCK_NAME
        if stale.exists():
            log.warning("removing %s, left by a process stopped while loading the extension",
                        stale)
            stale.unlink(missing_ok=True)
        cpp_extension.load(
            name=EXTENSION_NAME,
            sources=[str(source) for source in SOURCES],
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            is_python_module=False,  # registers torch.ops.pagedgen_cpu.* when loaded
            verbose=verbose,
        )


TORCH_LOCK_NAME = "lock"  # torch.utils.cpp_extension's FileBaton in the build directory


@contextlib.contextmanager
def build_lock(directory: Path) -> Iterator[None]:
    """An flock on the build directory, which the kernel releases when its holder dies."""
    with open(directory / "pagedgen-build.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def extension_required() -> bool:
    """Whether $PAGEDGEN_REQUIRE_CPU_EXTENSION asks for a failed build to be an error."""
    value = os.environ.get(REQUIRE_ENV, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"${REQUIRE_ENV} must be 1 (require the build) or 0 (fall back to "
                         f"torch), got {value!r}")
    return value == "1"


@functools.cache
def build_failure() -> str | None:
    """None once the extension is loaded (building it if the cache lacks it); else why it could
    not be: the error and, for a failed compile, the build's whole output. Cached: one attempt
    per process."""
    try:
        build_and_load()
    except Exception as error:  # any build failure means: use the torch path
        return f"{type(error).__name__}: {str(error).strip()}"
    return None


def failure_summary(failure: str) -> str:
    """One line of a build failure: the compiler's first error where there is one (a failed
    compile's output ends on ninja's "build stopped", which says nothing), else its first line."""
    lines = failure.strip().splitlines()
    return next((line.strip() for line in lines if "error:" in line), lines[0])


@functools.cache
def cpu_attention_available() -> bool:
    """Load the extension (building it if the cache lacks it); False, with one log line, if it
    cannot be built here. Cached: one attempt per process."""
    failure = build_failure()
    if failure is not None:
        log.warning("CPU paged-attention kernel unavailable (%s); using the torch reference path",
                    failure_summary(failure))
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    """`python -m kernels.cpu_extension [--require]`: build now (scripts/setup.sh). Exits 0 on a
    failed build (the engine then uses torch) unless --require or $PAGEDGEN_REQUIRE_CPU_EXTENSION=1
    asks for the build: then 1, with the compiler's output."""
    parser = argparse.ArgumentParser(prog="python -m kernels.cpu_extension",
                                     description="Build and load the CPU kernels now.")
    parser.add_argument("--require", action="store_true",
                        help=f"exit 1 if the build fails (also: ${REQUIRE_ENV}=1)")
    args = parser.parse_args(argv)
    try:
        required = args.require or extension_required()
    except ValueError as error:
        parser.error(str(error))
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    failure = build_failure()
    if failure is None:
        print(f"CPU paged-attention kernel ready in {build_directory()}")
        return 0
    if not required:
        log.warning("CPU kernels not built (%s); the engine will use the torch reference path",
                    failure_summary(failure))
        return 0
    print(f"error: the CPU extension did not build in {build_directory()} "
          f"({failure_summary(failure)}); it is required here (--require or "
          f"${REQUIRE_ENV}=1). The build said:\n{failure}", file=sys.stderr)
    return 1

if __name__ == "__main__":
    sys.exit(main())
