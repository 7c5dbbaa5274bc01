"""The CUDA path of every kernel compiles (Triton -> PTX -> cubin with ptxas), without a GPU.

The interpreter checks the kernels' arithmetic but not what only the compiler enforces: types
carried through loops, tl.dot's minimum tile sizes, constexpr branches, register/shared-memory
limits. triton.compile for an explicit GPUTarget needs no device, so this runs on any machine.
It runs in a subprocess because this process defines the kernels interpreted.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]

ATTENTION = "kernels.triton_attention:paged_attention_kernel"
COMBINE = "kernels.triton_attention:_combine_splits_kernel"
RESHAPE = "kernels.triton_cache_ops:reshape_and_cache_kernel"
COPY = "kernels.triton_cache_ops:copy_blocks_kernel"
ATTENTION_PTRS = {
    "partial_acc_ptr": "*fp32", "partial_max_ptr": "*fp32", "partial_sum_ptr": "*fp32",
    "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "query_start_loc_ptr": "*i32",
    "scale_log2": "fp32",
}

# (id, kernel, arch, pointer / float argument types, constexprs); other arguments are i32.
CASES = [
    ("attention-prefill-fp16-h80-sm90", ATTENTION, 90,
     {**ATTENTION_PTRS, "out_ptr": "*fp16", "query_ptr": "*fp16", "key_cache_ptr": "*fp16",
      "value_cache_ptr": "*fp16"},
     {"QUERIES_PER_KV": 4, "HEAD_SIZE": 80, "HEAD_PAD": 128, "BLOCK_SIZE": 16, "TILE_N": 32,
      "BLOCK_M": 64, "BLOCK_Q": 16, "NUM_SPLITS": 1, "DOT_PRECISION": "tf32",
      "DOT_IN_FP32": False}),
    ("attention-decode-split-bf16-gqa7-sm90", ATTENTION, 90,
     {**ATTENTION_PTRS, "out_ptr": "*bf16", "query_ptr": "*bf16", "key_cache_ptr": "*bf16",
      "value_cache_ptr": "*bf16"},
     {"QUERIES_PER_KV": 7, "HEAD_SIZE": 128, "HEAD_PAD": 128, "BLOCK_SIZE": 32, "TILE_N": 32,
      "BLOCK_M": 16, "BLOCK_Q": 2, "NUM_SPLITS": 8, "DOT_PRECISION": "tf32",
      "DOT_IN_FP32": False}),
    ("attention-fp32-ieee-h96-block8-sm80", ATTENTION, 80,
     {**ATTENTION_PTRS, "out_ptr": "*fp32", "query_ptr": "*fp32", "key_cache_ptr": "*fp32",
      "value_cache_ptr": "*fp32"},
     {"QUERIES_PER_KV": 1, "HEAD_SIZE": 96, "HEAD_PAD": 128, "BLOCK_SIZE": 8, "TILE_N": 32,
      "BLOCK_M": 64, "BLOCK_Q": 64, "NUM_SPLITS": 1, "DOT_PRECISION": "ieee",
      "DOT_IN_FP32": False}),
    ("combine-splits-fp16-sm90", COMBINE, 90,
     {"out_ptr": "*fp16", "partial_acc_ptr": "*fp32", "partial_max_ptr": "*fp32",
      "partial_sum_ptr": "*fp32"},
     {"HEAD_SIZE": 96, "HEAD_PAD": 128, "NUM_SPLITS": 8}),
    ("reshape-and-cache-fp32-into-bf16-sm90", RESHAPE, 90,
     {"key_ptr": "*fp32", "value_ptr": "*fp32", "key_cache_ptr": "*bf16",
      "value_cache_ptr": "*bf16", "slot_mapping_ptr": "*i64"},
     {"HEAD_SIZE": 80, "HEAD_PAD": 128, "BLOCK_SIZE": 16, "ROWS": 16}),
    ("copy-blocks-fp16-sm90", COPY, 90,
     {"kv_caches_ptr": "*fp16", "block_mapping_ptr": "*i64"},
     {"BLOCK_NUMEL": 16384, "CHUNK": 4096}),
]

COMPILE_SCRIPT = textwrap.dedent(
    """
    import importlib, json, sys, traceback
    import torch
    torch.cuda.is_available = lambda: True  # make kernels.triton_jit define compiled kernels
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    report = {}
    for case_id, kernel_ref, arch, types, constexprs in json.loads(sys.argv[1]):
        try:
            module, name = kernel_ref.split(":")
            kernel = getattr(importlib.import_module(module), name)
            signature = {
                arg: "constexpr" if arg in constexprs else types.get(arg, "i32")
                for arg in kernel.arg_names
            }
            compiled = triton.compile(
                ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", arch, 32)
            )
            report[case_id] = {"cubin_bytes": len(compiled.asm["cubin"]),
                               "shared": compiled.metadata.shared}
        except Exception:
            report[case_id] = {"error": traceback.format_exc()[-4000:]}
    print(json.dumps(report))
    """
)


@pytest.fixture(scope="module")
def compile_report() -> dict:
    """Compile every case in one subprocess (one torch import instead of one per case)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    result = subprocess.run(
        [sys.executable, "-c", COMPILE_SCRIPT, json.dumps(CASES)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, env=env,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case_id", [case[0] for case in CASES])
def test_kernel_compiles_for_cuda(compile_report: dict, case_id: str) -> None:
    report = compile_report[case_id]
    assert "error" not in report, report.get("error")
    assert report["cubin_bytes"] > 0
    # Fits the smallest shared memory of the targets (sm_80: 163 KB per block).
    assert report["shared"] <= 163 * 1024
