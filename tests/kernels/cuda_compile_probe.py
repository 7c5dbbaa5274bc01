"""Compile the Triton kernels for a CUDA target, no GPU needed: run by test_kernel_cuda_compile.

Run as a script (`python tests/kernels/cuda_compile_probe.py '<json scenarios>'`) in a fresh
process, because the test process defines the kernels for the interpreter. Here they are
defined compiled (torch.cuda.is_available is made to answer True before they are imported),
and each kernel's launch is captured instead of run: the host wrappers (paged_attention,
reshape_and_cache, copy_blocks, the layer ops) are called with CPU tensors of the scenario's
shapes, so every argument, constexpr and grid is exactly what the engine would pass. Each
captured launch is then specialized the way Triton's JITFunction.run does it (its binder:
integer values of 1 and multiples of 16, 16-byte pointer alignment, minus
do_not_specialize), the distinct variants are compiled for the target with triton.compile,
and ptxas -v reports registers and spills.

The wrappers' own host work is counted too (tests/support/step_ops.py): on CUDA they must
neither wait for the device nor upload host data, since they run once per layer and step.

Prints one JSON object on the last line:
{scenario: {"variants": [...], "host_syncs": [...], "host_uploads": [...]}}.
"""

import json
import re
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import torch

torch.cuda.is_available = lambda: True  # kernels.triton_jit: define compiled kernels

import triton  # noqa: E402
from triton import knobs  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.nvidia.compiler import get_ptxas  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

from kernels import triton_attention, triton_cache_ops, triton_layer_ops  # noqa: E402
from kernels.attention_splits import PROGRAMS_PER_SM, KVSplitPolicy  # noqa: E402
from kernels.attention_tiles import PrefillTiles  # noqa: E402
from tests.support.step_ops import StepOps, count_ops  # noqa: E402

KERNELS = {
    "attention": triton_attention.paged_attention_kernel,
    "combine": triton_attention._combine_splits_kernel,
    "reshape_and_cache": triton_cache_ops.reshape_and_cache_kernel,
    "copy_blocks": triton_cache_ops.copy_blocks_kernel,
    **triton_layer_ops.JIT_KERNELS,  # rms_norm (with and without the residual add),
}                                    # head_rms_norm, rotary, rotary_and_cache, silu_mul
# The policy a CUDA device gets (kernels/attention_splits.default_split_policy: CPU tensors
# here would get none): an H200's 132 SMs.
GPU_SPLITS = KVSplitPolicy(target_programs=PROGRAMS_PER_SM * 132)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
PTXAS_USAGE = re.compile(r"Used (\d+) registers")
PTXAS_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, "
                          r"(\d+) bytes spill loads")


def capture_launches() -> list[tuple[str, tuple, dict]]:
    launches: list[tuple[str, tuple, dict]] = []
    for name, kernel in KERNELS.items():
        def run(*args, grid, warmup, _name=name, **kwargs):
            launches.append((_name, args, kwargs))
        kernel.run = run  # JITFunction.__getitem__ calls self.run(grid=..., warmup=False, ...)
    return launches


def drive(scenario: dict, host_ops: StepOps) -> None:
    """Call the host wrappers with the scenario's shapes, as the model runner would; what the
    wrappers themselves ask of the device (syncs, uploads) is counted into host_ops."""
    dtype, cache_dtype = DTYPES[scenario["dtype"]], DTYPES[scenario["cache_dtype"]]
    heads, kv_heads, head = scenario["num_heads"], scenario["num_kv_heads"], scenario["head_size"]
    block_size, num_blocks = scenario["block_size"], 64
    kv_caches = torch.zeros(2, 2, num_blocks, block_size, kv_heads, head, dtype=cache_dtype)
    key_cache, value_cache = kv_caches[0, 0], kv_caches[0, 1]
    for step in scenario["steps"]:
        query_lens, max_blocks = step["query_lens"], step["max_blocks"]
        num_seqs, num_tokens = len(query_lens), sum(query_lens)
        # The runner's fused qkv output: k and v are strided views of one [T, q + 2 kv] row.
        qkv = torch.zeros(num_tokens, (heads + 2 * kv_heads) * head, dtype=dtype)
        query = qkv[:, : heads * head].reshape(num_tokens, heads, head).contiguous()
        key = qkv[:, heads * head : (heads + kv_heads) * head].view(num_tokens, kv_heads, head)
        value = qkv[:, (heads + kv_heads) * head :].view(num_tokens, kv_heads, head)
        starts = [0]
        for q in query_lens:
            starts.append(starts[-1] + q)
        block_tables = torch.zeros(num_seqs, max_blocks, dtype=torch.int32)
        seq_lens = torch.full((num_seqs,), max_blocks * block_size, dtype=torch.int32)
        query_start_loc = torch.tensor(starts, dtype=torch.int32)
        slots = torch.arange(num_tokens, dtype=torch.int64)
        mapping = torch.tensor([[0, 1], [2, 3]])
        with count_ops(host_ops):
            triton_cache_ops.reshape_and_cache(key, value, key_cache, value_cache, slots)
            tiles = step.get("prefill_tiles")
            triton_attention.paged_attention(
                query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                head**-0.5, kv_splits=GPU_SPLITS,
                prefill_tiles=PrefillTiles(*tiles) if tiles else None,
            )
            triton_cache_ops.copy_blocks(kv_caches, mapping)
            drive_layer_ops(qkv, heads, kv_heads, head)


def drive_layer_ops(qkv: torch.Tensor, heads: int, kv_heads: int, head: int) -> None:
    """The layer ops on a step of these shapes: hidden = heads x head, the MLP 3.5x wider."""
    num_tokens, dtype = qkv.shape[0], qkv.dtype
    hidden = heads * head
    x = torch.zeros(num_tokens, hidden, dtype=dtype)
    weight = torch.ones(hidden, dtype=dtype)
    triton_layer_ops.rms_norm(x, weight, 1e-5)
    triton_layer_ops.add_rms_norm(x, x.clone(), weight, 1e-5)
    cos = torch.zeros(num_tokens, head, dtype=dtype)
    triton_layer_ops.head_rms_norm(qkv, torch.ones(head, dtype=dtype),
                                   torch.ones(head, dtype=dtype), heads, kv_heads, head, 1e-6)
    triton_layer_ops.rotary(qkv, cos, cos.clone(), heads, kv_heads, head)
    caches = torch.zeros(2, 8, 16, kv_heads, head, dtype=dtype)
    triton_layer_ops.rotary_and_cache(qkv, cos, cos.clone(), heads, kv_heads, head, caches[0],
                                      caches[1], torch.arange(num_tokens) % 128)
    triton_layer_ops.silu_mul(torch.zeros(num_tokens, 7 * hidden, dtype=dtype))


def ptxas_report(ptx: str, arch: int) -> dict:
    ptxas = get_ptxas(arch).path  # the one triton.compile used for this arch
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "kernel.ptx"
        source.write_text(ptx)
        arch_name = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        done = subprocess.run(
            [ptxas, "-v", "--regAllocOptLevel=2", f"--gpu-name={arch_name}", str(source),
             "-o", str(Path(tmp) / "kernel.o")],
            capture_output=True, text=True, check=True,
        )
    log = done.stdout + done.stderr
    stack, spill_stores, spill_loads = map(int, PTXAS_SPILLS.search(log).groups())
    return {"registers": int(PTXAS_USAGE.search(log).group(1)), "stack_bytes": stack,
            "spill_store_bytes": spill_stores, "spill_load_bytes": spill_loads}


def compile_variants(launches: list, arch: int) -> list[dict]:
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    variants: dict[tuple, dict] = {}
    for name, args, kwargs in launches:
        kernel = KERNELS[name]
        # What JITFunction.run does before it looks a launch up in its cache.
        kwargs = dict(kwargs, debug=knobs.runtime.debug,
                      instrumentation_mode=knobs.compilation.instrumentation_mode,
                      fpsan_homomorphic_casts=knobs.compilation.fpsan_homomorphic_casts)
        binder = create_function_from_signature(kernel.signature, kernel.params, backend)
        bound_args, specialization, options = binder(*args, **kwargs)
        key = (name, str(specialization), str(options))
        if key in variants:
            variants[key]["launches"] += 1
            continue
        entry = {"kernel": name, "launches": 1, "specialization": str(specialization),
                 "constexprs": {k: v for k, v in kwargs.items() if k.isupper()}}
        variants[key] = entry
        try:
            options, signature, constexprs, attrs = kernel._pack_args(
                backend, kwargs, bound_args, specialization, options)
            compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs),
                                      target=target, options=options.__dict__)
            entry["cubin_bytes"] = len(compiled.asm["cubin"])
            entry["shared_bytes"] = compiled.metadata.shared
            entry["num_warps"] = compiled.metadata.num_warps
            entry.update(ptxas_report(compiled.asm["ptx"], arch))
        except Exception:
            entry["error"] = traceback.format_exc()[-4000:]
    return list(variants.values())


def main() -> None:
    launches = capture_launches()
    report = {}
    for scenario in json.loads(sys.argv[1]):
        launches.clear()
        try:
            host_ops = StepOps()
            drive(scenario, host_ops)
            report[scenario["id"]] = {
                "variants": compile_variants(launches, scenario["arch"]),
                "host_syncs": host_ops.get("step").syncs,
                "host_uploads": host_ops.get("step").uploads,
            }
        except Exception:
            report[scenario["id"]] = {"error": traceback.format_exc()[-4000:]}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
