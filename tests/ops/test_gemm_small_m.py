"""The small-M FP8 GEMM kernel (``DEEPINFER_FP8_GEMM_SMALL_M=1``, CUDA only, M <= 64 and K % 128 == 0).

One warpgroup per 32 / 64 / 128 columns of D (csrc/cuda/gemm/fp8_gemm_small_m.cu). It must give the CUTLASS
kernels' bits exactly (batch invariance lets the engine pick a kernel by M) and pass the DeepGEMM-style
``calc_diff`` rule against the fp32 reference. Column counts cover every tile width and partial last tiles.
"""

from __future__ import annotations

import pytest
import torch

import deepinfer_ops
from deepinfer_ops.testing import refs
from deepinfer_ops.testing.compare import CALC_DIFF_MAX, calc_diff, poison_

from test_gemm import _col_major, _cuda_gen, _dense_inputs, _grouped_b, _rand_fp8, _rand_scales

MODE = "DEEPINFER_FP8_GEMM_SMALL_M"


@pytest.mark.cuda
@pytest.mark.parametrize("m", [1, 2, 7, 33, 64])
@pytest.mark.parametrize("n,k", [(4096, 8192), (7168, 2048), (16384, 1024), (576, 7168), (1000, 256), (24, 128)])
def test_cuda_small_m_gemm_equals_cutlass(monkeypatch, m, n, k):
    a, sa, b, sb = _dense_inputs(m, n, k, _cuda_gen(m * 31 + n + k))
    want = deepinfer_ops.fp8_gemm_nt(a, sa, b, sb)
    monkeypatch.setenv(MODE, "1")
    for scales in (sa, _col_major(sa)):
        out = poison_(torch.empty(m, n, dtype=torch.bfloat16, device="cuda"))
        deepinfer_ops.fp8_gemm_nt(a, scales, b, sb, out=out)
        assert torch.equal(out, want), f"small-M kernel bits differ at m={m} n={n} k={k}"
    diff = calc_diff(out.float(), refs.fp8_gemm_nt_ref(a, sa, b, sb, torch.float32))
    assert diff < CALC_DIFF_MAX["fp8"], f"calc_diff {diff} at m={m} n={n} k={k}"


@pytest.mark.cuda
def test_cuda_small_m_gemm_batch_invariant_and_strided_out(monkeypatch):
    """Rows alone equal rows of a batch of 64; an output with a row stride past N is written only inside N."""
    a, sa, b, sb = _dense_inputs(64, 4096, 7168, _cuda_gen(5))
    monkeypatch.setenv(MODE, "1")
    full = deepinfer_ops.fp8_gemm_nt(a, sa, b, sb)
    for m in (1, 3, 17, 63):
        assert torch.equal(deepinfer_ops.fp8_gemm_nt(a[:m].contiguous(), sa[:m].contiguous(), b, sb), full[:m])
    wide = torch.full((64, 4096 + 64), 7.0, dtype=torch.bfloat16, device="cuda")
    deepinfer_ops.fp8_gemm_nt(a, sa, b, sb, out=wide[:, :4096])
    assert torch.equal(wide[:, :4096], full) and bool((wide[:, 4096:] == 7.0).all())


@pytest.mark.cuda
@pytest.mark.parametrize("g,max_m,n,k", [(6, 64, 4096, 4096), (32, 8, 4096, 7168), (3, 1, 576, 7168),
                                         (5, 33, 1000, 256)])
def test_cuda_small_m_masked_gemm_equals_cutlass(monkeypatch, g, max_m, n, k):
    """The masked grouped layout: one grid row per group, groups with 0 rows read nothing, rows past a group's count
    are not written; the bits equal the CUTLASS grouped kernel's."""
    gen = _cuda_gen(g * 7 + max_m + n)
    a = _rand_fp8((g, max_m, k), gen, 30)
    sa = _rand_scales((g, max_m, k // 128), gen)
    b, sb = _grouped_b(g, n, k, gen)
    counts = torch.randint(0, max_m + 1, (g,), generator=torch.Generator().manual_seed(g), dtype=torch.int32)
    counts[0], counts[-1] = 0, max_m
    masked = counts.cuda()
    want = poison_(torch.empty(g, max_m, n, dtype=torch.bfloat16, device="cuda"))
    deepinfer_ops.m_grouped_fp8_gemm_nt_masked(a, sa, b, sb, masked, out=want)
    monkeypatch.setenv(MODE, "1")
    out = poison_(torch.empty(g, max_m, n, dtype=torch.bfloat16, device="cuda"))
    deepinfer_ops.m_grouped_fp8_gemm_nt_masked(a, sa, b, sb, masked, out=out)
    valid = torch.arange(max_m, device="cuda")[None, :] < masked[:, None]
    assert torch.isnan(out[~valid]).all(), "rows past a group's count were written"
    assert torch.equal(out[valid], want[valid]), "small-M masked bits differ from the CUTLASS grouped kernel's"
