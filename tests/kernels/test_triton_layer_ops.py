"""The Triton layer ops (kernels/triton_layer_ops.py, CUDA's) against the torch reference
(kernels/layer_ops.py), in Triton's interpreter here: float32, bfloat16 and float16, a decode
row and a prefill's many, one launch per call, the residual and q / k updated in place."""

import pytest
import torch

from kernels.launch_counter import launch_counter
from kernels.layer_ops import TORCH_LAYER_OPS
from kernels.triton_layer_ops import TRITON_LAYER_OPS

ROWS = (1, 17)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
IDS = lambda v: str(v).replace("torch.", "")  # noqa: E731


def _close(got: torch.Tensor, expected: torch.Tensor, ulps: int = 1) -> None:
    """float32: a few ulps (a float32 sum's order); 16-bit: at most `ulps` ulps of the dtype,
    and nearly every element bit-identical (the same roundings in the same places)."""
    assert got.dtype == expected.dtype and got.shape == expected.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
        return
    ulp = 2**-7 if got.dtype == torch.bfloat16 else 2**-10
    torch.testing.assert_close(got.float(), expected.float(), atol=1e-5, rtol=ulps * ulp)
    assert (got != expected).float().mean() < 0.02


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_rms_norm_and_add_rms_norm(rows: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rows)
    hidden = 576  # not a power of two: the masked tail
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
    delta = torch.randn(rows, hidden, generator=g).to(dtype)
    weight = (1 + torch.randn(hidden, generator=g) * 0.1).to(dtype)
    with launch_counter() as launches:
        _close(TRITON_LAYER_OPS.rms_norm(x, weight, 1e-5),
               TORCH_LAYER_OPS.rms_norm(x, weight, 1e-5))
        expected_residual, expected = TORCH_LAYER_OPS.add_rms_norm(x, delta, weight, 1e-5)
        residual = x.clone()
        got_residual, got = TRITON_LAYER_OPS.add_rms_norm(residual, delta, weight, 1e-5)
    assert torch.equal(got_residual, expected_residual)  # one rounded add: exact
    assert got_residual.data_ptr() == residual.data_ptr()  # updated in place
    _close(got, expected)
    assert launches == {"rms_norm": 1, "add_rms_norm": 1}


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (2, 1, 128), (3, 1, 24)])
def test_rotary_in_place_on_the_qkv_projection(rows, dtype, heads, kv_heads, head_dim) -> None:
    g = torch.Generator().manual_seed(rows * 7 + heads)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(rows, width, generator=g).to(dtype)
    angles = torch.rand(rows, head_dim // 2, generator=g) * 6.3
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1).to(dtype)
    sin = torch.cat((angles.sin(), angles.sin()), dim=-1).to(dtype)
    eq, ek = TORCH_LAYER_OPS.rotary(qkv.clone(), cos, sin, heads, kv_heads, head_dim)
    fused = qkv.clone()
    with launch_counter() as launches:
        q, k = TRITON_LAYER_OPS.rotary(fused, cos, sin, heads, kv_heads, head_dim)
    assert launches == {"rotary": 1}
    _close(q.contiguous(), eq.contiguous())
    _close(k.contiguous(), ek.contiguous())
    assert q.data_ptr() == fused.data_ptr()  # views of the projection, rotated in place
    split = (heads + kv_heads) * head_dim
    assert torch.equal(fused[:, split:], qkv[:, split:])  # v untouched


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (3, 1, 24)])
def test_head_rms_norm_in_place_on_the_qkv_projection(rows, dtype, heads, kv_heads, head_dim):
    g = torch.Generator().manual_seed(rows * 5 + heads)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = (torch.randn(rows, width, generator=g) * 3).to(dtype)
    q_weight = (1 + torch.randn(head_dim, generator=g) * 0.3).to(dtype)
    k_weight = (1 + torch.randn(head_dim, generator=g) * 0.3).to(dtype)
    expected = qkv.clone()
    TORCH_LAYER_OPS.head_rms_norm(expected, q_weight, k_weight, heads, kv_heads, head_dim, 1e-6)
    got = qkv.clone()
    with launch_counter() as launches:
        TRITON_LAYER_OPS.head_rms_norm(got, q_weight, k_weight, heads, kv_heads, head_dim, 1e-6)
    assert launches == {"head_rms_norm": 1}
    _close(got, expected)
    split = (heads + kv_heads) * head_dim
    assert torch.equal(got[:, split:], qkv[:, split:])  # v untouched


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_silu_mul(rows: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 1536, generator=g) * 4).to(dtype)
    with launch_counter() as launches:
        # Two ulps: SiLU is rounded to the dtype before the product, and where the float32
        # exp (numpy's here, libm's in torch) differs in its last bit, that first rounding can
        # flip, and the product carries the flipped ulp on top of its own rounding.
        _close(TRITON_LAYER_OPS.silu_mul(gate_up), TORCH_LAYER_OPS.silu_mul(gate_up), ulps=2)
    assert launches == {"silu_mul": 1}


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # numpy, in the interpreter
def test_silu_mul_at_the_edges_of_exp() -> None:
    edges = torch.tensor([-1e30, -100.0, -88.5, -20.0, -1e-3, 0.0, 1e-3, 20.0, 88.5, 100.0,
                          1e30, float("inf"), float("nan")])
    gate_up = torch.cat((edges, torch.full_like(edges, 1.5))).reshape(1, -1)
    torch.testing.assert_close(TRITON_LAYER_OPS.silu_mul(gate_up),
                               TORCH_LAYER_OPS.silu_mul(gate_up), equal_nan=True)


def test_empty_batches_and_bad_shapes() -> None:
    assert TRITON_LAYER_OPS.rms_norm(torch.empty(0, 8), torch.ones(8), 1e-5).shape == (0, 8)
    assert TRITON_LAYER_OPS.silu_mul(torch.empty(0, 8)).shape == (0, 4)
    with pytest.raises(ValueError, match="even head_dim"):
        TRITON_LAYER_OPS.rotary(torch.randn(2, 12), torch.ones(2, 3), torch.ones(2, 3), 1, 0, 3)
    with pytest.raises(ValueError, match="even width"):
        TRITON_LAYER_OPS.silu_mul(torch.randn(2, 7))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (2, 1, 128), (4, 4, 24)])
def test_rotary_and_cache_is_rotary_then_the_cache_write(dtype, heads, kv_heads, head_dim):
    """The fused op leaves q, the cache's K and V exactly where rotary followed by
    reshape_and_cache leaves them (the torch reference for both), padding tokens (slot -1)
    written nowhere, other slots untouched."""
    from kernels import reference
    from kernels.triton_layer_ops import rotary_and_cache

    g = torch.Generator().manual_seed(heads * 31 + head_dim)
    tokens, block_size, num_blocks = 7, 4, 6
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    angles = torch.rand(tokens, head_dim // 2, generator=g) * 6.3
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1).to(dtype)
    sin = torch.cat((angles.sin(), angles.sin()), dim=-1).to(dtype)
    slots = torch.tensor([5, 0, 13, -1, 22, 9, 3], dtype=torch.int64)
    cache_shape = (num_blocks, block_size, kv_heads, head_dim)
    caches = [torch.randn(cache_shape, generator=g).to(dtype) for _ in range(2)]

    expected_qkv, expected_k, expected_v = qkv.clone(), caches[0].clone(), caches[1].clone()
    q, k = TORCH_LAYER_OPS.rotary(expected_qkv, cos, sin, heads, kv_heads, head_dim)
    v = expected_qkv[:, (heads + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    reference.reshape_and_cache(k, v, expected_k, expected_v, slots)

    got_qkv, got_k, got_v = qkv.clone(), caches[0].clone(), caches[1].clone()
    with launch_counter() as launches:
        got_q = rotary_and_cache(got_qkv, cos, sin, heads, kv_heads, head_dim, got_k, got_v,
                                 slots)
    assert launches == {"rotary_and_cache": 1}
    assert got_q.data_ptr() == got_qkv.data_ptr()
    _close(got_q.contiguous(), q.contiguous())
    _close(got_k, expected_k)
    assert torch.equal(got_v, expected_v)  # copied, not computed
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slots[slots >= 0]] = True
    untouched = ~written.view(num_blocks, block_size)
    assert torch.equal(got_k[untouched], caches[0][untouched])
    assert torch.equal(got_v[untouched], caches[1][untouched])
