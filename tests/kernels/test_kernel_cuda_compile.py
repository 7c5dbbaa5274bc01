"""The CUDA path of every kernel compiles for sm_90 (and sm_80), without a GPU, with the exact
specializations a real launch gets, into as few variants as the engine needs, with no spills.

The interpreter checks the kernels' arithmetic but not what only the compiler enforces: types
carried through loops, tl.dot's minimum tile sizes, register and shared-memory limits.
tests/kernels/cuda_compile_probe.py (a subprocess: this process defines the kernels
interpreted) calls the real host wrappers with the tensors the model runner would pass,
captures each launch, specializes it with Triton's own binder, compiles each distinct variant
with triton.compile for GPUTarget("cuda", arch, 32) (ptxas ships in the triton wheel) and reads
ptxas -v's register and spill report.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton

from kernels.attention_splits import MAX_KV_SPLITS
from kernels.attention_tiles import prefill_candidates

REPO_ROOT = Path(__file__).resolve().parents[2]
PROBE = REPO_ROOT / "tests" / "kernels" / "cuda_compile_probe.py"
SHARED_MEMORY_LIMIT = {90: 227 * 1024, 80: 163 * 1024}  # per block, opt-in maximum

# Decode batches of many sizes and table widths (the per-step integers; decode splits keys
# per sequence with the policy of a 132-SM GPU), mixed batches, and every prefill tile shape a
# warm-up may time (kernels/attention_tiles.prefill_candidates).
SERVING_STEPS = [
    {"query_lens": [1], "max_blocks": 1},
    {"query_lens": [1] * 17, "max_blocks": 33},
    {"query_lens": [1] * 64, "max_blocks": 100},
    {"query_lens": [100, 1, 1], "max_blocks": 9},
    {"query_lens": [2048], "max_blocks": 128},
    {"query_lens": [1], "max_blocks": 2048},
]
SHORT_STEPS = [
    {"query_lens": [1], "max_blocks": 3},
    {"query_lens": [33, 1], "max_blocks": 5},
    {"query_lens": [1, 1], "max_blocks": 40},
]


def tuned_steps(dtype: torch.dtype, head: int, block: int, queries_per_kv: int,
                arch: int) -> list:
    """A decode step, then a 2,048-token prompt chunk in each tile shape the warm-up times
    besides the default (which SERVING_STEPS compile)."""
    head_pad = max(16, triton.next_power_of_2(head))
    return [{"query_lens": [1], "max_blocks": 64}] + [
            {"query_lens": [2048], "max_blocks": 128,
             "prefill_tiles": [t.block_m, t.tile_n, t.num_warps, t.num_stages]}
            for t in prefill_candidates(dtype, head_pad, block, queries_per_kv,
                                        arch // 10)[1:]]


def scenario(id_: str, arch: int, dtype: str, heads: int, kv_heads: int, head: int,
             block: int, steps: list, cache_dtype: str | None = None) -> dict:
    return {"id": id_, "arch": arch, "dtype": dtype, "cache_dtype": cache_dtype or dtype,
            "num_heads": heads, "num_kv_heads": kv_heads, "head_size": head,
            "block_size": block, "steps": steps}


SCENARIOS = [
    scenario("llama8b-bf16-sm90", 90, "bfloat16", 32, 8, 128, 16, SERVING_STEPS),
    scenario("llama8b-bf16-tuned-sm90", 90, "bfloat16", 32, 8, 128, 16,
             tuned_steps(torch.bfloat16, 128, 16, 4, 90)),
    scenario("llama8b-bf16-tuned-sm80", 80, "bfloat16", 32, 8, 128, 16,
             tuned_steps(torch.bfloat16, 128, 16, 4, 80)),
    scenario("head64-fp16-tuned-sm90", 90, "float16", 9, 3, 64, 16,
             tuned_steps(torch.float16, 64, 16, 3, 90)),
    scenario("head64-bf16-tuned-sm80", 80, "bfloat16", 9, 3, 64, 16,
             tuned_steps(torch.bfloat16, 64, 16, 3, 80)),
    scenario("smollm2-bf16-sm90", 90, "bfloat16", 9, 3, 64, 16, SERVING_STEPS),
    scenario("head80-fp16-sm90", 90, "float16", 16, 4, 80, 16, SHORT_STEPS),
    scenario("gqa7-bf16-block32-sm90", 90, "bfloat16", 28, 4, 128, 32, SHORT_STEPS),
    scenario("fp32-head64-sm90", 90, "float32", 9, 3, 64, 16, SHORT_STEPS),
    scenario("fp32-head128-sm90", 90, "float32", 32, 8, 128, 16, SHORT_STEPS),
    scenario("fp32-head96-block8-sm80", 80, "float32", 8, 8, 96, 8, SHORT_STEPS),
    scenario("fp32-into-bf16-cache-sm90", 90, "float32", 8, 2, 64, 16, SHORT_STEPS, "bfloat16"),
]


@pytest.fixture(scope="module")
def compile_report() -> dict:
    """Compile every scenario in one subprocess (one torch import instead of one each)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, str(PROBE), json.dumps(SCENARIOS)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", SCENARIOS, ids=[s["id"] for s in SCENARIOS])
def test_every_variant_compiles_without_spills(compile_report: dict, case: dict) -> None:
    report = compile_report[case["id"]]
    assert "error" not in report, report.get("error")
    kernels = {v["kernel"] for v in report["variants"]}
    assert kernels == {"attention", "combine", "reshape_and_cache", "copy_blocks", "rms_norm",
                       "head_rms_norm", "rotary", "rotary_and_cache", "silu_mul"}
    for variant in report["variants"]:
        where = f"{variant['kernel']} {variant.get('constexprs')}"
        assert "error" not in variant, f"{where}: {variant.get('error')}"
        assert variant["cubin_bytes"] > 0, where
        assert variant["shared_bytes"] <= SHARED_MEMORY_LIMIT[case["arch"]], where
        assert variant["registers"] <= 255, where
        assert (variant["spill_store_bytes"], variant["spill_load_bytes"]) == (0, 0), (
            f"{where}: {variant['registers']} registers, {variant['spill_store_bytes']} bytes "
            f"spill stores, {variant['spill_load_bytes']} bytes spill loads")


@pytest.mark.parametrize("case", SCENARIOS, ids=[s["id"] for s in SCENARIOS])
def test_host_wrappers_never_wait_for_the_device(compile_report: dict, case: dict) -> None:
    """reshape_and_cache, paged_attention and copy_blocks run per layer and step: their host
    code reads shapes only (no .item(), no nonzero) and uploads nothing."""
    report = compile_report[case["id"]]
    assert report["host_syncs"] == [] and report["host_uploads"] == []


def _distinct_attention_modes(steps: list) -> int:
    """Variants the attention kernel needs for these steps: decode (one, whatever the batch:
    its splits are planned on the device) and mixed, per prefill tile shape; nothing that
    changes per step may add one."""
    modes = set()
    for step in steps:
        decode_only = all(q == 1 for q in step["query_lens"])
        modes.add((decode_only, None if decode_only else str(step.get("prefill_tiles"))))
    return len(modes)


SERVING_SCENARIOS = [s for s in SCENARIOS if s["steps"] is SERVING_STEPS]


@pytest.mark.parametrize("case", SERVING_SCENARIOS, ids=[s["id"] for s in SERVING_SCENARIOS])
def test_per_step_integers_do_not_multiply_variants(compile_report: dict, case: dict) -> None:
    """Batches of 1, 17 and 64 sequences with tables 1, 33 and 100 blocks wide (values Triton
    would specialize: 1 and multiples of 16) reuse one compiled variant per mode."""
    variants = compile_report[case["id"]]["variants"]
    by_kernel: dict[str, list] = {}
    for variant in variants:
        by_kernel.setdefault(variant["kernel"], []).append(variant)
    steps = case["steps"]
    assert len(by_kernel["attention"]) == _distinct_attention_modes(steps) == 2
    assert sum(v["launches"] for v in by_kernel["attention"]) == len(steps)
    [decode] = [v for v in by_kernel["attention"] if v["constexprs"]["DECODE"]]
    assert decode["launches"] == 4  # 1 x 1, 17 x 33, 64 x 100 and 1 x 2048: one variant
    assert decode["constexprs"]["MAX_SPLITS"] == MAX_KV_SPLITS
    # One combine variant: the decode steps' and the mixed step whose few query tiles split
    # their keys (100 + 1 + 1 tokens); the 2,048-token chunk does not split.
    [combine] = by_kernel["combine"]
    assert combine["launches"] == 5
    [reshape] = by_kernel["reshape_and_cache"]
    assert reshape["launches"] == len(steps)  # 1 .. 2048 tokens: one variant
    # The layer ops: one variant each whatever the token count (the norm: with and without
    # the residual add).
    assert sorted(v["constexprs"]["HAS_DELTA"] for v in by_kernel["rms_norm"]) == [False, True]
    layer_ops = ("head_rms_norm", "rotary", "rotary_and_cache", "silu_mul")
    assert [len(by_kernel[k]) for k in layer_ops] == [1, 1, 1, 1]
    assert all(v["launches"] == len(steps) for k in ("rms_norm", *layer_ops)
               for v in by_kernel[k])
