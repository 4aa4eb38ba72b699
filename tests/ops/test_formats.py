"""deepinfer_ops.formats: UE8M0, FP8 block and FP4 e2m1 against element-by-element Python references (math.ldexp,
a dict of e2m1 values), batched shapes equal to the per-matrix results, and the errors that name the argument."""

from __future__ import annotations

import math

import pytest
import torch

from deepinfer_ops import formats as F

E2M1 = {0: 0.0, 1: 0.5, 2: 1.0, 3: 1.5, 4: 2.0, 5: 3.0, 6: 4.0, 7: 6.0}


def py_e8m0(byte: int) -> float:
    return float("nan") if byte == 255 else math.ldexp(1.0, byte - 127)


def py_e2m1(code: int) -> float:
    return -E2M1[code & 7] if code & 8 else E2M1[code]


def test_ue8m0_decode_every_byte_and_dtypes():
    b = torch.arange(256, dtype=torch.uint8)
    got = F.ue8m0_to_float(b)
    assert got.dtype == torch.float32
    for i in range(255):
        assert got[i].item() == py_e8m0(i), i
    assert math.isnan(got[255].item())
    assert torch.equal(F.ue8m0_to_float(b.view(torch.float8_e8m0fnu))[:255], got[:255])
    assert torch.equal(F.ue8m0_to_exponent(b), torch.arange(256, dtype=torch.int32))
    assert F.scale_to_float(torch.tensor([3.0])).item() == 3.0
    for bad in (torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.float16)):
        with pytest.raises(TypeError, match="float8_e8m0fnu or uint8"):
            F.ue8m0_to_float(bad)


def test_round_up_pow2_exact_including_edges():
    x = torch.tensor([1.0, 0.75, 1.0 + 2**-23, 2.0**-126 * 1.5, 2.0**-130, 2.0**-149, 3e38, 2.0**127,
                      0.0, -1.0, float("nan"), float("inf"), float("-inf")])
    got = F.round_up_pow2(x).tolist()
    want = [1.0, 1.0, 2.0, 2.0**-125, 2.0**-130, 2.0**-149, float("inf"), 2.0**127]
    assert got[:8] == want
    assert all(math.isnan(v) for v in got[8:11]) and got[11] == float("inf") and math.isnan(got[12])
    r = torch.rand(2000, generator=torch.Generator().manual_seed(0)) * 1e4 + 1e-30
    p = F.round_up_pow2(r)
    assert (p >= r).all() and (p / 2 < r).all() and torch.equal(torch.frexp(p)[0], torch.full_like(p, 0.5))
    # the encoder agrees with the rounding inside the UE8M0 range and clamps outside it
    assert torch.equal(F.ue8m0_to_float(F.float_to_ue8m0_ceil(r)), p)
    assert F.ue8m0_to_float(F.float_to_ue8m0_ceil(torch.tensor([2.0**-140, 3e38]))).tolist() == [2.0**-127, 2.0**127]
    with pytest.raises(ValueError, match="finite and positive"):
        F.float_to_ue8m0_ceil(torch.tensor([1.0, 0.0]))


@pytest.mark.parametrize("lead", [(), (3,), (2, 2)])
@pytest.mark.parametrize("nk", [(1, 1), (7, 83), (130, 257)])
def test_fp8_block_dequant_matches_elementwise_and_batches(lead, nk):
    n, k = nk
    g = torch.Generator().manual_seed(n * k + len(lead))
    q = (torch.randn(*lead, n, k, generator=g) * 50).to(torch.float8_e4m3fn)
    sb = (*lead, -(-n // 128), -(-k // 128))
    s8 = torch.randint(110, 140, sb, generator=g, dtype=torch.uint8)
    got = F.dequant_fp8_block(q, s8.view(torch.float8_e8m0fnu))
    qf, sf = q.float().reshape(-1, n, k), s8.reshape(-1, *sb[-2:])
    for m in range(qf.shape[0]):
        for i in {0, n - 1, n // 2}:
            for j in {0, k - 1, k // 2, min(k - 1, 128)}:
                assert got.reshape(-1, n, k)[m, i, j].item() == qf[m, i, j].item() * py_e8m0(int(sf[m, i // 128, j // 128]))
    # fp32 scales give the same bits as the UE8M0 ones they encode; batched == per matrix
    assert torch.equal(F.dequant_fp8_block(q, F.ue8m0_to_float(s8)), got)
    if lead:
        assert torch.equal(got[0], F.dequant_fp8_block(q[0], s8[0]))


@pytest.mark.parametrize("lead", [(), (2,)])
@pytest.mark.parametrize("nk", [(1, 2), (5, 70), (3, 96)])
def test_fp4_unpack_dequant_matches_elementwise_and_round_trips(lead, nk):
    n, k = nk
    g = torch.Generator().manual_seed(n + k)
    packed = torch.randint(0, 256, (*lead, n, k // 2), generator=g, dtype=torch.uint8)
    s8 = torch.randint(100, 150, (*lead, n, -(-k // 32)), generator=g, dtype=torch.uint8)
    s8.view(-1)[0] = 255  # NaN scale poisons its group only
    got = F.dequant_fp4(packed.view(torch.int8), s8)
    pf, sf, gf = packed.reshape(-1, n, k // 2), s8.reshape(-1, n, s8.shape[-1]), got.reshape(-1, n, k)
    for m in range(pf.shape[0]):
        for i in range(n):
            for j in range(k):
                byte = int(pf[m, i, j // 2])
                code = byte & 0xF if j % 2 == 0 else byte >> 4
                want = py_e2m1(code) * py_e8m0(int(sf[m, i, j // 32]))
                v = gf[m, i, j].item()
                assert (math.isnan(v) and math.isnan(want)) or v == want, (m, i, j)
    codes = F.unpack_fp4_codes(packed)
    assert torch.equal(F.pack_fp4_codes(codes).view(torch.uint8), packed)
    # quantise: batched == per matrix, and dequant(quant(w)) stays within half an e2m1 gap of w
    w = torch.randn(*lead, n, k, generator=g)
    pq, sq = F.quantize_fp4(w)
    if lead:
        p0, s0 = F.quantize_fp4(w[0])
        assert torch.equal(pq[0], p0) and torch.equal(sq[0].view(torch.uint8), s0.view(torch.uint8))
    deq = F.dequant_fp4(pq, sq)
    sfull = F.expand_block_scales(F.ue8m0_to_float(sq), (1, 32), n, k)
    assert ((deq - w).abs() <= sfull).all()


def test_quantize_fp8_block_batched_equals_per_matrix():
    w = torch.randn(3, 130, 200, generator=torch.Generator().manual_seed(1))
    for fmt in ("ue8m0", "float"):
        q, s = F.quantize_fp8_block(w, scale_fmt=fmt)
        assert q.shape == w.shape and s.shape == (3, 2, 2)
        q1, s1 = F.quantize_fp8_block(w[1], scale_fmt=fmt)
        assert torch.equal(q[1].view(torch.uint8), q1.view(torch.uint8))
        assert torch.equal(F.scale_to_float(s[1]), F.scale_to_float(s1))
        err = (F.dequant_fp8_block(q, s) - w).abs()
        assert (err <= w.abs() * 2**-4 + 2**-10 * F.expand_block_scales(F.scale_to_float(s), 128, 130, 200)).all()


def test_round_e2m1_codes_ties_to_even_and_saturates():
    vals = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 100.0, -0.1, -2.6, float("nan")])
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 0.0, -3.0, 0.0]
    assert [py_e2m1(c) for c in F.round_e2m1_codes(vals).tolist()] == want
    assert F.round_e2m1_codes(torch.tensor([-0.1])).item() == 0  # rounds to +0


def test_errors_name_the_function_and_argument():
    with pytest.raises(ValueError, match=r"dequant_fp8_block: q dtype"):
        F.dequant_fp8_block(torch.zeros(4, 4), torch.ones(1, 1))
    with pytest.raises(ValueError, match=r"dequant_fp8_block: scale shape \(1, 1\), expected \(2, 1\)"):
        F.dequant_fp8_block(torch.zeros(130, 4).to(torch.float8_e4m3fn), torch.ones(1, 1))
    with pytest.raises(ValueError, match=r"dequant_fp8_block: q must be at least 2-D"):
        F.dequant_fp8_block(torch.zeros(4).to(torch.float8_e4m3fn), torch.ones(1))
    with pytest.raises(TypeError, match="float8_e8m0fnu or uint8"):
        F.dequant_fp8_block(torch.zeros(4, 4).to(torch.float8_e4m3fn), torch.ones(1, 1, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"dequant_fp4: packed dtype"):
        F.dequant_fp4(torch.zeros(2, 2), torch.ones(2, 1))
    with pytest.raises(ValueError, match=r"dequant_fp4: scale shape"):
        F.dequant_fp4(torch.zeros(2, 40, dtype=torch.int8), torch.ones(2, 2))
    with pytest.raises(ValueError, match="must be even"):
        F.quantize_fp4(torch.ones(2, 3))
    with pytest.raises(ValueError, match="must be even"):
        F.pack_fp4_codes(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="NaN or inf"):
        F.quantize_fp8_block(torch.tensor([[1.0, float("nan")]]))
    with pytest.raises(ValueError, match="scale_fmt"):
        F.quantize_fp8_block(torch.ones(2, 2), scale_fmt="e4m3")
