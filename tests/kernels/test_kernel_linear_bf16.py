"""The bfloat16 CPU linear (kernels/csrc/linear_bf16_cpu.cpp on AVX512-BF16, linear_bf16_amx.cpp on
AMX tiles where the CPU has them) against a float64 reference of the same bf16 values: one row
(a batch-1 decode) to many (prefill), odd sizes (columns past the last full panel of 32, an odd
feature count, features past the last 32-feature tile, row counts past the 12-row groups and
past one and two 16-row tiles), strided rows, with and without a bias; each row's result the
same in every batch and thread count; its refusals; and the engine's bf16 linears on it
(oneDNN's where it is absent)."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from engine_service.model.dtype import cpu_flags
from engine_service.model.models.packed_linear import PackedLinear
from kernels.cpu_extension import cpu_attention_available

pytestmark = [
    pytest.mark.usefixtures("cpu_extension"),  # fails or skips without it
    # (a CPU fact, asked of the extension only where it loaded)
    pytest.mark.skipif(
        cpu_attention_available() and not torch.ops.pagedgen_cpu_linear.bf16_native(),
        reason="no AVX512-BF16 build here: bf16 linears are oneDNN's",
    ),
]


def pack(weight: torch.Tensor) -> torch.Tensor:
    # (looked up per call: without the extension, torch.ops has no such op to import)
    return torch.ops.pagedgen_cpu_linear.pack_weight(weight)


def linear(x, packed, bias, out_features: int) -> torch.Tensor:
    return torch.ops.pagedgen_cpu_linear.linear(x, packed, bias, out_features)


def _bf16(*shape, generator) -> torch.Tensor:
    return torch.randn(*shape, generator=generator).to(torch.bfloat16)


def _check(y: torch.Tensor, x, weight, bias) -> None:
    """y is the float32 sum rounded once to bf16: within bf16's rounding (2^-8 relative) of the
    exact sum, plus float32's summation error where the sum cancels to near zero."""
    b = None if bias is None else bias.double()
    exact = F.linear(x.double(), weight.double(), b)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), exact, rtol=2**-8, atol=1e-3)


@pytest.mark.parametrize("rows", [0, 1, 11, 12, 13, 20, 50, 70])
@pytest.mark.parametrize(("in_features", "out_features"), [(64, 32), (37, 100), (576, 960),
                                                           (9, 3), (1, 33)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_linear_matches_a_float64_reference(rows, in_features, out_features, with_bias):
    generator = torch.Generator().manual_seed(rows * 1000 + in_features + out_features)
    weight = _bf16(out_features, in_features, generator=generator)
    bias = _bf16(out_features, generator=generator) if with_bias else None
    x = _bf16(rows, in_features, generator=generator)
    packed = pack(weight)
    assert packed.shape == (-(-out_features // 32), (in_features + 1) // 2, 64)
    assert packed.dtype == torch.bfloat16
    y = linear(x, packed, bias, out_features)
    assert y.shape == (rows, out_features)
    _check(y, x, weight, bias)


def test_an_odd_feature_count_ignores_what_lies_past_the_row():
    """The last feature of an odd count is multiplied alone: the value after it in memory (here
    the next row's first, or a NaN) must not reach the sum."""
    generator = torch.Generator().manual_seed(7)
    weight = _bf16(40, 5, generator=generator)
    wide = _bf16(6, 6, generator=generator)
    wide[:, 5] = float("nan")
    x = wide[:, :5]  # rows strided by 6: a NaN right after each row's last feature
    y = linear(x, pack(weight), None, 40)
    assert not y.isnan().any()
    _check(y, x, weight, None)


def test_strided_rows_threads_and_a_row_result_independent_of_its_batch():
    generator = torch.Generator().manual_seed(3)
    weight = _bf16(200, 96, generator=generator)
    packed = pack(weight)
    wide = _bf16(29, 3 * 96, generator=generator)
    x = wide[:, 96:192]
    assert not x.is_contiguous()
    y = linear(x, packed, None, 200)
    _check(y, x, weight, None)
    for i in (0, 11, 12, 28):  # bit for bit alone, and in batches grouped otherwise
        assert torch.equal(linear(x[i : i + 1].contiguous(), packed, None, 200)[0], y[i])
        start = max(0, i - 5)
        assert torch.equal(linear(x[start : start + 13], packed, None, 200)[i - start], y[i])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = linear(x, packed, None, 200)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, y)
    big = _bf16(2048, 96, generator=generator)  # a prefill chunk: several row blocks
    y = linear(big, packed, None, 200)
    for i in (0, 1000, 2047):
        assert torch.equal(linear(big[i : i + 1], packed, None, 200)[0], y[i])


def test_features_past_the_last_tile_and_a_row_result_independent_of_its_batch():
    """101 features: three whole 32-feature tiles, then five (an odd count) summed after them;
    rows in blocks of 32 and tails of 1 to 31 (one or two 16-row tiles on AMX)."""
    generator = torch.Generator().manual_seed(5)
    weight = _bf16(70, 101, generator=generator)
    bias = _bf16(70, generator=generator)
    packed = pack(weight)
    x = _bf16(83, 101, generator=generator)
    y = linear(x, packed, bias, 70)
    _check(y, x, weight, bias)
    for start, count in ((0, 1), (3, 17), (40, 31), (50, 33), (0, 83)):
        part = linear(x[start : start + count], packed, bias, 70)
        assert torch.equal(part, y[start : start + count]), (start, count)


@pytest.mark.skipif("amx_bf16" not in cpu_flags(), reason="no AMX on this CPU")
def test_a_cpu_with_amx_runs_the_tiles():
    """Built with -march=native on an AMX CPU, the kernel uses the tiles (Linux 5.16+ grants
    them on request): a false here means AMX CPUs silently run the slower VDPBF16PS path."""
    assert torch.ops.pagedgen_cpu_linear.bf16_amx()


def test_the_vdpbf16ps_kernel_on_an_amx_cpu_too(tmp_path):
    """PAGEDGEN_CPU_AMX=0 keeps a process on the VDPBF16PS kernel, which CPUs with AVX512-BF16
    and no AMX run (AMD Zen 4, Cooper Lake): this file again on it, and its results within
    bf16 rounding of the AMX kernel's (their last bits may differ: other summation orders)."""
    if not torch.ops.pagedgen_cpu_linear.bf16_amx():
        pytest.skip("AMX not in use here: this file already runs the VDPBF16PS kernel")
    env = dict(os.environ, PAGEDGEN_CPU_AMX="0")
    generator = torch.Generator().manual_seed(11)
    weight, x = _bf16(960, 576, generator=generator), _bf16(40, 576, generator=generator)
    torch.save({"weight": weight, "x": x}, tmp_path / "case.pt")
    script = (
        "import sys, torch\n"
        "from kernels.cpu_extension import build_and_load\n"
        "build_and_load()\n"
        "ops = torch.ops.pagedgen_cpu_linear\n"
        "assert ops.bf16_native() and not ops.bf16_amx(), 'PAGEDGEN_CPU_AMX=0 ignored'\n"
        "case = torch.load(sys.argv[1])\n"
        "y = ops.linear(case['x'], ops.pack_weight(case['weight']), None, 960)\n"
        "torch.save(y, sys.argv[2])\n"
    )
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "case.pt"),
                    str(tmp_path / "y.pt")], env=env, check=True, timeout=300)
    other = torch.load(tmp_path / "y.pt")
    ours = linear(x, pack(weight), None, 960)
    _check(other, x, weight, None)
    torch.testing.assert_close(other.double(), ours.double(), rtol=2**-7, atol=2e-3)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
         "not vdpbf16ps_kernel_on_an_amx and not runs_the_tiles"],
        env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


def test_bad_inputs_are_refused_with_the_reason():
    weight = torch.randn(64, 8).to(torch.bfloat16)
    packed = pack(weight)
    x = torch.randn(2, 8).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="x has 10 features, the weight 4 feature pairs"):
        linear(torch.randn(2, 10).to(torch.bfloat16), packed, None, 64)
    with pytest.raises(RuntimeError, match="out_features 70 does not match 2 panels"):
        linear(x, packed, None, 70)
    with pytest.raises(RuntimeError, match="bias must have out_features \\(64\\) values, got 3"):
        linear(x, packed, torch.randn(3).to(torch.bfloat16), 64)
    with pytest.raises(RuntimeError, match="bias must be float32 or bfloat16, got Double"):
        linear(x, packed, torch.randn(64).double(), 64)
    with pytest.raises(RuntimeError, match="packed must come from pack_weight on a bfloat16"):
        linear(x, pack(torch.randn(64, 8)), None, 64)  # a float32 packing
    with pytest.raises(RuntimeError, match="packed must come from pack_linear_weight"):
        linear(x.float(), packed, None, 64)  # float32 x on a bf16 packing


def test_packed_linear_takes_our_kernel_in_bf16_and_onednn_without_it(monkeypatch):
    import engine_service.model.models.packed_linear as packed_linear

    module = torch.nn.Linear(40, 24, bias=True).to(torch.bfloat16)
    x = torch.randn(2, 3, 40).to(torch.bfloat16)
    ours = PackedLinear(module)
    assert ours.ours
    with torch.no_grad():
        _check(ours(x).view(6, 24), x.view(6, 40), module.weight, module.bias)
    if not torch.backends.mkldnn.is_available():
        return
    monkeypatch.setattr(packed_linear, "_our_kernel_available", lambda dtype=None: False)
    onednn = PackedLinear(module)
    assert not onednn.ours
    with torch.no_grad():
        torch.testing.assert_close(onednn(x).double(), ours(x).double(), rtol=2**-7, atol=1e-2)
