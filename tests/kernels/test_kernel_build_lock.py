"""A process killed while loading the CPU extension leaves torch's lock file in the build
directory; before, every later load waited for it forever (every engine start on the machine
hung). build_and_load removes such a leftover under a lock the kernel releases on death."""

import os
import shutil
import subprocess
import sys

import pytest

from kernels.cpu_extension import (
    TORCH_LOCK_NAME,
    build_directory,
    build_failure,
    build_lock,
)

LOAD = ("from kernels.cpu_extension import build_and_load; build_and_load(); "
        "import torch; print(hasattr(torch.ops.pagedgen_cpu, 'paged_attention'))")


def test_a_lock_left_by_a_dead_loader_does_not_stop_the_next_load(tmp_path):
    if build_failure() is not None:
        pytest.skip(f"the CPU extension does not build here: {build_failure()}")
    # A copy of the built extension under a cache of this test's own: in the shared one, any
    # engine another test starts meanwhile may find the leftover first (and say so itself).
    built = build_directory()
    directory = tmp_path / "cache" / "extensions" / built.name
    with build_lock(built):
        shutil.copytree(built, directory, ignore=shutil.ignore_patterns(
            TORCH_LOCK_NAME, "pagedgen-build.lock"))
    with build_lock(directory):  # as a loader killed inside torch's load() leaves it
        (directory / TORCH_LOCK_NAME).touch()
    done = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True,
                          timeout=300,
                          env=dict(os.environ, PAGEDGEN_CACHE_DIR=str(tmp_path / "cache")))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True", done.stdout + done.stderr
    assert "left by a process stopped while loading" in done.stderr
    assert not (directory / TORCH_LOCK_NAME).exists()
