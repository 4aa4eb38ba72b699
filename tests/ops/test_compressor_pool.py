"""``compressor_pool`` (CSA / HCA window pooling) against ``refs.compressor_pool_ref``: dtypes, strided inputs,
batch invariance, edge cases, bad inputs and overflow. Split from test_attention.py."""

from __future__ import annotations

import pytest
import torch

import deepinfer_ops
from deepinfer_ops.testing import refs
from deepinfer_ops.testing.compare import TOLERANCES, assert_close, poison_


@pytest.mark.parametrize("n,S,hd", [(1, 8, 512), (37, 8, 512), (5, 128, 512), (3, 4, 128), (9, 5, 7), (2, 1, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compressor_pool_matches_reference(device, n, S, hd, dtype):
    g = torch.Generator().manual_seed(n * 13 + S + hd)
    kv = torch.randn(n, S, hd, generator=g).to(dtype).to(device)
    gate = (torch.randn(n, S, hd, generator=g) * 3).to(device)
    if S > 1:
        gate[:, 0, ::3] = float("-inf")  # unused slots (CSA window 0): weight 0
    out = poison_(torch.empty(n, hd, dtype=dtype, device=device))
    torch.ops.deepinfer_ops.compressor_pool(out, kv, gate)
    assert_close(out, refs.compressor_pool_ref(kv, gate), TOLERANCES[dtype], name="compressor_pool")


def test_compressor_pool_strided_inputs_and_batch_invariance(device):
    """kv / gate as views with gaps (the model passes slices of wider projections) give the contiguous result, and
    a window's entry is the same bits whichever windows share the call."""
    g = torch.Generator().manual_seed(3)
    wide_kv = torch.randn(40, 4, 2 * 512, generator=g).bfloat16().to(device)
    wide_gate = torch.randn(40, 4, 2 * 512, generator=g).to(device)
    kv, gate = wide_kv[..., 512:], wide_gate[..., 512:]
    full = deepinfer_ops.compressor_pool(kv, gate)
    assert torch.equal(full, deepinfer_ops.compressor_pool(kv.contiguous(), gate.contiguous()))
    for lo, hi in ((0, 1), (7, 8), (3, 29), (39, 40)):
        assert torch.equal(deepinfer_ops.compressor_pool(kv[lo:hi].clone(), gate[lo:hi].clone()), full[lo:hi])


def test_compressor_pool_edge_cases(device):
    assert deepinfer_ops.compressor_pool(torch.empty(0, 8, 512, device=device),
                                         torch.empty(0, 8, 512, device=device)).shape == (0, 512)
    kv = torch.randn(2, 3, 4, device=device)
    gate = torch.zeros(2, 3, 4, device=device)
    gate[0] = float("-inf")  # every slot unused: NaN, as softmax
    out = deepinfer_ops.compressor_pool(kv, gate)
    assert torch.isnan(out[0]).all()
    assert_close(out[1], kv[1].mean(dim=0), TOLERANCES[torch.float32], name="compressor_pool")  # equal gates: mean
    empty_slots = deepinfer_ops.compressor_pool(torch.empty(2, 0, 4, device=device),
                                                torch.empty(2, 0, 4, device=device))
    assert torch.isnan(empty_slots).all()


@pytest.mark.native_errors
def test_compressor_pool_bad_inputs(device):
    kv = torch.randn(3, 8, 16, device=device)
    gate = torch.randn(3, 8, 16, device=device)
    with pytest.raises(RuntimeError, match="gate must be torch.float32"):
        deepinfer_ops.compressor_pool(kv, gate.bfloat16())
    with pytest.raises(RuntimeError, match="gate shape"):
        deepinfer_ops.compressor_pool(kv, gate[:, :4])
    with pytest.raises(RuntimeError, match="kv must be contiguous in its last dim"):
        deepinfer_ops.compressor_pool(kv.transpose(1, 2), gate.transpose(1, 2))
    with pytest.raises(RuntimeError, match="out must be torch.bfloat16"):
        torch.ops.deepinfer_ops.compressor_pool(torch.empty(3, 16, device=device), kv.bfloat16(), gate)
    with pytest.raises(RuntimeError, match="out and kv share memory"):
        torch.ops.deepinfer_ops.compressor_pool(kv[0, :3], kv, gate)
    with pytest.raises(ValueError, match="kv must be"):
        deepinfer_ops.compressor_pool(kv[0], gate[0])


def test_compressor_pool_opcheck(device):
    torch.library.opcheck(torch.ops.deepinfer_ops.compressor_pool.default,
                          (torch.empty(3, 16, dtype=torch.bfloat16, device=device),
                           torch.randn(3, 8, 16, dtype=torch.bfloat16, device=device),
                           torch.randn(3, 8, 16, device=device)))


def test_compressor_pool_reference_without_slots_is_nan(device):
    """S == 0: the op gives NaN (0 / 0, as its docstring says); the reference gave 0 (a sum over no slots)."""
    kv, gate = torch.empty(2, 0, 5, device=device), torch.empty(2, 0, 5, device=device)
    assert torch.isnan(refs.compressor_pool_ref(kv, gate)).all()
    assert torch.isnan(deepinfer_ops.compressor_pool(kv, gate)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compressor_pool_huge_kv_does_not_overflow(device, dtype):
    """|kv| near FLT_MAX: the exp-weighted sum overflowed (inf) although the weighted mean is finite; those entries
    are redone scaled by a power of two. A window gives the same bits alone or among others, and an inf kv with
    weight > 0 still gives inf."""
    g = torch.Generator().manual_seed(4)
    n, S, hd = 4, 8, 16
    kv = torch.randn(n, S, hd, generator=g)
    kv[0] = 3e38  # every slot huge, same sign: the mean is 3e38
    kv[1, :, :8] = 3e38
    kv[1, ::2, 8:] = -3e38  # huge, both signs
    kv[1, 1::2, 8:] = 3e38
    kv[2, 3, 5] = float("inf")
    kv = kv.to(dtype).to(device)
    gate = (torch.randn(n, S, hd, generator=g) * 2).to(device)
    gate[1, :, 8:] = 0.5  # equal gates: the +-3e38 slots cancel exactly
    out = deepinfer_ops.compressor_pool(kv, gate)
    ref = refs.compressor_pool_ref(kv, gate)
    assert torch.isfinite(out[:2]).all(), out[:2]
    assert_close(out[:2].float() / 1e38, ref[:2].float() / 1e38, TOLERANCES[dtype], name="compressor_pool huge")
    assert out[2, 5] == float("inf")
    for w in range(n):  # a window's bits do not depend on the windows sharing the call (fallback or not)
        assert torch.equal(deepinfer_ops.compressor_pool(kv[w:w + 1].clone(), gate[w:w + 1].clone())[0], out[w]), w
