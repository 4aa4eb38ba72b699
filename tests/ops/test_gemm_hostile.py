"""Hostile inputs to the GEMM/MoE wrappers and to every op's fake: int64 indices that would wrap when narrowed to
int32, outputs whose elements share memory (expanded views), and meta tensors mixed with real ones (which dispatch to
the fake implementations, where the C++ device checks never run)."""

from __future__ import annotations

import pytest
import torch

import deepinfer_ops
from deepinfer_ops import _fake
from deepinfer_ops.gemm import index_to_int32
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
