"""The float32 CPU linear (kernels/csrc/linear_cpu.cpp) against a float64 torch reference: one
row (a batch-1 decode) to many (prefill), odd sizes (columns past the last full panel of 16 and
pair of panels, row counts past the 6- and 12-row groups), rows strided as the model's slices
are, with and without a bias; each element exactly the float32 FMA chain over k in order (on
AVX2, on AVX-512 and in the portable loop alike); each row's result the same in every batch;
and the engine's linears on it."""

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine_service.model.models.packed_linear import PackedLinear

pytestmark = pytest.mark.usefixtures("cpu_extension")  # fails or skips without it


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    b = None if bias is None else bias.double()
    return F.linear(x.double(), weight.double(), b)


@pytest.mark.parametrize("rows", [0, 1, 5, 6, 7, 12, 13, 25, 70])
# (out_features 20, 100: a last pair of panels with 4 columns in its second, a lone last
# panel after whole pairs, where the AVX-512 path walks panels in pairs)
@pytest.mark.parametrize(("in_features", "out_features"), [(64, 16), (37, 100), (576, 960),
                                                           (9, 3), (19, 20)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_a_float64_reference(rows, in_features, out_features, with_bias):
    generator = torch.Generator().manual_seed(rows * 1000 + in_features + out_features)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator) if with_bias else None
    x = torch.randn(rows, in_features, generator=generator)
    packed = torch.ops.pagedgen_cpu_linear.pack_weight(weight)
    assert packed.shape == (-(-out_features // 16), in_features, 16)
    y = torch.ops.pagedgen_cpu_linear.linear(x, packed, bias, out_features)
    assert y.shape == (rows, out_features) and y.dtype == torch.float32
    # A float32 sum of in_features products: error grows like sqrt(in_features) ulps.
    torch.testing.assert_close(y.double(), _reference(x, weight, bias), atol=1e-4, rtol=1e-5)


def test_strided_rows_and_a_row_result_independent_of_its_batch():
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(200, 96, generator=generator)
    packed = torch.ops.pagedgen_cpu_linear.pack_weight(weight)
    wide = torch.randn(19, 3 * 96, generator=generator)
    x = wide[:, 96:192]  # rows strided: a slice of a wider activation
    assert not x.is_contiguous()
    y = torch.ops.pagedgen_cpu_linear.linear(x, packed, None, 200)
    torch.testing.assert_close(y.double(), _reference(x, weight, None), atol=1e-4, rtol=1e-5)
    # Bit for bit: row i alone, in a batch of 7 and of 19 (other row groups) gives one result.
    for i in (0, 6, 18):
        alone = torch.ops.pagedgen_cpu_linear.linear(x[i : i + 1].contiguous(), packed, None, 200)
        assert torch.equal(alone[0], y[i])
        start = max(0, i - 3)
        part = torch.ops.pagedgen_cpu_linear.linear(x[start : start + 7], packed, None, 200)
        assert torch.equal(part[i - start], y[i])


def _fma_f32(a: np.float32, b: np.float32, c: np.float32) -> np.float32:
    """a * b + c rounded once to float32 (nearest, ties to even), exactly."""
    exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    guess = np.float32(float(exact))  # within one float32 step of the answer
    candidates = [np.nextafter(guess, np.float32(-math.inf)), guess,
                  np.nextafter(guess, np.float32(math.inf))]
    return min(candidates, key=lambda v: (abs(Fraction(float(v)) - exact),
                                          int(v.view(np.int32)) & 1))


def test_each_element_is_the_float32_fma_chain_over_k_in_order():
    """The bits themselves, not a tolerance: y[m][n] = fma(x[m][K-1], w[n][K-1], ... fma(x[m][0],
    w[n][0], 0)), as every path computes it (33 columns: a pair of panels and a lone one)."""
    generator = torch.Generator().manual_seed(8)
    weight = torch.randn(33, 7, generator=generator)
    x = torch.randn(13, 7, generator=generator)
    y = torch.ops.pagedgen_cpu_linear.linear(
        x, torch.ops.pagedgen_cpu_linear.pack_weight(weight), None, 33)
    xs, ws = x.numpy(), weight.numpy()
    expected = np.zeros((13, 33), dtype=np.float32)
    for m in range(13):
        for n in range(33):
            acc = np.float32(0)
            for k in range(7):
                acc = _fma_f32(xs[m, k], ws[n, k], acc)
            expected[m, n] = acc
    assert np.array_equal(y.numpy(), expected)


def test_a_partial_pair_of_panels_independent_of_batch_and_threads():
    generator = torch.Generator().manual_seed(9)
    weight = torch.randn(20, 576, generator=generator)  # panels of 16 and 4 columns
    x = torch.randn(25, 576, generator=generator)
    packed = torch.ops.pagedgen_cpu_linear.pack_weight(weight)
    y = torch.ops.pagedgen_cpu_linear.linear(x, packed, None, 20)
    for start, count in ((0, 1), (5, 12), (3, 13), (0, 25)):
        part = torch.ops.pagedgen_cpu_linear.linear(x[start : start + count], packed, None, 20)
        assert torch.equal(part, y[start : start + count]), (start, count)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(torch.ops.pagedgen_cpu_linear.linear(x, packed, None, 20), y)
    finally:
        torch.set_num_threads(threads)


def test_linear_runs_threaded_as_one_thread():
    generator = torch.Generator().manual_seed(4)
    weight = torch.randn(512, 64, generator=generator)
    x = torch.randn(9, 64, generator=generator)
    packed = torch.ops.pagedgen_cpu_linear.pack_weight(weight)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.pagedgen_cpu_linear.linear(x, packed, None, 512)
        torch.set_num_threads(2)
        two = torch.ops.pagedgen_cpu_linear.linear(x, packed, None, 512)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # panels split over threads; each sum is the same


def test_bad_inputs_are_refused_with_the_reason():
    weight = torch.randn(32, 8)
    packed = torch.ops.pagedgen_cpu_linear.pack_weight(weight)
    with pytest.raises(RuntimeError, match="x has 9 features, the weight 8"):
        torch.ops.pagedgen_cpu_linear.linear(torch.randn(2, 9), packed, None, 32)
    with pytest.raises(RuntimeError, match="out_features 40 does not match 2 panels"):
        torch.ops.pagedgen_cpu_linear.linear(torch.randn(2, 8), packed, None, 40)
    with pytest.raises(RuntimeError, match="x must be float32"):
        torch.ops.pagedgen_cpu_linear.linear(torch.randn(2, 8).double(), packed, None, 32)
    with pytest.raises(RuntimeError, match="bias must be float32"):
        torch.ops.pagedgen_cpu_linear.linear(torch.randn(2, 8), packed, torch.randn(31), 32)
    with pytest.raises(RuntimeError, match="weight must be a 2-d float32"):
        torch.ops.pagedgen_cpu_linear.pack_weight(torch.randn(4, 4, 4))


def test_packed_linear_takes_our_kernel_in_float32_and_keeps_shapes():
    linear = torch.nn.Linear(40, 24, bias=True)
    packed = PackedLinear(linear)
    assert packed.ours
    x = torch.randn(2, 3, 40)  # leading dims are flattened and restored
    with torch.no_grad():
        torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)
        column = torch.randn(5, 80)[:, ::2]  # a last dim that is not contiguous
        torch.testing.assert_close(packed(column), linear(column), atol=1e-5, rtol=1e-5)


def test_packed_linear_takes_onednn_without_our_kernel(monkeypatch):
    """Where the extension does not build, float32 linears run oneDNN's packed path."""
    import engine_service.model.models.packed_linear as packed_linear

    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    monkeypatch.setattr(packed_linear, "_our_kernel_available", lambda dtype=None: False)
    linear = torch.nn.Linear(40, 24, bias=True)
    packed = PackedLinear(linear)
    assert not packed.ours
    x = torch.randn(3, 40)
    with torch.no_grad():
        torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-5)


def test_one_input_feature_and_large_row_counts():
    """A [rows, 1] input is contiguous whatever its strides; 2048 rows (a prefill chunk) run in
    several row blocks, each row as alone."""
    one = torch.nn.Linear(1, 20)
    packed = PackedLinear(one)
    x = torch.randn(5, 3).t()[:, :1]  # [3, 1] with stride 5 along its only column
    with torch.no_grad():
        torch.testing.assert_close(packed(x), one(x), atol=1e-5, rtol=1e-5)
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn(48, 1536, generator=generator)
    x = torch.randn(2048, 1536, generator=generator)
    p = torch.ops.pagedgen_cpu_linear.pack_weight(weight)
    y = torch.ops.pagedgen_cpu_linear.linear(x, p, None, 48)
    torch.testing.assert_close(y.double(), _reference(x, weight, None), atol=2e-4, rtol=1e-5)
    for i in (0, 125, 2047):  # (several row blocks at this width)
        assert torch.equal(torch.ops.pagedgen_cpu_linear.linear(x[i : i + 1], p, None, 48)[0],
                           y[i])
