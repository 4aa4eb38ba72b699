"""``deepinfer_ops.topk`` (op ``topk_rows``) against ``refs.topk_ref``: exact values and indices under one tie rule
(higher score first, then lower index), with ties, NaN, -0.0 and infinities; CUDA cases add hard rows, strided
unaligned rows and many rows. Split from test_attention.py."""

from __future__ import annotations

import pytest
import torch

import deepinfer_ops
from deepinfer_ops.testing import refs
from deepinfer_ops.testing.compare import poison_


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _topk_inputs(rows, n, g):
    s = torch.randn(rows, n, generator=g)
    s[0, ::3] = 0.0  # heavy ties (ReLU zeros) at the boundary
    if rows > 1:
        s[1, : n // 2] = -0.0
        s[1, 5::7] = float("nan")
        s[1, 3::11] = float("-inf")
    if rows > 2:
        s[2] = 1.5  # all equal: the lowest indices win
    return s


def _topk_hard_rows(rows, n, k, g):
    """[rows, n] fp32 scores whose row r follows pattern r % 8: 0 ReLU-like zeros (ties at the boundary), 1 -0.0 /
    NaN / -inf mix, 2 all equal, 3 fewer finite entries than k (the rest -inf), 4 a tie value at the threshold spread
    thinly over the whole row (the lowest-index ties win, across every part of the row), 5 the same with the whole row
    in the tie value's top-11-bit radix bin (CUDA: the four-pass path, not the compact one), 6 small integers (ties
    everywhere), 7 all -inf."""
    s = torch.randn(rows, n, generator=g)
    for r in range(rows):
        kind = r % 8
        if kind == 0:
            s[r].clamp_(min=0)
        elif kind == 1:
            s[r, : n // 2] = -0.0
            s[r, 5::7] = float("nan")
            s[r, 3::11] = float("-inf")
        elif kind == 2:
            s[r] = 1.5
        elif kind == 3:
            s[r] = float("-inf")
            pos = torch.randperm(n, generator=g)[: max(0, k // 3)]
            s[r, pos] = torch.randn(pos.numel(), generator=g)
        elif kind == 4:
            s[r] = -1.0 - torch.rand(n, generator=g)
            s[r, :: max(1, n // (2 * max(k, 1)))] = 0.5  # ~2k ties: about half of them are taken
            top = torch.randperm(n, generator=g)[: k // 4]
            s[r, top] = 1.0 + torch.rand(top.numel(), generator=g)
        elif kind == 5:
            s[r] = 1.0 + 0.05 * torch.rand(n, generator=g)  # below the tie value 1.1, in its bin [1, 1.25)
            s[r, 1:: max(1, n // (2 * max(k, 1)))] = 1.1
            top = torch.randperm(n, generator=g)[: k // 4]
            s[r, top] = 1.125 + 0.1 * torch.rand(top.numel(), generator=g)
        elif kind == 6:
            s[r] = torch.randint(0, 50, (n,), generator=g).float()
        elif kind == 7:
            s[r] = float("-inf")
    return s


def _assert_topk_equal(v, i, rv, ri):
    assert torch.equal(i.cpu(), ri.cpu()), "indices differ from the reference"
    assert torch.equal(torch.isnan(v).cpu(), torch.isnan(rv).cpu())
    assert torch.equal(v.cpu().nan_to_num(), rv.cpu().nan_to_num()), "values differ from the reference"
    assert torch.equal(torch.signbit(v).cpu(), torch.signbit(rv).cpu()), "values must be the scores' own bits"


@pytest.mark.parametrize("rows,n,k", [(1, 1, 1), (3, 100, 0), (4, 100, 100), (5, 1000, 37), (3, 5125, 512),
                                     (3, 3000, 1025), (3, 40000, 2048)])  # sort sizes just past / at a power of two
def test_topk_matches_ref_exactly(device, rows, n, k):
    s = _topk_inputs(rows, n, _gen(n + k)).to(device)
    v, i = deepinfer_ops.topk(s, k)
    rv, ri = refs.topk_ref(s, k)
    assert torch.equal(i.cpu(), ri.cpu())
    assert torch.equal(torch.isnan(v).cpu(), torch.isnan(rv).cpu())
    assert torch.equal(v.cpu().nan_to_num(), rv.cpu().nan_to_num())


@pytest.mark.parametrize("rows,n,k", [(16, 777, 1), (16, 777, 100), (8, 4099, 777), (9, 50, 50)])
def test_topk_matches_ref_hard_rows(device, rows, n, k):
    s = _topk_hard_rows(rows, n, k, _gen(n + k)).to(device)
    _assert_topk_equal(*deepinfer_ops.topk(s, k), *refs.topk_ref(s, k))


def test_topk_native_op_poisoned_and_bf16(device):
    s = _topk_inputs(4, 777, _gen(9)).to(device)
    v = poison_(torch.empty(4, 50, device=device))
    i = poison_(torch.empty(4, 50, dtype=torch.int64, device=device))
    torch.ops.deepinfer_ops.topk_rows(v, i, s)
    rv, ri = refs.topk_ref(s, 50)
    assert torch.equal(i.cpu(), ri.cpu()) and torch.equal(v.cpu().nan_to_num(), rv.cpu().nan_to_num())
    sb = s.bfloat16()
    vb, ib = deepinfer_ops.topk(sb, 50)
    rvb, rib = refs.topk_ref(sb, 50)
    assert vb.dtype == torch.bfloat16 and torch.equal(ib.cpu(), rib.cpu())


@pytest.mark.cuda
@pytest.mark.parametrize("rows,n,k", [
    (1, 262144, 2048), (2, 262144, 512), (64, 262144, 2048), (8, 131072, 2048), (4, 32768, 512), (64, 32768, 512),
    (3, 65536, 2048), (7, 100003, 1000), (16, 4097, 2048), (33, 777, 13), (5, 5000, 1000), (2, 1, 1), (3, 2048, 2048),
    (9, 3, 2), (8, 65537, 1), (8, 40000, 2047),
    # one CTA per row (n <= 32768; 256 threads up to n = 2048), chunks then a merge just past it, and past the
    # merge's 16384 candidates (the multi-CTA radix path)
    (4, 8192, 512), (6, 32768, 2048), (3, 32769, 700), (2, 2049, 1500), (8, 16384, 1),
    (2, 262145, 2048), (3, 600000, 1000),
    # one warp per row (n <= 1024, k <= 32: the router), at its limits and just past them
    (300, 256, 6), (64, 1024, 32), (40, 1000, 31), (9, 257, 16), (5, 33, 32), (301, 256, 8), (8, 1025, 32),
    (8, 1024, 33)])
def test_cuda_topk_matches_ref_hard_rows(rows, n, k):
    # Every row pattern of _topk_hard_rows at rows 1..64 and n up to 262144 (prime and odd n included), against the
    # stable-sort reference: indices and value bits equal.
    s = _topk_hard_rows(rows, n, k, _gen(n * 7 + k + rows)).to("cuda")
    v, i = deepinfer_ops.topk(s, k)
    _assert_topk_equal(v, i, *refs.topk_ref(s, k))
    v2, i2 = deepinfer_ops.topk(s, k)  # reruns: the same bits
    assert torch.equal(i, i2) and torch.equal(v.nan_to_num(), v2.nan_to_num())
    for r in (0, rows - 1):  # one row alone (another grid shape) gives that row's result
        v1, i1 = deepinfer_ops.topk(s[r:r + 1].contiguous(), k)
        assert torch.equal(i1, i[r:r + 1]) and torch.equal(v1.nan_to_num(), v[r:r + 1].nan_to_num())


@pytest.mark.cuda
@pytest.mark.parametrize("rows,n,k,offset", [(5, 70001, 2048, 1), (3, 262143, 777, 3), (4, 9, 9, 2)])
def test_cuda_topk_row_strided_unaligned(rows, n, k, offset):
    # A row-strided view whose rows start off 16-byte alignment (no vector loads) gives the reference's result.
    base = _topk_hard_rows(rows, n + 5, k, _gen(n + offset)).to("cuda")
    s = base[:, offset:offset + n]
    v = poison_(torch.empty(rows, k, device="cuda"))
    i = poison_(torch.empty(rows, k, dtype=torch.int64, device="cuda"))
    torch.ops.deepinfer_ops.topk_rows(v, i, s)
    _assert_topk_equal(v, i, *refs.topk_ref(s, k))


@pytest.mark.cuda
def test_cuda_topk_many_rows():
    # More rows than the launcher's row group (and the GPU's SMs): every group gets its own workspace pass.
    s = _topk_hard_rows(1100, 3001, 300, _gen(700)).to("cuda")
    v, i = deepinfer_ops.topk(s, 300)
    _assert_topk_equal(v, i, *refs.topk_ref(s, 300))


def test_topk_rejects_bad_k():
    with pytest.raises(ValueError, match="outside"):
        deepinfer_ops.topk(torch.zeros(2, 3), 4)
