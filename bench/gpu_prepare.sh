#!/usr/bin/env bash
# Makes, on this machine, what bench/gpu_check.sh needs on the GPU machine and a clean clone
# lacks, into two git-ignored folders the device tool carries; prints the carry list.
#
#   bash bench/gpu_prepare.sh        # idempotent: a second run downloads nothing
#
#   .whl/        wheels of the Python packages the GPU image lacks or has too old, for its
#                Python (3.12: bench/results/gpu_h200/at_037af0b/gpu_check.log) on x86-64
#                Linux, at the versions installed here (what CI tests): grpcio and its
#                health and reflection services (the served stage), protobuf (our stubs
#                need >= 7.35), redis (imported by the optional tests stage); and what
#                pagedgen-engine and engine_service.tools.launch import that the image lacks
#                (its package list: /work/.library/device/KINDS.md): cryptography (trust/,
#                with cffi and pycparser), starlette, uvicorn and pydantic (the HTTP front,
#                with pydantic-core, annotated-types and typing-inspection; and the
#                typing-extensions and anyio they need, whose versions there are unknown).
#                Without them the served stage stops at its first import
#                (ModuleNotFoundError; tests/bench/test_gpu_carry.py)
#   .gpu_carry/  smollm2/: SmolLM2's config.json, generation_config.json and tokenizer files
#                (the 8B checkpoint is drawn there, its tokenizer padded to Llama-3's
#                128,256 ids: bench/random_checkpoint.py); source.txt: the commit and whether
#                the tree had changes, which the summary records (.git does not travel)
# Together about 18 MiB; the device tool carries 64 MiB with the working tree.
set -euo pipefail
cd "$(dirname "$0")/.."
GPU_PYTHON=3.12
PACKAGES=(grpcio grpcio-health-checking grpcio-reflection protobuf redis
  cryptography cffi pycparser starlette uvicorn pydantic pydantic-core annotated-types
  typing-inspection typing-extensions anyio)
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64
  manylinux2014_x86_64 manylinux1_x86_64)

version_here() {
  python3 -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$1"
}

# One wheel per package, at this machine's version: two versions of one package in .whl/
# would stop the install there, so a stale one is removed first.
mkdir -p .whl
for package in "${PACKAGES[@]}"; do
  version=$(version_here "$package")
  stem=$(echo "$package" | tr '-' '_')
  if ls .whl/"$stem"-"$version"-*.whl >/dev/null 2>&1; then
    continue
  fi
  rm -f .whl/"$stem"-*.whl
  platform_args=()
  for p in "${PLATFORMS[@]}"; do platform_args+=(--platform "$p"); done
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$GPU_PYTHON" \
    --implementation cp "${platform_args[@]}" -d .whl "$package==$version"
done

# The tokenizer and config files: from the SmolLM2 conversion (pagedgen-prepare-model makes
# it on first use).
smollm2=$(python3 -c 'from engine_service.tools.prepare_model import ensure_default_model
print(ensure_default_model(quiet=True))')
mkdir -p .gpu_carry/smollm2
for name in config.json generation_config.json tokenizer.json tokenizer_config.json \
  chat_template.jinja; do
  if [ -f "$smollm2/$name" ]; then
    cmp -s "$smollm2/$name" ".gpu_carry/smollm2/$name" || cp "$smollm2/$name" .gpu_carry/smollm2/
  fi
done
{
  echo "commit=$(git rev-parse HEAD 2>/dev/null || echo unknown)"
  echo "dirty=$(git status --porcelain --untracked-files=no 2>/dev/null | wc -l)"
  echo "prepared=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
} >.gpu_carry/source.txt

for path in .whl .gpu_carry; do
  git check-ignore -q "$path/" || echo "warning: $path/ is not git-ignored (.gitignore)" >&2
done
carried=$(du -scb .whl .gpu_carry | tail -1 | cut -f1)
tree=$(git ls-files -z -co --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -1 |
  cut -f1)
echo "wheels: $(cd .whl && ls | tr '\n' ' ')"
echo "carried $((carried >> 20)) MiB + working tree $((tree >> 20)) MiB (the tool's limit: 64 MiB)"
[ $((carried + tree)) -lt $((64 << 20)) ] || echo "warning: over the 64 MiB the device tool carries" >&2
# Each call's budget is 300 s; the stage running when it runs out may go 30 s past it (10 s
# to die, 20 to reap). The second call right after the first finds the machine warm.
echo 'run 1: command "bash bench/gpu_check.sh", carry [".whl", ".gpu_carry"], timeout_s 360'
echo 'run 2: command "bash bench/gpu_check.sh checkpoint peer_hf", carry [".whl", ".gpu_carry"], timeout_s 360'
