#!/usr/bin/env bash
# The GPU check: the card's limits and the engine measured against them, in two calls of at
# most 5 minutes each, so that both and the machine's start fit a 15-minute lease with room
# to rerun a stage. On the GPU machine, from the repository root, after `bash
# bench/gpu_prepare.sh` here (it makes the git-ignored .whl/ and .gpu_carry/ this needs and
# prints the device tool's calls):
#
#   bash bench/gpu_check.sh                  # limits checkpoint decode attention serve
#   bash bench/gpu_check.sh checkpoint peer_hf   # the second call: the HF peer
#   bash bench/gpu_check.sh STAGE ...        # any stages, tests included
#   GPU_CHECK_DRY=1 bash bench/gpu_check.sh  # tiny shapes on this CPU: the plumbing only
#
# The HF peer has a call of its own: its two torch.compile runs (batch 1, then 64) take
# minutes, and last in one 300 s budget behind two cold 8B engine starts it was left too
# little to measure anything. Merge the two calls' stages.tgz here with
# `python -m bench.gpu_summary --stages RUN1 --stages RUN2 --out DIR`.
#
# Stages, in order, each under its own time limit and all under GPU_CHECK_BUDGET_S (300);
# a failed stage does not stop the next, a stage left less than 15 s is skipped:
#   limits      read bandwidth (sum over 4 GiB) and bf16 GEMM peak (8192^3), best of 10, and
#               the spec (bench/gpu_limits.py)
#   checkpoint  a random Llama-3-8B (its layers and 128,256-token vocabulary) drawn on the
#               GPU into /dev/shm (bench/random_checkpoint.py); the real weights do not fit
#               the 64 MiB a lease carries, and step times do not depend on the values
#   decode      the fixed 64-request workload offline (first: two targets read it), then
#               decode at batch 1/64/256 x ctx 512 and 1/64 x 4,096 (whole step and graph
#               replay), mixed steps (64 decodes + a 256- or 2,048-token chunk; graph
#               replay and whole step, then the same steps eagerly) (bench/gpu_decode.py)
#   attention   decode attention as 32 layers' calls in one CUDA graph at five shapes, the
#               skewed one included, with splits per sequence and (printed beside it) with
#               the uniform split count used before, and at 2 and 8 programs per SM; prefill
#               attention at 8k (every tile shape a warm-up times) and 32k (the default and
#               the best) vs SDPA is_causal (bench/gpu_attention.py)
#   serve       the fixed workload as 64 gRPC streams to pagedgen-engine (bench/gpu_serve.py)
#   peer_hf     HF generate, static cache + torch.compile, batch 1 and the fixed workload
#               (bench/gpu_peer_hf.py)
#   tests       (only when named) the CUDA tests: Triton kernels vs the torch reference, the
#               engine through them, CUDA graphs (decode and mixed steps) vs eager (on a
#               random SmolLM2-shaped model)
# After each stage bench/gpu_summary.py rewrites $OUT/summary.json (one entry per target:
# name, measured, limit, ratio, target, met) and $OUT/gpu_table.md (the README's GPU table),
# so a run cut short keeps what it measured. $OUT also gets gpu_check.log and stages.tgz (the
# stages' own JSON): four files, inside the device tool's eight. Commit summary.json and
# gpu_table.md under bench/results/gpu/<device_slug in summary.json>/.
set -u
cd "$(dirname "$0")/.."
DRY=${GPU_CHECK_DRY:-0}
OUT=${OUT:-/tmp/gpu_check}
WORK=${GPU_CHECK_WORK:-/tmp/gpu_check_work}
START=$(date +%s)
rm -rf "$WORK"
mkdir -p "$OUT" "$WORK"
LOG="$OUT/gpu_check.log"
: >"$LOG"
STAGES=("$@")
[ ${#STAGES[@]} -eq 0 ] && STAGES=(limits checkpoint decode attention serve)
wants() { [[ " ${STAGES[*]} " == *" $1 "* ]]; }

say() { echo "$*" | tee -a "$LOG"; }

summarize() {
  python3 -m bench.gpu_summary --stages "$WORK" --out "$OUT" --quiet >>"$LOG" 2>&1
  tar -czf "$OUT/stages.tgz" -C "$WORK" . 2>>"$LOG"
}

# group_members PGID: "pid:name" of each live (not zombie) process in that process group.
group_members() {
  ps -e -o pgid=,stat=,pid=,comm= | awk -v g="$1" '$1 == g && $2 !~ /^Z/ {print $3 ":" $4}'
}

# reap_group PGID: what is left of a stage's process group, given 2 s to finish exiting, then
# SIGKILLed and waited for (up to 20 s), so its GPU memory is free before the next stage
# starts. (While a group has a process its number is no other process's, so nothing else can
# be hit; a zombie holds no memory and is left to init.)
reap_group() {
  local pgid=$1 i left
  for i in $(seq 10); do
    left=$(group_members "$pgid")
    [ -z "$left" ] && return 0
    sleep 0.2
  done
  echo "=== killing what the stage left running:" $left
  kill -KILL -- "-$pgid" 2>/dev/null
  for i in $(seq 100); do
    [ -z "$(group_members "$pgid")" ] && return 0
    sleep 0.2
  done
  echo "=== still running after SIGKILL:" $(group_members "$pgid")
}

# stage NAME LIMIT_S CMD...: CMD under min(LIMIT_S, what the budget has left), its output
# into the log and on stdout; exit code and seconds into stages.tsv; then the summary.
stage() {
  local name=$1 limit=$2 start rc left
  shift 2
  start=$(date +%s)
  left=$((BUDGET - (start - START)))
  if [ "$left" -lt 15 ]; then
    say "=== $name: skipped, ${left}s of the ${BUDGET}s budget left"
    printf '%s\t%s\t%s\t%s\n' "$name" 125 0 0 >>"$WORK/stages.tsv"
    summarize
    return
  fi
  limit=$((limit * SLOW))
  [ "$limit" -gt "$left" ] && limit=$left
  say "=== $name (limit ${limit}s) at $(date +%T), $((start - START))s in"
  # timeout makes itself a process group (pgid = its pid); when it fires it sends SIGTERM to
  # that group once, and SIGKILL only to its own child and only if that outlives -k. A
  # grandchild that handles SIGTERM (pagedgen-engine drains for up to 30 s) or ignores it
  # outlives the stage, holding most of the GPU's memory while the next stage loads its own
  # copy of the model, and one that shares our stdout keeps tee, so the stage, waiting:
  # reap_group kills what is left before the pipe is waited on.
  ( timeout -k 10 "$limit" "$@" &
    pid=$!
    wait "$pid"
    code=$?
    reap_group "$pid"
    exit "$code" ) 2>&1 | tee -a "$LOG"
  rc=${PIPESTATUS[0]}
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - start))" "$limit" \
    >>"$WORK/stages.tsv"
  say "=== $name: exit $rc after $(($(date +%s) - start))s"
  summarize
}

if [ "$DRY" = 1 ]; then
  FLAGS=(--dry) SLOW=3  # a shared CPU: the dry stages get three times the limits
  SHAPE=tiny DEVICE=cpu MODELS=/tmp/gpu_check_models
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  FLAGS=() SLOW=1
  SHAPE=llama-8b DEVICE=cuda MODELS=/dev/shm/pagedgen_models
  # 16 GB of weights: tmpfs when it has room (reads at memory speed), else the disk.
  [ -d /dev/shm ] && [ "$(df -k --output=avail /dev/shm | tail -1)" -gt 40000000 ] ||
    MODELS=/tmp/pagedgen_models
  ls .whl/*.whl >/dev/null 2>&1 || { say "no .whl/: run bash bench/gpu_prepare.sh first"; exit 1; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
fi
BUDGET=${GPU_CHECK_BUDGET_S:-$((300 * SLOW))}
# No network there: a hub lookup would only wait for its timeouts.
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
TOKENIZER=${GPU_CHECK_TOKENIZER:-.gpu_carry/smollm2}
if [ ! -f "$TOKENIZER/tokenizer.json" ] && [ "$DRY" = 1 ]; then
  TOKENIZER=$(python3 -c 'from engine_service.model.paths import default_model_dir
print(default_model_dir())')
fi
[ -f "$TOKENIZER/tokenizer.json" ] ||
  { say "no $TOKENIZER/tokenizer.json: run bash bench/gpu_prepare.sh first"; exit 1; }
# The GPU machine starts bare: the CPU extension's build cache in a folder of its own.
[ "$DRY" = 1 ] || export PAGEDGEN_CACHE_DIR=/tmp/pagedgen_cache
[ -f .gpu_carry/source.txt ] && cp .gpu_carry/source.txt "$WORK/source.txt"
MODEL=$MODELS/$SHAPE
mkdir -p "$MODELS"
{
  [ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv
  echo "stages: ${STAGES[*]}; budget ${BUDGET}s; model $MODEL; tokenizer $TOKENIZER"
  cat .gpu_carry/source.txt 2>/dev/null
} 2>&1 | tee -a "$LOG"

wants limits && stage limits 40 python3 -m bench.gpu_limits --out "$WORK" "${FLAGS[@]}"
if wants checkpoint || wants decode || wants serve || wants peer_hf; then
  stage checkpoint 60 python3 -m bench.random_checkpoint --shape "$SHAPE" \
    --tokenizer "$TOKENIZER" --out "$MODEL" --device "$DEVICE"
fi
wants decode && stage decode 150 python3 -m bench.gpu_decode --model "$MODEL" --out "$WORK" \
  "${FLAGS[@]}"
wants attention && stage attention 90 python3 -m bench.gpu_attention --out "$WORK" "${FLAGS[@]}"
wants serve && stage serve 80 python3 -m bench.gpu_serve --model "$MODEL" --out "$WORK" \
  --log "$WORK/serve_engine.log" "${FLAGS[@]}"
wants peer_hf && stage peer_hf 240 python3 -m bench.gpu_peer_hf --model "$MODEL" \
  --out "$WORK" "${FLAGS[@]}"
if wants tests; then
  # The graphs' buffers run on the CPU in CI ("on_cpu"); here, 16 torch threads per worker
  # made each of those take 60-100 s (at 037af0b), so they are left to CI.
  SMOL=$MODELS/smollm2
  python3 -m bench.random_checkpoint --shape smollm2 --tokenizer "$TOKENIZER" --out "$SMOL" \
    --device "$DEVICE" >>"$LOG" 2>&1
  PAGEDGEN_TEST_MODEL_DIR=$SMOL stage tests 200 python3 -m pytest -q -p no:valkey -n 4 \
    -p tests.support.model_dir_override --timeout 150 -k "not on_cpu" \
    tests/kernels/test_kernel_paged_attention.py tests/kernels/test_kernel_cache_ops.py \
    tests/kernels/test_kernel_backend.py tests/kernels/test_kernel_attention_splits.py \
    tests/kernels/test_kernel_split_engine.py \
    tests/kernels/test_kernel_index_overflow.py tests/kernels/test_kernel_engine_e2e.py \
    tests/engine/test_warmup.py tests/engine/test_cuda_graphs.py tests/engine/test_mixed_graphs.py
fi
[ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=memory.used,temperature.gpu --format=csv >>"$LOG" 2>&1
summarize
say "=== done at $(date +%T), $(($(date +%s) - START))s in"
cat "$OUT/gpu_table.md" 2>/dev/null
