"""The fused CPU layer ops (kernels/csrc/layer_ops_cpu.cpp) against their torch reference
(kernels/layer_ops.py): float32 and bfloat16, one row (a batch-1 decode) to many (prefill, run
in parallel), rows strided as the qkv projection's slices are."""

import pytest
import torch

from kernels import layer_ops
from kernels.layer_ops import CPU_LAYER_OPS, TORCH_LAYER_OPS

pytestmark = pytest.mark.usefixtures("cpu_extension")  # fails or skips without it

ROWS = (1, 3, 17, 70)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
IDS = lambda v: str(v).replace("torch.", "")  # noqa: E731


@pytest.fixture(autouse=True)
def fused_at_every_row_count(monkeypatch):
    """The wrappers hand float16 batches over TORCH_ABOVE_ROWS to torch; here the
    C++ ops run at every row count (test_torch_runs_past_the_row_limit checks the hand-over)."""
    monkeypatch.setattr(layer_ops, "TORCH_ABOVE_ROWS", 10**9)


def test_torch_runs_past_the_row_limit(monkeypatch):
    monkeypatch.setattr(layer_ops, "TORCH_ABOVE_ROWS", 8)
    for dtype, fused in ((torch.float16, False), (torch.bfloat16, True), (torch.float32, True)):
        x = torch.randn(9, 64).to(dtype)
        weight = torch.ones(64, dtype=dtype)
        residual = x.clone()
        out_residual, _ = CPU_LAYER_OPS.add_rms_norm(residual, x, weight, 1e-5)
        # The fused op adds in place; torch's add is out of place.
        assert (out_residual.data_ptr() == residual.data_ptr()) == fused, dtype


def test_silu_mul_at_the_edges_of_exp() -> None:
    """The vectorized exp clamps past float's range and keeps NaN: silu of +-100, +-inf and
    NaN as torch gives it (x for large x, -0 or a denormal-small negative for very negative x,
    NaN for NaN)."""
    edges = torch.tensor([-1e30, -100.0, -88.5, -87.0, -20.0, -1e-3, 0.0, 1e-3, 20.0, 88.5,
                          100.0, 1e30, float("inf"), float("-inf"), float("nan")])
    for dtype in DTYPES:
        gate_up = torch.cat((edges, torch.full_like(edges, 1.5))).reshape(1, -1).to(dtype)
        got = CPU_LAYER_OPS.silu_mul(gate_up).float()
        expected = TORCH_LAYER_OPS.silu_mul(gate_up).float()
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=2**-7, equal_nan=True)


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """float32: a few ulps (the order of a float32 sum); bf16 / fp16: at most one ulp of the
    dtype, from the same float32 difference landing on the other side of a rounding edge."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
        return
    ulp = 2**-7 if got.dtype == torch.bfloat16 else 2**-10
    torch.testing.assert_close(got.float(), expected.float(), atol=1e-5, rtol=ulp)
    assert (got != expected).float().mean() < 0.02  # nearly every element bit-identical


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_rms_norm_and_add_rms_norm(rows: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rows)
    hidden = 576
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
    delta = torch.randn(rows, hidden, generator=g).to(dtype)
    weight = (1 + torch.randn(hidden, generator=g) * 0.1).to(dtype)
    _close(CPU_LAYER_OPS.rms_norm(x, weight, 1e-5), TORCH_LAYER_OPS.rms_norm(x, weight, 1e-5))
    expected_residual, expected = TORCH_LAYER_OPS.add_rms_norm(x, delta, weight, 1e-5)
    residual = x.clone()
    got_residual, got = CPU_LAYER_OPS.add_rms_norm(residual, delta, weight, 1e-5)
    assert torch.equal(got_residual, expected_residual)  # one rounded add: exact
    assert got_residual.data_ptr() == residual.data_ptr()  # updated in place
    _close(got, expected)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (4, 4, 32), (2, 1, 128)])
def test_rotary_in_place_on_the_qkv_projection(rows, dtype, heads, kv_heads, head_dim) -> None:
    g = torch.Generator().manual_seed(rows * 7 + heads)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(rows, width, generator=g).to(dtype)
    angles = torch.rand(rows, head_dim // 2, generator=g) * 6.3
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1).to(dtype)
    sin = torch.cat((angles.sin(), angles.sin()), dim=-1).to(dtype)
    eq, ek = TORCH_LAYER_OPS.rotary(qkv.clone(), cos, sin, heads, kv_heads, head_dim)
    fused = qkv.clone()
    q, k = CPU_LAYER_OPS.rotary(fused, cos, sin, heads, kv_heads, head_dim)
    _close(q.contiguous(), eq.contiguous())
    _close(k.contiguous(), ek.contiguous())
    assert q.data_ptr() == fused.data_ptr()  # views of the projection, rotated in place
    split = (heads + kv_heads) * head_dim
    assert torch.equal(fused[:, split:], qkv[:, split:])  # v untouched


def _qkv_and_head_weights(rows: int, dtype: torch.dtype, heads: int, kv_heads: int,
                          head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A qkv projection's output, as a strided view (its rows wider than q + k + v), and
    Qwen3's q_norm and k_norm weights."""
    g = torch.Generator().manual_seed(rows * 5 + heads)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = (torch.randn(rows, width + 8, generator=g) * 3).to(dtype)[:, :width]
    q_weight = (1 + torch.randn(head_dim, generator=g) * 0.3).to(dtype)
    k_weight = (1 + torch.randn(head_dim, generator=g) * 0.3).to(dtype)
    return qkv, q_weight, k_weight


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (2, 1, 128)])
def test_head_rms_norm_in_place_on_the_qkv_projection(rows, dtype, heads, kv_heads, head_dim):
    qkv, q_weight, k_weight = _qkv_and_head_weights(rows, dtype, heads, kv_heads, head_dim)
    expected = qkv.clone()
    TORCH_LAYER_OPS.head_rms_norm(expected, q_weight, k_weight, heads, kv_heads, head_dim, 1e-6)
    fused = qkv.clone()
    CPU_LAYER_OPS.head_rms_norm(fused, q_weight, k_weight, heads, kv_heads, head_dim, 1e-6)
    _close(fused, expected)
    split = (heads + kv_heads) * head_dim
    assert torch.equal(fused[:, split:], qkv[:, split:])  # v untouched
    assert not torch.equal(fused[:, :split], qkv[:, :split])


def test_the_head_norm_reference_is_qwen3_s_q_and_k_norm() -> None:
    """The torch reference against HF's own module, applied as Qwen3's attention applies it:
    to each head of q with q_norm's weight, of k with k_norm's."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    heads, kv_heads, head_dim, rows = 4, 2, 32, 5
    for dtype in (torch.float32, torch.bfloat16):
        qkv, q_weight, k_weight = _qkv_and_head_weights(rows, dtype, heads, kv_heads, head_dim)
        hf_q, hf_k = Qwen3RMSNorm(head_dim, eps=1e-6), Qwen3RMSNorm(head_dim, eps=1e-6)
        hf_q.weight.data, hf_k.weight.data = q_weight.clone(), k_weight.clone()
        q = qkv[:, : heads * head_dim].reshape(rows, heads, head_dim)
        k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].reshape(
            rows, kv_heads, head_dim)
        with torch.no_grad():
            expected_q, expected_k = hf_q(q), hf_k(k)
        ours = qkv.clone()
        TORCH_LAYER_OPS.head_rms_norm(ours, q_weight, k_weight, heads, kv_heads, head_dim, 1e-6)
        assert torch.equal(ours[:, : heads * head_dim].reshape(rows, heads, head_dim),
                           expected_q)
        assert torch.equal(ours[:, heads * head_dim : (heads + kv_heads) * head_dim].reshape(
            rows, kv_heads, head_dim), expected_k)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_silu_mul(rows: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 1536, generator=g) * 4).to(dtype)
    _close(CPU_LAYER_OPS.silu_mul(gate_up), TORCH_LAYER_OPS.silu_mul(gate_up))


def test_bad_shapes_are_named() -> None:
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="weight must be contiguous"):
        CPU_LAYER_OPS.rms_norm(x, torch.ones(7), 1e-5)
    with pytest.raises(RuntimeError, match="head_dim must be even"):
        CPU_LAYER_OPS.rotary(torch.randn(2, 12), torch.ones(2, 3), torch.ones(2, 3), 1, 0, 3)
    with pytest.raises(RuntimeError, match="even width"):
        CPU_LAYER_OPS.silu_mul(torch.randn(2, 7))
