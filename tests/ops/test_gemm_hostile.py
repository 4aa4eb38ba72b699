"""Hostile inputs to the GEMM/MoE wrappers and to every op's fake: int64 indices that would wrap when narrowed to
int32, outputs whose elements share memory (expanded views), and meta tensors mixed with real ones (which dispatch to
the fake implementations, where the C++ device checks never run)."""

from __future__ import annotations

import pytest
import torch

import deepinfer_ops
from deepinfer_ops import _fake
from deepinfer_ops.gemm import index_to_int32
from deepinfer_ops.quant import scale_buffer
from deepinfer_ops.testing import refs

FP8 = torch.float8_e4m3fn


def _dense(m=4, n=128, k=128, device="cpu"):
    g = torch.Generator().manual_seed(m + n + k)
    a = torch.randint(-3, 4, (m, k), generator=g).float().to(FP8)
    b = torch.randint(-3, 4, (n, k), generator=g).float().to(FP8)
    return [t.to(device) for t in (a, torch.ones(m, -(-k // 128)), b, torch.ones(-(-n // 128), -(-k // 128)))]


def _grouped(g=2, n=128, k=128):
    b = torch.randint(-3, 4, (g, n, k), generator=torch.Generator().manual_seed(g)).float().to(FP8)
    return b, torch.ones(g, -(-n // 128), -(-k // 128))


# ------------------------------------------------------------------------------------------------ int64 -> int32


def test_index_to_int32_saturates_instead_of_wrapping():
    t = torch.tensor([0, -1, 2**32 + 1, -(2**32) + 1, 2**31, -(2**31) - 1, 7], dtype=torch.int64)
    got = index_to_int32("op", "m_indices", t)
    assert got.dtype == torch.int32 and got.is_contiguous()
    assert got.tolist() == [0, -1, 2**31 - 1, -(2**31), 2**31 - 1, -(2**31), 7]
    assert torch.equal(index_to_int32("op", "x", torch.tensor([3, 255], dtype=torch.uint8)),
                       torch.tensor([3, 255], dtype=torch.int32))
    for dt in (torch.int8, torch.int16, torch.uint16, torch.uint32):
        assert index_to_int32("op", "x", torch.tensor([1, 100], dtype=dt)).tolist() == [1, 100]
    assert index_to_int32("op", "x", torch.tensor([2**32 - 1], dtype=torch.uint32)).tolist() == [2**31 - 1]
    for bad in (torch.tensor([1.0]), torch.tensor([True]), torch.tensor([1 + 0j]), torch.tensor([1], dtype=torch.uint64)):
        with pytest.raises(TypeError, match=r"deepinfer_ops.op: m_indices must be an integer tensor"):
            index_to_int32("op", "m_indices", bad)


@pytest.mark.native_errors
def test_int64_indices_beyond_int32_are_errors_not_wrapped():
    a, sa, _, _ = _dense()
    b, sb = _grouped()
    # 2**32 would wrap to group 0 and -(2**32) + 1 to group 1; both must stay out of range and be refused
    for bad in (2**32, -(2**32) + 1):
        m_idx = torch.tensor([0, bad, 1, 1], dtype=torch.int64)
        with pytest.raises(RuntimeError, match="m_indices.*outside"):
            deepinfer_ops.m_grouped_fp8_gemm_nt_contiguous(a, sa, b, sb, m_idx)
    a3, sa3 = a.view(1, 4, 128).expand(2, 4, 128).contiguous(), sa.expand(2, 4, 1).contiguous()
    for bad in (2**32 + 1, -(2**32) + 2):  # would wrap to 1 and 2 (valid counts)
        with pytest.raises(RuntimeError, match="masked_m.*outside"):
            deepinfer_ops.m_grouped_fp8_gemm_nt_masked(a3, sa3, b, sb, torch.tensor([1, bad]))
    with pytest.raises(TypeError, match="masked_m must be an integer tensor"):
        deepinfer_ops.m_grouped_fp8_gemm_nt_masked(a3, sa3, b, sb, torch.tensor([1.0, 2.0]))


def test_int64_indices_in_range_still_work():
    a, sa, _, _ = _dense()
    b, sb = _grouped()
    m_idx = torch.tensor([1, 1, -1, 0])
    init = torch.full((4, 128), 5.0, dtype=torch.bfloat16)
    out = deepinfer_ops.m_grouped_fp8_gemm_nt_contiguous(a, sa, b, sb, m_idx, out=init.clone())
    ref = refs.m_grouped_fp8_gemm_nt_contiguous_ref(a, sa, b, sb, m_idx, out_init=init)
    assert torch.equal(out, ref)


def test_fused_moe_ids_beyond_int32_are_padding_not_wrapped():
    gen = torch.Generator().manual_seed(3)
    experts, hidden, inter = 4, 128, 128
    x = torch.randn(5, hidden, generator=gen).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(experts, generator=gen)[:2] for _ in range(5)])
    w = torch.rand(5, 2, generator=gen)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * 30).clamp(-448, 448).to(FP8)
    w2 = (torch.randn(experts, hidden, inter, generator=gen) * 30).clamp(-448, 448).to(FP8)
    s13, s2 = torch.full((experts, 2, 1), 1e-3), torch.full((experts, 1, 1), 1e-3)
    hostile = idx.clone()
    hostile[1, 0] = 2**32 + int(idx[1, 0])  # would wrap onto a real expert
    hostile[3, 1] = -(2**32) + int(idx[3, 1])
    padded = idx.clone()
    padded[1, 0] = -1
    padded[3, 1] = -1
    got = deepinfer_ops.fused_moe_fp8(x, hostile, w, w13, s13, w2, s2, out_dtype=torch.float32)
    want = deepinfer_ops.fused_moe_fp8(x, padded, w, w13, s13, w2, s2, out_dtype=torch.float32)
    assert torch.equal(got, want)
    assert not torch.equal(got, deepinfer_ops.fused_moe_fp8(x, idx, w, w13, s13, w2, s2, out_dtype=torch.float32))
    with pytest.raises(TypeError, match="topk_idx must be an integer tensor"):
        deepinfer_ops.fused_moe_fp8(x, idx.float(), w, w13, s13, w2, s2)


# ------------------------------------------------------------------------------------------ expanded outputs


@pytest.mark.native_errors
def test_outputs_sharing_memory_are_refused():
    a, sa, b, sb = _dense(m=4, n=128)
    shared = "has elements that share memory"
    with pytest.raises(RuntimeError, match=f"fp8_gemm_nt: out {shared}"):
        deepinfer_ops.fp8_gemm_nt(a, sa, b, sb, out=torch.empty(1, 128, dtype=torch.bfloat16).expand(4, 128))
    bg, sbg = _grouped()
    with pytest.raises(RuntimeError, match=f"m_grouped_fp8_gemm_nt_contiguous: out {shared}"):
        deepinfer_ops.m_grouped_fp8_gemm_nt_contiguous(
            a, sa, bg, sbg, torch.tensor([0, 0, 1, 1]), out=torch.empty(1, 128, dtype=torch.bfloat16).expand(4, 128))
    a3, sa3 = a.view(1, 4, 128).expand(2, 4, 128).contiguous(), sa.expand(2, 4, 1).contiguous()
    with pytest.raises(RuntimeError, match=f"m_grouped_fp8_gemm_nt_masked: out {shared}"):
        deepinfer_ops.m_grouped_fp8_gemm_nt_masked(
            a3, sa3, bg, sbg, torch.tensor([4, 4]), out=torch.empty(1, 4, 128, dtype=torch.bfloat16).expand(2, 4, 128))
    gate_up = torch.randn(3, 512)
    with pytest.raises(RuntimeError, match=f"swiglu_clamp_quant_fp8: out_q {shared}"):
        torch.ops.deepinfer_ops.swiglu_clamp_quant_fp8(torch.empty(1, 256, dtype=FP8).expand(3, 256),
                                                       torch.empty(3, 2), gate_up, 10.0, False)
    with pytest.raises(RuntimeError, match=f"swiglu_clamp_quant_fp8: out_scale {shared}"):
        torch.ops.deepinfer_ops.swiglu_clamp_quant_fp8(torch.empty(3, 256, dtype=FP8), torch.empty(1, 2).expand(3, 2),
                                                       gate_up, 10.0, False)
    w = torch.zeros(256, 64, dtype=torch.uint8)
    e = torch.full((256, 4), 127, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match=f"fp4_to_fp8_blockscaled: out_scale {shared}"):
        torch.ops.deepinfer_ops.fp4_to_fp8_blockscaled(torch.empty(256, 128, dtype=FP8), torch.empty(1, 1).expand(2, 1),
                                                       w, e)


# ------------------------------------------------------------------------------------------ meta mixed with cpu


def _meta(t):
    return t.to("meta")


def test_every_op_fake_checks_devices():
    registered = {n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("deepinfer_ops::")}
    assert registered and registered == _fake.CHECKED_OPS


def test_meta_mixed_with_cpu_is_an_error_naming_the_tensor():
    a, sa, b, sb = _dense()
    with pytest.raises(RuntimeError, match=r"fp8_gemm_nt: a_scale is on cpu but out is on meta"):
        deepinfer_ops.fp8_gemm_nt(_meta(a), sa, b, sb)
    with pytest.raises(RuntimeError, match=r"fp8_gemm_nt: .* is on meta but out is on cpu"):
        deepinfer_ops.fp8_gemm_nt(a, sa, _meta(b), sb)
    bg, sbg = _grouped()
    with pytest.raises(RuntimeError, match=r"m_grouped_fp8_gemm_nt_contiguous: m_indices is on cpu but out is on meta"):
        deepinfer_ops.m_grouped_fp8_gemm_nt_contiguous(_meta(a), _meta(sa), _meta(bg), _meta(sbg),
                                                       torch.zeros(4, dtype=torch.int64))
    a3, sa3 = _meta(a).view(1, 4, 128).expand(2, 4, 128), _meta(sa).expand(2, 4, 1)
    with pytest.raises(RuntimeError, match=r"m_grouped_fp8_gemm_nt_masked: b is on cpu but out is on meta"):
        deepinfer_ops.m_grouped_fp8_gemm_nt_masked(a3, sa3, bg, _meta(sbg), torch.tensor([1, 2], device="meta"))
    with pytest.raises(RuntimeError, match=r"swiglu_clamp_quant_fp8: gate_up is on cpu but out_q is on meta"):
        torch.ops.deepinfer_ops.swiglu_clamp_quant_fp8(torch.empty(3, 256, dtype=FP8, device="meta"),
                                                       torch.empty(3, 2, device="meta"), torch.randn(3, 512), 10.0,
                                                       False)
    with pytest.raises(RuntimeError, match=r"fp4_to_fp8_blockscaled: w_scale is on cpu but w is on meta"):
        deepinfer_ops.fp4_to_fp8_blockscaled(torch.zeros(128, 64, dtype=torch.uint8, device="meta"),
                                             torch.full((128, 4), 127, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match=r"rms_norm: input is on cpu but out is on meta"):
        torch.ops.deepinfer_ops.rms_norm(torch.empty(2, 8, device="meta"), torch.randn(2, 8), None, 1e-6)
    with pytest.raises(RuntimeError, match=r"rms_norm: weight is on meta but out is on cpu"):
        torch.ops.deepinfer_ops.rms_norm(torch.empty(2, 8), torch.randn(2, 8), torch.ones(8, device="meta"), 1e-6)
    x = torch.randn(2, 128).to(torch.bfloat16)
    w13, s13 = _grouped(2, 256, 128)
    w2, s2 = _grouped(2, 128, 128)
    with pytest.raises(RuntimeError, match=r"fused_moe_fp8: w13 is on meta but x is on cpu"):
        deepinfer_ops.fused_moe_fp8(x, torch.zeros(2, 1, dtype=torch.int64), torch.ones(2, 1), _meta(w13), s13, w2, s2)


def test_all_meta_calls_still_trace():
    a, sa, b, sb = (_meta(t) for t in _dense(m=5, n=200, k=300))
    out = deepinfer_ops.fp8_gemm_nt(a, sa, b, sb)
    assert out.device.type == "meta" and out.shape == (5, 200)
    bg, sbg = (_meta(t) for t in _grouped(3, 200, 300))
    out = deepinfer_ops.m_grouped_fp8_gemm_nt_contiguous(a, sa, bg, sbg, torch.zeros(5, dtype=torch.int64, device="meta"))
    assert out.device.type == "meta" and out.shape == (5, 200)
    q, s = deepinfer_ops.swiglu_clamp_quant_fp8(torch.empty(4, 512, device="meta"))
    assert q.shape == (4, 256) and s.shape == (4, 2)


def test_fp4_conversion_needs_2d_operands():
    with pytest.raises(ValueError, match="w must be \\[N, K/2\\]"):
        deepinfer_ops.fp4_to_fp8_blockscaled(torch.zeros(64, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8))


# ------------------------------------------------------------------- M-major padded scales (quant.scale_buffer)
# per_token_group_quant_fp8 / swiglu_clamp_quant_fp8 with column_major_scales=True return [rows, kb] scales with
# strides (1, ld), ld = round_up(rows, 4): a view into a [kb, ld] buffer whose padding rows are never written.
# Every consumer must read them like any other layout (the CPU ops read any strides; the CUDA ones in place or
# copied, tests/ops/test_gemm.py's *_cuda tests).


def test_scale_buffer_refuses_negative_or_non_int_sizes():
    for column_major in (True, False):
        with pytest.raises(ValueError, match="scale_buffer: rows must be >= 0, got -1"):
            scale_buffer(-1, 3, "cpu", column_major)  # column-major used to give a [0, 3] tensor
        with pytest.raises(ValueError, match="groups must be >= 0"):
            scale_buffer(4, -2, "cpu", column_major)
        for bad in (5.0, True, None):
            with pytest.raises(TypeError, match="scale_buffer: rows must be an int"):
                scale_buffer(bad, 3, "cpu", column_major)
    assert scale_buffer(0, 3, "cpu", True).shape == (0, 3) and scale_buffer(5, 0, "cpu", True).shape == (5, 0)


def _ld(rows):
    return -(-rows // 4) * 4


@pytest.mark.parametrize("rows", [0, 1, 3, 5, 127, 129])
@pytest.mark.parametrize("k", [128, 200, 384])
def test_padded_scales_feed_every_cpu_consumer(rows, k):
    """The quant ops' padded M-major scales (NaN in the never-written padding rows) give the same bits as their
    row-major scales in fp8_gemm_nt, both grouped GEMMs (the masked one through ``.view(G, T, kb)``, as the engine's
    wo_a), and after callers slice them further (``s[:m]``, ``s[1:]``, ``s[:, 1:]``)."""
    gen = torch.Generator().manual_seed(rows * 31 + k)
    kb, n = -(-k // 128), 136
    x = torch.randn(rows, k, generator=gen) * 20
    b = (torch.randn(n, k, generator=gen) * 30).to(FP8)
    sb = torch.rand(2, kb, generator=gen) + 0.5
    q, s = deepinfer_ops.per_token_group_quant_fp8(x, 128, column_major_scales=True)
    q_row, s_row = deepinfer_ops.per_token_group_quant_fp8(x, 128)
    if rows:
        assert s.stride() == (1, _ld(rows))
        s.t().as_strided((kb, _ld(rows)), (_ld(rows), 1))[:, rows:].fill_(float("nan"))  # the padding rows
    assert torch.equal(q.float(), q_row.float()) and torch.equal(s, s_row)
    ref = deepinfer_ops.fp8_gemm_nt(q, s_row, b, sb)
    assert torch.equal(deepinfer_ops.fp8_gemm_nt(q, s, b, sb), ref)
    assert not ref.isnan().any()
    if rows >= 2:
        assert torch.equal(deepinfer_ops.fp8_gemm_nt(q[: rows - 1], s[: rows - 1], b, sb), ref[: rows - 1])
        assert torch.equal(deepinfer_ops.fp8_gemm_nt(q[1:], s[1:], b, sb), ref[1:])
    if kb >= 2:  # K narrowed by one scale block: A, B and both scales sliced together
        out = deepinfer_ops.fp8_gemm_nt(q[:, 128:], s[:, 1:], b[:, 128:], sb[:, 1:])
        assert torch.equal(out, deepinfer_ops.fp8_gemm_nt(q[:, 128:], s_row[:, 1:], b[:, 128:], sb[:, 1:]))

    # swiglu_clamp_quant_fp8's padded scales into the contiguous grouped GEMM (the fused MoE's second GEMM)
    g = 3
    gate_up = torch.randn(rows, 2 * k, generator=gen) * 4
    hq, hs = deepinfer_ops.swiglu_clamp_quant_fp8(gate_up, 10.0, column_major_scales=True)
    _, hs_row = deepinfer_ops.swiglu_clamp_quant_fp8(gate_up, 10.0)
    if rows:
        assert hs.stride() == (1, _ld(rows))
    assert torch.equal(hs, hs_row)
    bg = (torch.randn(g, n, k, generator=gen) * 30).to(FP8)
    sbg = torch.rand(g, 2, kb, generator=gen) + 0.5
    m_idx = torch.sort(torch.randint(-1, g, (rows,), generator=gen)).values.to(torch.int32)
    init = torch.full((rows, n), 7.0, dtype=torch.bfloat16)
    got = deepinfer_ops.m_grouped_fp8_gemm_nt_contiguous(hq, hs, bg, sbg, m_idx, out=init.clone())
    assert torch.equal(got, deepinfer_ops.m_grouped_fp8_gemm_nt_contiguous(hq, hs_row, bg, sbg, m_idx,
                                                                           out=init.clone()))

    # masked: [G * T, K] quantised at once, viewed as [G, T, kb] (strides (T, 1, ld))
    if rows % g == 0:
        t = rows // g
        s3 = s.view(g, t, kb)
        assert t <= 1 or s3.stride()[:2] == (t, 1)  # a view, not a copy
        masked = torch.tensor([t, max(t - 1, 0), 0], dtype=torch.int32)
        init3 = torch.full((g, t, n), 7.0, dtype=torch.bfloat16)
        out = deepinfer_ops.m_grouped_fp8_gemm_nt_masked(q.view(g, t, k), s3, bg, sbg, masked, out=init3.clone())
        ref3 = deepinfer_ops.m_grouped_fp8_gemm_nt_masked(q.view(g, t, k), s_row.view(g, t, kb), bg, sbg, masked,
                                                          out=init3.clone())
        assert torch.equal(out, ref3)


def test_padded_scales_on_meta_and_under_compile():
    """Meta tensors and torch.compile (fullgraph, dynamic shapes: ld is a SymInt expression) keep the padded layout:
    same strides and bits as eager, through quantisation -> GEMM -> fused SwiGLU quantisation -> grouped GEMM."""
    q, s = deepinfer_ops.per_token_group_quant_fp8(torch.empty(5, 256, device="meta"), 128, column_major_scales=True)
    assert s.device.type == "meta" and s.shape == (5, 2) and s.stride() == (1, 8)
    b = torch.empty(136, 256, dtype=FP8, device="meta")
    assert deepinfer_ops.fp8_gemm_nt(q, s, b, torch.empty(2, 2, device="meta")).shape == (5, 136)
    _, hs = deepinfer_ops.swiglu_clamp_quant_fp8(torch.empty(3, 512, device="meta"), 10.0, column_major_scales=True)
    assert hs.stride() == (1, 4)

    gen = torch.Generator().manual_seed(11)
    b = (torch.randn(256, 256, generator=gen) * 30).to(FP8)
    sb = torch.rand(2, 2, generator=gen) + 0.5
    bg = (torch.randn(2, 128, 128, generator=gen) * 30).to(FP8)
    sbg = torch.rand(2, 1, 1, generator=gen) + 0.5

    def f(x, m_idx):
        xq, xs = deepinfer_ops.per_token_group_quant_fp8(x, 128, column_major_scales=True)
        y = deepinfer_ops.fp8_gemm_nt(xq, xs, b, sb)
        hq, hs = deepinfer_ops.swiglu_clamp_quant_fp8(y, 10.0, column_major_scales=True)
        return xs, hs[1:], deepinfer_ops.m_grouped_fp8_gemm_nt_contiguous(hq, hs, bg, sbg, m_idx)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=True)
    for rows in (3, 5, 8):
        x = torch.randn(rows, 256, generator=gen) * 10
        m_idx = (torch.arange(rows) >= rows // 2).to(torch.int32)
        for got, exp in zip(compiled(x, m_idx), f(x, m_idx)):
            assert got.stride() == exp.stride() and torch.equal(got, exp), rows


@pytest.mark.native_errors
def test_padded_scales_with_a_wrong_dtype_shape_or_device_name_a_scale():
    q, s = deepinfer_ops.per_token_group_quant_fp8(torch.randn(5, 256), 128, column_major_scales=True)
    b, sb = torch.zeros(128, 256, dtype=FP8), torch.ones(1, 2)
    with pytest.raises(RuntimeError, match="fp8_gemm_nt.*a_scale.*(Double|float64)"):
        deepinfer_ops.fp8_gemm_nt(q, s.double(), b, sb)
    with pytest.raises(RuntimeError, match=r"fp8_gemm_nt.*a_scale must be \[5, 2\]"):
        deepinfer_ops.fp8_gemm_nt(q, s[:, :1], b, sb)
    with pytest.raises(RuntimeError, match=r"fp8_gemm_nt.*a_scale must be \[5, 2\]"):
        deepinfer_ops.fp8_gemm_nt(q, s[:4], b, sb)
    with pytest.raises(RuntimeError, match="a_scale is on meta"):
        deepinfer_ops.fp8_gemm_nt(q, s.to("meta"), b, sb)
    with pytest.raises(RuntimeError, match="out_scale must be"):
        torch.ops.deepinfer_ops.per_token_group_quant_fp8(torch.empty(5, 256, dtype=FP8), s[:4],
                                                          torch.randn(5, 256), 128, False)
