#!/usr/bin/env bash
# Set up (idempotent) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# Where a C++ compiler exists (the one torch builds with: $CXX, else c++), the CPU extension must
# build: set-up exits non-zero with the compiler's output, and the kernel tests fail rather than
# skip (kernels/cpu_extension.py). Without one, they skip and say why, as the engine falls back
# to torch. Set here, not in .ci/run, so the README's test command means what CI's does; an
# explicit PAGEDGEN_REQUIRE_CPU_EXTENSION=0 opts out.
if [ -z "${PAGEDGEN_REQUIRE_CPU_EXTENSION:-}" ] && command -v "${CXX:-c++}" >/dev/null 2>&1; then
    export PAGEDGEN_REQUIRE_CPU_EXTENSION=1
fi
bash scripts/setup.sh
python3 -m ruff check .
# Three workers on CI's two cores: the suite is mostly services starting and waiting on each
# other, so one worker left a core idle, and two still used 1.6 of the 2 (19:01 on three against
# 22:21-23:45 on two, same machine; bench/README.md, "The test suite's time"). A test file stays
# on one worker (its module fixtures start once). PAGEDGEN_TEST_WORKERS=0 runs it in this
# process; "$@" comes last and can override either.
# The 25 slowest tests are listed at the end: where the suite's time goes, run after run.
python3 -m pytest -q -n "${PAGEDGEN_TEST_WORKERS:-3}" --dist loadfile --durations 25 "$@"
