"""FP8 block-scaled GEMM family (fp8_gemm_nt, m_grouped contiguous/masked), FP4 -> FP8 conversion,
swiglu_clamp_quant_fp8 and the fused MoE path, against the pure-torch float32 references in testing.refs.

Tiers: integer-valued inputs with power-of-two scales (every product and sum exact in fp32: results must match
the reference bit for bit), random inputs (calc_diff < 1e-3), per-block scale exactness (each 128-column /
128-deep block multiplied by its own scale), NaN-poisoned outputs (unwritten elements show; rows the op must not
touch stay NaN), edge cases (M = 0, K/N not multiples of 128, empty groups, masked_m = 0), bad input errors.
CPU cases use small odd shapes; CUDA cases (marker ``cuda``) add every GEMM shape of V4-Flash.
"""

from __future__ import annotations

import pytest
import torch

import deepinfer_ops
from deepinfer_ops.quant import scale_buffer
from deepinfer_ops.testing import refs
from deepinfer_ops.testing.compare import (
    CALC_DIFF_MAX,
    TOLERANCES,
    assert_close,
    calc_diff,
    poison_,
    poison_cuda_scratch_,
)

FP8 = torch.float8_e4m3fn

# (N, K) of V4-Flash's FP8 GEMMs (its config.json): q_lora down, q up, kv, o_a (per group of 8), o_b,
# shared/routed expert gate+up (fused) and down, indexer q up; plus the partial-block shapes of issue 5.
V4_FLASH_DENSE_NK = [
    (1024, 4096),   # wq_a: hidden -> q_lora
    (32768, 1024),  # wq_b: q_lora -> 64 heads x 512
    (512, 4096),    # wkv: hidden -> head_dim 512
    (1024, 4096),   # wo_a per group: 8 heads x 512 -> o_lora 1024
    (4096, 8192),   # wo_b: 8 x o_lora -> hidden
    (4096, 4096),   # expert gate|up fused: hidden -> 2 x moe_inter
    (4096, 2048),   # expert down: moe_inter -> hidden
    (8192, 1024),   # indexer wq_b: q_lora -> 64 x 128
    (448, 576), (576, 576), (2112, 576),  # partial last blocks in N and K
]
# Stand-ins for the `tiny` model's GEMMs (its config is not in the repository yet; update when it lands):
# hidden 256, moe_inter 96, q_lora 192 -- sub-128 and partial blocks.
TINY_DENSE_NK = [(192, 256), (256, 192), (192, 256), (256, 96), (96, 256), (512, 256)]


# Inputs are generated on the generator's device (CUDA tests use a CUDA generator: the expert-shape tensors are
# GBs, too slow to draw on the CPU).
def _rand_fp8(shape, gen, scale=1.0):
    return (torch.randn(shape, generator=gen, device=gen.device) * scale).clamp(-448, 448).to(FP8)


def _rand_scales(shape, gen, pow2=False):
    if pow2:
        exps = torch.randint(-4, 3, shape, generator=gen, device=gen.device).float()
        return torch.ldexp(torch.ones(shape, device=gen.device), exps)
    return torch.rand(shape, generator=gen, device=gen.device) * 0.02 + 0.001


def _int_fp8(shape, gen, lo=-3, hi=4):
    return torch.randint(lo, hi, shape, generator=gen, device=gen.device).float().to(FP8)


def _cuda_gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def _dense_inputs(m, n, k, gen, integer=False):
    kb, nb = -(-k // 128), -(-n // 128)
    if integer:
        a, b = _int_fp8((m, k), gen), _int_fp8((n, k), gen)
        sa, sb = _rand_scales((m, kb), gen, pow2=True), _rand_scales((nb, kb), gen, pow2=True)
    else:
        a, b = _rand_fp8((m, k), gen, 30), _rand_fp8((n, k), gen, 30)
        sa, sb = _rand_scales((m, kb), gen), _rand_scales((nb, kb), gen)
    return a, sa, b, sb


def _col_major(s):
    return s.t().contiguous().t()


def _to(device, *ts):
    return [t.to(device) for t in ts]


def _padded(s, pad=3):
    """The same values as a view into a NaN-filled buffer whose last dim is `pad` longer (non-compact strides)."""
    buf = torch.full((*s.shape[:-1], s.shape[-1] + pad), float("nan"), dtype=s.dtype, device=s.device)
    buf[..., : s.shape[-1]] = s
    return buf[..., : s.shape[-1]]


# ---------------------------------------------------------------------------------------------------------------
# fp8_gemm_nt
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mnk", [(1, 128, 128), (7, 83, 200), (83, 448, 576), (129, 576, 576), (64, 2112, 576),
                                 (5, 256, 1536)])
@pytest.mark.parametrize("scale_layout", ["row", "col"])
def test_fp8_gemm_nt_random(device, mnk, scale_layout):
    m, n, k = mnk
    if device == "cuda" and (k % 16 or n % 8):
        pytest.skip("CUDA needs K % 16 == 0 and N % 8 == 0 (TMA alignment): see test_fp8_gemm_cuda_alignment_error")
    gen = torch.Generator().manual_seed(m * 7 + n * 3 + k)
    a, sa, b, sb = _dense_inputs(m, n, k, gen)
    if scale_layout == "col":
        sa = _col_major(sa)
    a, sa, b, sb = _to(device, a, sa, b, sb)
    out = poison_(torch.empty(m, n, dtype=torch.bfloat16, device=device))
    deepinfer_ops.fp8_gemm_nt(a, sa, b, sb, out=out)
    ref = refs.fp8_gemm_nt_ref(a.cpu(), sa.cpu(), b.cpu(), sb.cpu(), torch.float32)
    assert not torch.isnan(out).any(), "unwritten output elements"
    diff = calc_diff(out.cpu().float(), ref)
    assert diff < CALC_DIFF_MAX["fp8"], f"calc_diff {diff}"


@pytest.mark.parametrize("mnk", [(3, 200, 320), (65, 448, 576), (130, 384, 256)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_fp8_gemm_nt_integer_bitwise(device, mnk, out_dtype):
    m, n, k = mnk
    if device == "cuda" and n % 8:
        pytest.skip("CUDA needs N % 8 == 0")
    gen = torch.Generator().manual_seed(sum(mnk))
    a, sa, b, sb = _dense_inputs(m, n, k, gen, integer=True)
    a, sa, b, sb = _to(device, a, sa, b, sb)
    out = deepinfer_ops.fp8_gemm_nt(a, sa, b, sb, out_dtype=out_dtype)
    ref = refs.fp8_gemm_nt_ref(a.cpu(), sa.cpu(), b.cpu(), sb.cpu(), out_dtype)
    assert torch.equal(out.cpu(), ref), f"max diff {(out.cpu().float() - ref.float()).abs().max()}"


def test_fp8_gemm_nt_accumulate_fp32(device):
    gen = torch.Generator().manual_seed(5)
    a, sa, b, sb = _dense_inputs(33, 256, 448, gen, integer=True)
    a, sa, b, sb = _to(device, a, sa, b, sb)
    c = torch.randint(-50, 50, (33, 256), generator=gen).float().to(device)
    out = c.clone()
    deepinfer_ops.fp8_gemm_nt(a, sa, b, sb, out=out, accumulate=True)
    ref = refs.fp8_gemm_nt_ref(a.cpu(), sa.cpu(), b.cpu(), sb.cpu(), torch.float32, c=c.cpu())
    assert torch.equal(out.cpu(), ref)


def test_fp8_gemm_nt_per_block_scales(device):
    """A = B = all ones; a_scale[m, kb] = 2^kb, b_scale[nb, kb] = 3^nb * 2^(2 kb): out[m, n] must be
    sum_kb len(kb) * 2^(3 kb) * 3^(n // 128) exactly (every term a distinct power of two, all exact in fp32), so a
    block that used a neighbour's scale shows."""
    m, n, k = 5, 320, 448  # 3 N blocks (last partial), 4 K blocks (last partial: 64)
    kb, nb = 4, 3
    a = torch.ones(m, k).to(FP8)
    b = torch.ones(n, k).to(FP8)
    sa = torch.ldexp(torch.ones(m, kb), torch.arange(kb).float().expand(m, kb)).contiguous()
    sb = (3.0 ** torch.arange(nb).float())[:, None] * torch.ldexp(torch.ones(nb, kb), 2 * torch.arange(kb).float())
    lens = torch.tensor([128, 128, 128, 64]).float()
    expect_n = (lens * 2.0 ** (3 * torch.arange(kb))).sum()
    expect = (expect_n * 3.0 ** (torch.arange(n) // 128).float()).expand(m, n)
    a, sa, b, sb = _to(device, a, sa, b, sb)
    out = deepinfer_ops.fp8_gemm_nt(a, sa, b, sb, out_dtype=torch.float32)
    assert torch.equal(out.cpu(), expect)


def test_fp8_gemm_nt_edge_sizes(device):
    gen = torch.Generator().manual_seed(1)
    _, _, b, sb = _dense_inputs(1, 256, 256, gen)
    a0 = torch.empty(0, 256, dtype=FP8)
    s0 = torch.empty(0, 2)
    b, sb = _to(device, b, sb)
    out = deepinfer_ops.fp8_gemm_nt(a0.to(device), s0.to(device), b, sb)
    assert out.shape == (0, 256)
    # K = 0: zeros
    outk = poison_(torch.empty(3, 256, dtype=torch.bfloat16, device=device))
    torch.ops.deepinfer_ops.fp8_gemm_nt(outk, torch.empty(3, 0, dtype=FP8, device=device),
                                        torch.empty(3, 0, device=device), torch.empty(256, 0, dtype=FP8, device=device),
                                        torch.empty(2, 0, device=device), False, 1)
    assert torch.all(outk.cpu() == 0)


@pytest.mark.parametrize("split_k", [2, 3, 8])
def test_fp8_gemm_nt_split_k(device, split_k):
    """split_k > 1: integer inputs stay bit-exact (every partial sum exact); random inputs within calc_diff;
    reruns are bitwise equal (deterministic reduction)."""
    gen = torch.Generator().manual_seed(split_k)
    a, sa, b, sb = _to(device, *_dense_inputs(37, 384, 1024, gen, integer=True))
    out = deepinfer_ops.fp8_gemm_nt(a, sa, b, sb, split_k=split_k)
    assert torch.equal(out.cpu(), refs.fp8_gemm_nt_ref(a.cpu(), sa.cpu(), b.cpu(), sb.cpu(), torch.bfloat16))
    a, sa, b, sb = _to(device, *_dense_inputs(64, 4096 if device == "cuda" else 256, 2048, gen))
    if device == "cuda":
        poison_cuda_scratch_()  # the split-K partial sums and flags live in the workspace
    out = deepinfer_ops.fp8_gemm_nt(a, sa, b, sb, split_k=split_k)
    assert calc_diff(out.cpu().float(), refs.fp8_gemm_nt_ref(a.cpu(), sa.cpu(), b.cpu(), sb.cpu(), torch.float32)) \
        < CALC_DIFF_MAX["fp8"]
    assert torch.equal(out, deepinfer_ops.fp8_gemm_nt(a, sa, b, sb, split_k=split_k))


@pytest.mark.native_errors
def test_fp8_gemm_nt_errors(device):
    a = torch.zeros(4, 256, dtype=FP8, device=device)
    b = torch.zeros(128, 256, dtype=FP8, device=device)
    sa = torch.ones(4, 2, device=device)
    sb = torch.ones(1, 2, device=device)
    with pytest.raises(RuntimeError, match="b_scale must be"):
        deepinfer_ops.fp8_gemm_nt(a, sa, b, torch.ones(2, 2, device=device))
    with pytest.raises(RuntimeError, match="a_scale must be"):
        deepinfer_ops.fp8_gemm_nt(a, torch.ones(4, 1, device=device), b, sb)
    with pytest.raises(RuntimeError, match="a must be torch.float8_e4m3fn"):
        deepinfer_ops.fp8_gemm_nt(a.float(), sa, b, sb)
    with pytest.raises(RuntimeError, match="b must be"):
        deepinfer_ops.fp8_gemm_nt(a, sa, torch.zeros(128, 128, dtype=FP8, device=device), sb)
    with pytest.raises(RuntimeError, match="out must be"):
        deepinfer_ops.fp8_gemm_nt(a, sa, b, sb, out=torch.empty(4, 127, dtype=torch.bfloat16, device=device))
    with pytest.raises(RuntimeError, match="accumulate=True needs a float32 out"):
        torch.ops.deepinfer_ops.fp8_gemm_nt(torch.empty(4, 128, dtype=torch.bfloat16, device=device), a, sa, b, sb,
                                            True, 1)
    with pytest.raises(RuntimeError, match="split_k > 1 needs a bfloat16 out"):
        deepinfer_ops.fp8_gemm_nt(a, sa, b, sb, out_dtype=torch.float32, split_k=2)


@pytest.mark.cuda
@pytest.mark.native_errors
def test_fp8_gemm_cuda_alignment_error():
    a = torch.zeros(4, 200, dtype=FP8, device="cuda")
    b = torch.zeros(128, 200, dtype=FP8, device="cuda")
    with pytest.raises(RuntimeError, match="multiple of 16 bytes"):
        deepinfer_ops.fp8_gemm_nt(a, torch.ones(4, 2, device="cuda"), b, torch.ones(1, 2, device="cuda"))


@pytest.mark.cuda
@pytest.mark.parametrize("nk", sorted(set(V4_FLASH_DENSE_NK + TINY_DENSE_NK)))
@pytest.mark.parametrize("m", [1, 64, 129, 1000, 4096])
def test_fp8_gemm_nt_model_shapes_cuda(nk, m):
    n, k = nk
    a, sa, b, sb = _dense_inputs(m, n, k, _cuda_gen(m + n + k))
    for scales in (sa, _col_major(sa)):
        out = poison_(torch.empty(m, n, dtype=torch.bfloat16, device="cuda"))
        deepinfer_ops.fp8_gemm_nt(a, scales, b, sb, out=out)
        ref = refs.fp8_gemm_nt_ref(a, sa, b, sb, torch.float32)  # float32 on the GPU (TF32 off by default)
        assert not torch.isnan(out).any()
        diff = calc_diff(out.float(), ref)
        assert diff < CALC_DIFF_MAX["fp8"], f"calc_diff {diff} at m={m} n={n} k={k}"


@pytest.mark.cuda
@pytest.mark.parametrize("nk", [(4096, 4096), (2112, 576), (448, 576)])
def test_fp8_gemm_nt_integer_bitwise_cuda_large(nk):
    n, k = nk
    a, sa, b, sb = _dense_inputs(1000, n, k, _cuda_gen(n), integer=True)
    out = deepinfer_ops.fp8_gemm_nt(a, _col_major(sa), b, sb, out_dtype=torch.float32)
    ref = refs.fp8_gemm_nt_ref(a, sa, b, sb, torch.float32)
    assert torch.equal(out, ref)


@pytest.mark.cuda
def test_fp8_gemm_nt_batch_invariant_cuda():
    """A row's result does not depend on M or on the other rows (no split-K; the kernel configuration -- 64x128
    ping-pong tiles at M <= 64 or when they fit in one wave, here M <= 128, else 128x128 cooperative ones -- and the
    tile visiting order, changed at M = 1024, never change the arithmetic), nor on the A-scale layout; reruns are
    equal."""
    a, sa, b, sb = _dense_inputs(4096, 4096, 7168, _cuda_gen(3))
    full = deepinfer_ops.fp8_gemm_nt(a, sa, b, sb)
    assert torch.equal(full, deepinfer_ops.fp8_gemm_nt(a, sa, b, sb))
    for m in (1, 7, 83, 128, 129, 1023, 1024, 1500, 4096):
        part = deepinfer_ops.fp8_gemm_nt(a[:m].contiguous(), sa[:m].contiguous(), b, sb)
        assert torch.equal(part, full[:m]), f"rows differ when computed in a batch of {m}"
    kb = sa.shape[1]
    for m in (1, 5, 83, 130):
        padded = scale_buffer(m, kb, "cuda", column_major=True)  # read in place (ld = round_up(m, 4))
        tight = torch.empty(kb, m, device="cuda").t()  # copied first when m % 4 != 0 (no padding in storage)
        for s in (padded, tight):
            s.copy_(sa[:m])
            assert torch.equal(deepinfer_ops.fp8_gemm_nt(a[:m], s, b, sb), full[:m]), f"m={m} strides {s.stride()}"


def _cuda_allocations():
    """Allocation requests served by the CUDA caching allocator so far (skips where the backend does not count)."""
    n = torch.cuda.memory_stats().get("allocation.all.allocated")
    if n is None:
        pytest.skip("this CUDA allocator backend keeps no allocation counts")
    return n


def _m_major_in_storage(sa, storage_floats, offset, ld):
    """``sa``'s values as an M-major view (strides ``(1, ld)``, storage offset ``offset``) of a NaN-filled storage of
    exactly ``storage_floats`` floats: the padding rows past the view are NaN where the storage has them."""
    s = torch.full((storage_floats,), float("nan"), device="cuda").as_strided(sa.shape, (1, ld), offset)
    return s.copy_(sa)


def _gemm_allocations(a, s, b, sb, out, ref):
    """Runs ``fp8_gemm_nt(a, s, b, sb, out=out)``, checks ``out == ref`` bit for bit, returns the allocations it made
    (its workspace, if any, plus the A-scale copy when it makes one)."""
    torch.cuda.synchronize()
    before = _cuda_allocations()
    deepinfer_ops.fp8_gemm_nt(a, s, b, sb, out=out)
    count = _cuda_allocations() - before
    assert torch.equal(out, ref), f"M={a.shape[0]} a_scale strides {s.stride()} offset {s.storage_offset()}"
    return count


@pytest.mark.cuda
def test_fp8_gemm_nt_a_scale_padding_outside_the_storage_is_copied_cuda():
    """The dense kernel reads round_up(M, 4) A-scale rows per K block (TMA). M-major scales whose last K block's
    padding rows lie inside their storage are read in place; others are copied first -- one more allocation than
    quant.scale_buffer's layout at the same M. Views ending exactly at / short of the last padding row, with
    storage_offset 0 / 4 / 8, kb == 1, ld > round_up(M, 4), and views narrowed from a padded buffer (``s[:m - 3]``,
    ``s[1:]``: unaligned, ``s[4:]``) each take the expected path (a storage check that ignored storage_offset, the
    last K block or the padding fails here) and give the bits of compact scales (NaN in the padding never reaches a
    stored row)."""
    n = 256
    for m, k in ((5, 384), (3, 128), (6, 256), (1, 384), (8, 256), (129, 256)):
        a, sa, b, sb = _dense_inputs(m, n, k, _cuda_gen(m + k))
        kb, need = sa.shape[1], -(-m // 4) * 4
        ref = deepinfer_ops.fp8_gemm_nt(a, sa, b, sb)  # row-major scales (always copied)
        out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")

        def in_place(r0, r1):  # allocations of a call on rows [r0, r1) whose scales are read in place
            s = scale_buffer(r1 - r0, kb, "cuda", column_major=True).copy_(sa[r0:r1])
            return _gemm_allocations(a[r0:r1], s, b, sb, out[r0:r1], ref[r0:r1])

        base = in_place(0, m)
        assert _gemm_allocations(a, torch.empty(kb, m, device="cuda").t().copy_(sa), b, sb, out, ref) == (
            base if m % 4 == 0 else base + 1), "compact M-major scales: in place iff M % 4 == 0"
        for ld in (need, need + 4):
            for off in (0, 4, 8):
                last = off + (kb - 1) * ld  # first float of the last K block
                for extra in range(need - m + 1):  # floats of storage past the view's last row
                    s = _m_major_in_storage(sa, last + m + extra, off, ld)
                    copies = m + extra < need
                    got = _gemm_allocations(a, s, b, sb, out, ref)
                    assert got == base + copies, (
                        f"m={m} kb={kb} ld={ld} offset={off}: storage ends {need - m - extra} floats before the last "
                        f"padding row, expected {'a copy' if copies else 'in place'}, {got - base} more allocations")
        if m >= 8:
            padded = scale_buffer(m, kb, "cuda", column_major=True).copy_(sa)
            for r0, r1, copies in ((0, m - 3, False), (1, m, True), (4, m, False)):
                got = _gemm_allocations(a[r0:r1], padded[r0:r1], b, sb, out[r0:r1], ref[r0:r1])
                assert got == in_place(r0, r1) + copies, f"padded[{r0}:{r1}]: expected a copy: {copies}"


@pytest.mark.cuda
def test_fp8_gemm_nt_a_scale_leading_dim_beyond_int_is_copied_cuda():
    """The kernel takes the A-scale leading dim and ld * ceil(K/128) as int: a view into a buffer with ld = 2^30 /
    2^31 (an 8 GiB storage) is copied, not read with a wrapped ld (illegal address or wrong rows)."""
    m, n, k = 5, 256, 256  # kb = 2
    a, sa, b, sb = _dense_inputs(m, n, k, _cuda_gen(17))
    ref = deepinfer_ops.fp8_gemm_nt(a, sa, b, sb)
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    base = _gemm_allocations(a, scale_buffer(m, 2, "cuda", column_major=True).copy_(sa), b, sb, out, ref)
    storage = torch.empty(2**31 + 8, device="cuda")
    for ld in (2**30, 2**31):
        s = storage.as_strided((m, 2), (1, ld)).copy_(sa)
        assert _gemm_allocations(a, s, b, sb, out, ref) == base + 1, f"ld={ld}: read in place"
    del storage, s
    torch.cuda.empty_cache()


@pytest.mark.cuda
@pytest.mark.parametrize("rows", [1, 3, 5, 127, 129])
def test_quant_op_scales_in_the_grouped_gemms_cuda(rows):
    """The quant ops' padded M-major scales (never-written padding rows) in both grouped GEMMs -- the fused MoE's
    swiglu scales in the contiguous one, the engine's wo_a ``xs.view(G, T, kb)`` in the masked one -- give the
    bits of row-major scales."""
    g, n, k = 3, 448, 576
    gen = _cuda_gen(rows)
    gate_up = torch.randn(rows, 2 * k, generator=gen, device="cuda") * 4
    hq, hs = deepinfer_ops.swiglu_clamp_quant_fp8(gate_up, 10.0, column_major_scales=True)
    assert hs.stride() == (1, -(-rows // 4) * 4)
    b, sb = _grouped_b(g, n, k, gen)
    m_idx = torch.sort(torch.randint(-1, g, (rows,), generator=gen, device="cuda")).values.to(torch.int32)
    init = torch.full((rows, n), 7.0, dtype=torch.bfloat16, device="cuda")
    got = deepinfer_ops.m_grouped_fp8_gemm_nt_contiguous(hq, hs, b, sb, m_idx, out=init.clone())
    ref = deepinfer_ops.m_grouped_fp8_gemm_nt_contiguous(hq, hs.contiguous(), b, sb, m_idx, out=init.clone())
    assert torch.equal(got, ref)

    x = torch.randn(g * rows, k, generator=gen, device="cuda") * 10
    xq, xs = deepinfer_ops.per_token_group_quant_fp8(x, 128, column_major_scales=True)
    masked = torch.tensor([rows, rows // 2, 0], dtype=torch.int32, device="cuda")
    init = torch.full((g, rows, n), 7.0, dtype=torch.bfloat16, device="cuda")
    got = deepinfer_ops.m_grouped_fp8_gemm_nt_masked(xq.view(g, rows, k), xs.view(g, rows, -1), b, sb, masked,
                                                     out=init.clone())
    ref = deepinfer_ops.m_grouped_fp8_gemm_nt_masked(xq.view(g, rows, k), xs.contiguous().view(g, rows, -1), b, sb,
                                                     masked, out=init.clone())
    assert torch.equal(got, ref)


# ---------------------------------------------------------------------------------------------------------------
# m_grouped_fp8_gemm_nt_contiguous
# ---------------------------------------------------------------------------------------------------------------
def _grouped_b(g, n, k, gen, integer=False):  # [G, N, K] e4m3 and [G, ceil(N/128), ceil(K/128)] scales
    nb, kb = -(-n // 128), -(-k // 128)
    if integer:
        return _int_fp8((g, n, k), gen), _rand_scales((g, nb, kb), gen, pow2=True)
    return _rand_fp8((g, n, k), gen, 30), _rand_scales((g, nb, kb), gen)


def _contiguous_layout(group_sizes, pad_between=3, gen=None):
    """m_indices with the groups in a shuffled order, each one contiguous run, padding (-1) runs between."""
    order = torch.randperm(len(group_sizes), generator=gen).tolist()
    idx = [-1] * pad_between
    for g in order:
        idx += [g] * group_sizes[g] + [-1] * pad_between
    return torch.tensor(idx, dtype=torch.int32)


@pytest.mark.parametrize("sizes_nk", [([5, 0, 130, 1], 256, 320), ([0, 0, 0], 128, 128), ([17, 64], 448, 576),
                                      ([1] * 8, 192, 256)])
@pytest.mark.parametrize("integer", [True, False])
@pytest.mark.parametrize("scale_layout", ["row", "padded"])
def test_m_grouped_contiguous(device, sizes_nk, integer, scale_layout):
    """Groups in shuffled order with padding rows between; K = 320 / 576 gives several K blocks, so each group's
    A scales must be found at its own rows for every K block (the CUDA kernel repacks them per group).
    "padded": A scales M-major with a padded leading dim and B scales with padded rows (NaN in the padding)."""
    sizes, n, k = sizes_nk
    gen = torch.Generator().manual_seed(len(sizes) + n + k + integer)
    m_idx = _contiguous_layout(sizes, gen=gen)
    m = m_idx.numel()
    kb = -(-k // 128)
    a = _int_fp8((m, k), gen) if integer else _rand_fp8((m, k), gen, 30)
    sa = _rand_scales((m, kb), gen, pow2=integer)
    b, sb = _grouped_b(len(sizes), n, k, gen, integer)
    a, sa, b, sb, m_idx_d = _to(device, a, sa, b, sb, m_idx)
    if scale_layout == "padded":
        sa, sb = _padded(sa.t()).t(), _padded(sb)
    out = poison_(torch.empty(m, n, dtype=torch.bfloat16, device=device))
    deepinfer_ops.m_grouped_fp8_gemm_nt_contiguous(a, sa, b, sb, m_idx_d, out=out)
    ref = refs.m_grouped_fp8_gemm_nt_contiguous_ref(a.cpu(), sa.cpu(), b.cpu(), sb.cpu(), m_idx,
                                                    out_init=torch.full_like(out.cpu(), float("nan")))
    got = out.cpu()
    pad = m_idx == -1
    assert torch.isnan(got[pad]).all(), "padding rows were written"
    assert not torch.isnan(got[~pad]).any(), "group rows left unwritten"
    if integer:
        assert torch.equal(got[~pad], ref[~pad])
    elif (~pad).any():
        assert calc_diff(got[~pad].float(), ref[~pad].float()) < CALC_DIFF_MAX["fp8"]


@pytest.mark.native_errors
def test_m_grouped_contiguous_errors(device):
    a = torch.zeros(4, 128, dtype=FP8, device=device)
    sa = torch.ones(4, 1, device=device)
    b = torch.zeros(2, 128, 128, dtype=FP8, device=device)
    sb = torch.ones(2, 1, 1, device=device)
    with pytest.raises(RuntimeError, match="m_indices must be"):
        deepinfer_ops.m_grouped_fp8_gemm_nt_contiguous(a, sa, b, sb, torch.zeros(3, dtype=torch.int32, device=device))
    with pytest.raises(RuntimeError, match="b_scale must be"):
        deepinfer_ops.m_grouped_fp8_gemm_nt_contiguous(a, sa, b, torch.ones(1, 1, 1, device=device),
                                                       torch.zeros(4, dtype=torch.int32, device=device))
    if device == "cpu":  # data-dependent checks need the values on the host
        with pytest.raises(RuntimeError, match="outside"):
            deepinfer_ops.m_grouped_fp8_gemm_nt_contiguous(a, sa, b, sb, torch.tensor([0, 2, 0, 0]))
        with pytest.raises(RuntimeError, match="contiguous run"):
            deepinfer_ops.m_grouped_fp8_gemm_nt_contiguous(a, sa, b, sb, torch.tensor([0, 1, 0, -1]))


@pytest.mark.cuda
@pytest.mark.parametrize("num_groups", [8, 32, 256])
@pytest.mark.parametrize("nk", [(4096, 4096), (4096, 2048), (2112, 576)])
def test_m_grouped_contiguous_expert_shapes_cuda(num_groups, nk):
    n, k = nk
    gen = torch.Generator().manual_seed(num_groups + n + k)
    sizes = torch.randint(0, 96, (num_groups,), generator=gen)
    sizes[0] = 0  # an empty group
    sizes[-1] = 300  # a group spanning several M tiles
    m_idx = _contiguous_layout(sizes.tolist(), pad_between=1, gen=gen).cuda()
    m = m_idx.numel()
    gen = _cuda_gen(num_groups + n + k)
    a = _rand_fp8((m, k), gen, 30)
    sa = _rand_scales((m, -(-k // 128)), gen)
    b, sb = _grouped_b(num_groups, n, k, gen)
    out = poison_(torch.empty(m, n, dtype=torch.bfloat16, device="cuda"))
    sa_col = _col_major(sa)
    poison_cuda_scratch_()  # the workspace (per-group sizes, pointers, packed scales) starts as 0xFF garbage
    deepinfer_ops.m_grouped_fp8_gemm_nt_contiguous(a, sa_col, b, sb, m_idx, out=out)
    ref = refs.m_grouped_fp8_gemm_nt_contiguous_ref(a, sa, b, sb, m_idx, out_init=torch.full_like(out, float("nan")))
    pad = m_idx == -1
    assert torch.isnan(out[pad]).all() and not torch.isnan(out[~pad]).any()
    assert calc_diff(out[~pad].float(), ref[~pad].float()) < CALC_DIFF_MAX["fp8"]


@pytest.mark.cuda
def test_m_grouped_contiguous_kernel_choice_same_bits_cuda():
    """<= 64 rows per group on average run the 64x128 ping-pong kernel, more the 128x128 cooperative one, and more
    rows per group than N visit the tiles along N: padding rows that move the average across those lines switch
    kernel and tile order but change no bit of the real rows."""
    n, k, g = 448, 576, 16
    gen = torch.Generator().manual_seed(5)
    sizes = torch.randint(0, 100, (g,), generator=gen).tolist()
    m_idx = _contiguous_layout(sizes, pad_between=1, gen=gen).cuda()
    m = m_idx.numel()
    assert m <= 64 * g
    gen = _cuda_gen(5)
    a = _rand_fp8((m + 8 * n * g, k), gen, 30)
    sa = _col_major(_rand_scales((a.shape[0], -(-k // 128)), gen))
    b, sb = _grouped_b(g, n, k, gen)
    real = m_idx != -1
    few = deepinfer_ops.m_grouped_fp8_gemm_nt_contiguous(a[:m], sa[:m], b, sb, m_idx)[real]
    for extra in (64 * g, 8 * n * g):  # cooperative along M, cooperative along N
        pad = torch.full((extra,), -1, dtype=torch.int32, device="cuda")
        out = deepinfer_ops.m_grouped_fp8_gemm_nt_contiguous(a[: m + extra], sa[: m + extra], b, sb,
                                                             torch.cat([m_idx, pad]))
        assert torch.equal(out[:m][real], few), f"{extra} padding rows changed the real rows"


# ---------------------------------------------------------------------------------------------------------------
# m_grouped_fp8_gemm_nt_masked
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("masked_nk", [([3, 0, 17, 32], 256, 320), ([0, 0], 128, 128), ([1, 129], 448, 576)])
@pytest.mark.parametrize("integer", [True, False])
@pytest.mark.parametrize("scale_layout", ["row", "col", "padded"])
def test_m_grouped_masked(device, masked_nk, integer, scale_layout):
    """masked_m below max_m and several K blocks: each group's A scales for every K block must come from its own
    rows (the CUDA kernel repacks them per group). "padded": M-major A scales and B scales with padded strides."""
    masked, n, k = masked_nk
    g, max_m = len(masked), max(max(masked), 1) + 5
    gen = torch.Generator().manual_seed(g + n + k + integer)
    kb = -(-k // 128)
    a = _int_fp8((g, max_m, k), gen) if integer else _rand_fp8((g, max_m, k), gen, 30)
    sa = _rand_scales((g, max_m, kb), gen, pow2=integer)
    if scale_layout == "col":
        sa = sa.transpose(1, 2).contiguous().transpose(1, 2)
    b, sb = _grouped_b(g, n, k, gen, integer)
    mm = torch.tensor(masked, dtype=torch.int32)
    a, sa, b, sb, mm_d = _to(device, a, sa, b, sb, mm)
    if scale_layout == "padded":
        sa, sb = _padded(sa.transpose(1, 2)).transpose(1, 2), _padded(sb)
    out = poison_(torch.empty(g, max_m, n, dtype=torch.bfloat16, device=device))
    deepinfer_ops.m_grouped_fp8_gemm_nt_masked(a, sa, b, sb, mm_d, out=out)
    got = out.cpu()
    ref = refs.m_grouped_fp8_gemm_nt_masked_ref(a.cpu(), sa.cpu(), b.cpu(), sb.cpu(), mm,
                                                torch.full_like(got, float("nan")))
    for gi, mv in enumerate(masked):
        assert torch.isnan(got[gi, mv:]).all(), f"group {gi}: rows >= masked_m written"
        assert not torch.isnan(got[gi, :mv]).any(), f"group {gi}: valid rows unwritten"
        if mv and integer:
            assert torch.equal(got[gi, :mv], ref[gi, :mv])
        elif mv:
            assert calc_diff(got[gi, :mv].float(), ref[gi, :mv].float()) < CALC_DIFF_MAX["fp8"]


def test_m_grouped_masked_group_interleaved_out(device):
    """out as a [T, G, N] buffer seen as [G, T, N] (group stride N, row stride G * N; the attention's wo_a output,
    written straight into wo_b's input): the same bits as a contiguous out, and nothing outside the valid rows."""
    g, t, n, k = 3, 37, 256, 384
    gen = torch.Generator().manual_seed(5)
    a = _rand_fp8((g, t, k), gen, 30)
    sa = _rand_scales((g, t, k // 128), gen)
    b, sb = _grouped_b(g, n, k, gen, False)
    masked = torch.tensor([t, 5, t], dtype=torch.int32)
    a, sa, b, sb, mm = _to(device, a, sa, b, sb, masked)
    ref = deepinfer_ops.m_grouped_fp8_gemm_nt_masked(a, sa, b, sb, mm)
    buf = poison_(torch.empty(t, g, n, dtype=torch.bfloat16, device=device))
    deepinfer_ops.m_grouped_fp8_gemm_nt_masked(a, sa, b, sb, mm, out=buf.transpose(0, 1))
    got = buf.transpose(0, 1)
    for gi, mv in enumerate(masked.tolist()):
        assert torch.equal(got[gi, :mv], ref[gi, :mv]), f"group {gi}"
        assert torch.isnan(got[gi, mv:].float()).all(), f"group {gi}: rows >= masked_m written"


@pytest.mark.native_errors
def test_m_grouped_masked_errors(device):
    a = torch.zeros(2, 4, 128, dtype=FP8, device=device)
    sa = torch.ones(2, 4, 1, device=device)
    b = torch.zeros(2, 128, 128, dtype=FP8, device=device)
    sb = torch.ones(2, 1, 1, device=device)
    with pytest.raises(RuntimeError, match="masked_m must be"):
        deepinfer_ops.m_grouped_fp8_gemm_nt_masked(a, sa, b, sb, torch.zeros(3, dtype=torch.int32, device=device))
    if device == "cpu":
        with pytest.raises(RuntimeError, match="outside"):
            deepinfer_ops.m_grouped_fp8_gemm_nt_masked(a, sa, b, sb, torch.tensor([1, 5]))


@pytest.mark.cuda
@pytest.mark.parametrize("num_groups,max_m", [(8, 256), (32, 64), (256, 16)])
def test_m_grouped_masked_expert_shapes_cuda(num_groups, max_m):
    n, k = 4096, 4096
    gen = _cuda_gen(num_groups)
    masked = torch.randint(0, max_m + 1, (num_groups,), generator=torch.Generator().manual_seed(num_groups),
                           dtype=torch.int32)
    masked[0] = 0
    masked[-1] = max_m
    masked_d = masked.cuda()
    a = _rand_fp8((num_groups, max_m, k), gen, 30)
    sa = _rand_scales((num_groups, max_m, k // 128), gen)
    b, sb = _grouped_b(num_groups, n, k, gen)
    out = poison_(torch.empty(num_groups, max_m, n, dtype=torch.bfloat16, device="cuda"))
    poison_cuda_scratch_()  # the workspace starts as 0xFF garbage: every field the kernels read must be written
    deepinfer_ops.m_grouped_fp8_gemm_nt_masked(a, sa, b, sb, masked_d, out=out)
    ref = refs.m_grouped_fp8_gemm_nt_masked_ref(a, sa, b, sb, masked, torch.full_like(out, float("nan")))
    valid = torch.arange(max_m, device="cuda")[None, :] < masked_d[:, None]
    assert torch.isnan(out[~valid]).all() and not torch.isnan(out[valid]).any()
    assert calc_diff(out[valid].float(), ref[valid].float()) < CALC_DIFF_MAX["fp8"]


@pytest.mark.cuda
def test_m_grouped_masked_kernel_choice_same_bits_cuda():
    """max_m <= 64 runs the 64x128 ping-pong kernel, larger max_m the 128x128 cooperative one: the same rows in a
    [G, 64, K] and in a [G, 65, K] buffer give the same bits."""
    g, n, k = 6, 448, 576
    gen = _cuda_gen(9)
    a = _rand_fp8((g, 65, k), gen, 30)
    sa = _rand_scales((g, 65, -(-k // 128)), gen)
    b, sb = _grouped_b(g, n, k, gen)
    masked = torch.tensor([0, 1, 17, 33, 64, 64], dtype=torch.int32, device="cuda")
    small = deepinfer_ops.m_grouped_fp8_gemm_nt_masked(a[:, :64].contiguous(), sa[:, :64].contiguous(), b, sb, masked)
    large = deepinfer_ops.m_grouped_fp8_gemm_nt_masked(a, sa, b, sb, masked)
    valid = torch.arange(64, device="cuda")[None, :] < masked[:, None]
    assert torch.equal(small[valid], large[:, :64][valid])


@pytest.mark.cuda
def test_m_grouped_masked_o_a_shape_cuda():
    """wo_a of V4-Flash as a masked grouped GEMM: 8 groups x (tokens, 4096) -> (tokens, 1024)."""
    gen = _cuda_gen(11)
    g, m, n, k = 8, 300, 1024, 4096
    a = _rand_fp8((g, m, k), gen, 30)
    sa = _rand_scales((g, m, k // 128), gen)
    b, sb = _grouped_b(g, n, k, gen)
    masked = torch.full((g,), m, dtype=torch.int32)
    masked_d = masked.cuda()
    out = deepinfer_ops.m_grouped_fp8_gemm_nt_masked(a, sa, b, sb, masked_d)
    ref = refs.m_grouped_fp8_gemm_nt_masked_ref(a, sa, b, sb, masked, torch.full_like(out, float("nan")))
    assert calc_diff(out.float(), ref.float()) < CALC_DIFF_MAX["fp8"]


# ---------------------------------------------------------------------------------------------------------------
# FP4 -> FP8 conversion
# ---------------------------------------------------------------------------------------------------------------
def _fp4_weight(n, k, gen, spread):
    w = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.int32).to(torch.uint8).view(torch.int8)
    base = torch.randint(110, 130, (n, 1), generator=gen)
    e = (base + torch.randint(0, spread + 1, (n, -(-k // 32)), generator=gen)).clamp(0, 254).to(torch.uint8)
    return w, e


@pytest.mark.parametrize("nk", [(256, 512), (130, 320), (7, 64)])
def test_fp4_to_fp8_exact_within_spread(device, nk):
    n, k = nk
    gen = torch.Generator().manual_seed(n + k)
    w, e = _fp4_weight(n, k, gen, spread=14)  # row bases differ by up to 19 too, but blocks mix 128 rows
    # make every block's exponents lie within 14 of its max: one base for all rows
    e = (120 + torch.randint(0, 15, e.shape, generator=gen)).to(torch.uint8)
    q, s = deepinfer_ops.fp4_to_fp8_blockscaled(w.to(device), e.to(device))
    qr, sr = refs.fp4_to_fp8_blockscaled_ref(w, e)
    assert torch.equal(q.cpu().view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s.cpu(), sr)
    m, _ = torch.frexp(s.cpu())
    assert torch.all(m == 0.5), "block scales must be powers of two (UE8M0-valued)"
    exact = refs.dequant_fp4_ref(w, e)
    assert torch.equal(refs.dequant_block_fp8_ref(q.cpu(), s.cpu()), exact), "conversion not exact"


def test_fp4_to_fp8_wide_spread_error_and_e8m0_dtype(device):
    """Blocks whose exponents spread beyond 14 binades lose only the tiny groups; report the measured error."""
    gen = torch.Generator().manual_seed(9)
    w, e = _fp4_weight(256, 512, gen, spread=24)
    e_dev = e.view(torch.float8_e8m0fnu).to(device)
    q, s = deepinfer_ops.fp4_to_fp8_blockscaled(w.to(device), e_dev)
    qr, sr = refs.fp4_to_fp8_blockscaled_ref(w, e)
    assert torch.equal(q.cpu().view(torch.uint8), qr.view(torch.uint8)) and torch.equal(s.cpu(), sr)
    exact = refs.dequant_fp4_ref(w, e)
    got = refs.dequant_block_fp8_ref(q.cpu(), s.cpu())
    diff = calc_diff(got, exact)
    # row bases 110..129 plus a per-group spread of 24: blocks span up to 43 binades; measured 1.2e-10
    assert 0 < diff < 1e-9, f"calc_diff {diff}"


def test_fp4_to_fp8_nan_scale():
    w = torch.zeros(128, 64, dtype=torch.int8)
    e = torch.full((128, 4), 127, dtype=torch.uint8)
    e[5, 1] = 255
    q, _ = deepinfer_ops.fp4_to_fp8_blockscaled(w, e)
    assert torch.isnan(q[5, 32:64].float()).all() and not torch.isnan(q[5, :32].float()).any()


@pytest.mark.native_errors
def test_fp4_to_fp8_errors():
    w = torch.zeros(128, 64, dtype=torch.int8)
    e = torch.full((128, 4), 127, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="w_scale must be"):
        deepinfer_ops.fp4_to_fp8_blockscaled(w, torch.zeros(128, 3, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="w must be int8 or uint8"):
        deepinfer_ops.fp4_to_fp8_blockscaled(w.float(), e)


# ---------------------------------------------------------------------------------------------------------------
# swiglu_clamp_quant_fp8
# ---------------------------------------------------------------------------------------------------------------
def _e4m3_ulp(v):
    e = torch.floor(torch.log2(v.abs().clamp(min=2.0 ** -6)))
    return torch.ldexp(torch.ones_like(v), (e - 3))


@pytest.mark.parametrize("rows_i", [(1, 128), (7, 200), (33, 2048), (0, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_swiglu_clamp_quant(device, rows_i, dtype, ue8m0):
    rows, i = rows_i
    gen = torch.Generator().manual_seed(rows + i)
    x = (torch.randn(rows, 2 * i, generator=gen) * 8).to(dtype)  # many values beyond the clamp of 10
    if rows > 1:
        x[1, 0] = float("nan")  # NaN gate: its group's scale and codes become NaN
    q = poison_(torch.empty(rows, i, dtype=FP8, device=device))
    s = poison_(torch.empty(rows, -(-i // 128), dtype=torch.float32, device=device))
    torch.ops.deepinfer_ops.swiglu_clamp_quant_fp8(q, s, x.to(device), 10.0, ue8m0)
    qr, sr = refs.swiglu_clamp_quant_fp8_ref(x, 10.0, ue8m0)
    q, s = q.cpu(), s.cpu()
    assert torch.equal(torch.isnan(s), torch.isnan(sr))
    fin = ~torch.isnan(sr)
    assert torch.allclose(s[fin], sr[fin], rtol=1e-5, atol=0)
    qf, qrf = q.float(), qr.float()
    assert torch.equal(torch.isnan(qf), torch.isnan(qrf))
    ok = ~torch.isnan(qrf)
    # exp() may differ by an ulp between implementations: allow one e4m3 step, on few elements
    d = (qf[ok] - qrf[ok]).abs()
    assert torch.all(d <= _e4m3_ulp(qrf[ok])), f"max code diff {d.max() if d.numel() else 0}"
    assert (d > 0).float().mean() < 0.01 if d.numel() else True


# ---------------------------------------------------------------------------------------------------------------
# fused MoE path
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter", [(9, 4, 2, 256, 128), (1, 8, 6, 384, 192),
                                                                (0, 4, 2, 256, 128)])
def test_fused_moe_fp8(device, tokens, experts, top_k, hidden, inter):
    gen = torch.Generator().manual_seed(tokens * 10 + experts)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]) if tokens else \
        torch.zeros(0, top_k, dtype=torch.int64)
    if tokens > 2:
        idx[2, -1] = -1  # a slot without an expert
    w = torch.rand(tokens, top_k, generator=gen)
    w13, s13 = _grouped_b(experts, 2 * inter, hidden, gen)
    w2, s2 = _grouped_b(experts, hidden, inter, gen)
    s13, s2 = s13 * 0.05, s2 * 0.05
    args = _to(device, x, idx, w, w13, s13, w2, s2)
    out = deepinfer_ops.fused_moe_fp8(*args, swiglu_limit=10.0, out_dtype=torch.float32)
    ref = refs.fused_moe_fp8_ref(x, idx, w, w13, s13, w2, s2, 10.0)
    assert out.shape == (tokens, hidden)
    if tokens:
        diff = calc_diff(out.cpu(), ref)
        assert diff < CALC_DIFF_MAX["fp8"], f"calc_diff {diff}"
        # batch invariance: token 0 alone gives the same bits
        alone = deepinfer_ops.fused_moe_fp8(args[0][:1], args[1][:1], args[2][:1], *args[3:], out_dtype=torch.float32)
        assert torch.equal(alone, out[:1])


# opcheck's test_schema perturbs inputs with arithmetic that float8 tensors do not support; the other utils run.
OPCHECK_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def test_ops_opcheck(device):
    gen = torch.Generator().manual_seed(0)
    a, sa, b, sb = _to(device, *_dense_inputs(5, 256, 256, gen))
    out = torch.empty(5, 256, dtype=torch.bfloat16, device=device)
    torch.library.opcheck(torch.ops.deepinfer_ops.fp8_gemm_nt.default, (out, a, sa, b, sb, False, 1),
                          test_utils=OPCHECK_UTILS)
    b3, sb3 = _to(device, *_grouped_b(2, 256, 256, gen))
    m_idx = torch.tensor([0, 0, -1, 1, 1], dtype=torch.int32, device=device)
    torch.library.opcheck(torch.ops.deepinfer_ops.m_grouped_fp8_gemm_nt_contiguous.default,
                          (out, a, sa, b3, sb3, m_idx), test_utils=OPCHECK_UTILS)
    a3 = a.view(1, 5, 256).expand(2, 5, 256).contiguous()
    masked = torch.tensor([5, 2], dtype=torch.int32, device=device)
    torch.library.opcheck(torch.ops.deepinfer_ops.m_grouped_fp8_gemm_nt_masked.default,
                          (torch.empty(2, 5, 256, dtype=torch.bfloat16, device=device), a3,
                           sa.expand(2, 5, 2).contiguous(), b3, sb3, masked), test_utils=OPCHECK_UTILS)
    x = torch.randn(4, 512, device=device)
    torch.library.opcheck(torch.ops.deepinfer_ops.swiglu_clamp_quant_fp8.default,
                          (torch.empty(4, 256, dtype=FP8, device=device), torch.empty(4, 2, device=device), x, 10.0,
                           False), test_utils=OPCHECK_UTILS)
    w = torch.randint(0, 256, (128, 64), dtype=torch.int32).to(torch.uint8)
    e = torch.full((128, 4), 127, dtype=torch.uint8)
    torch.library.opcheck(torch.ops.deepinfer_ops.fp4_to_fp8_blockscaled.default,
                          (torch.empty(128, 128, dtype=FP8), torch.empty(1, 1), w, e), test_utils=OPCHECK_UTILS)


@pytest.mark.parametrize("tokens,k,hidden,rows", [(1, 6, 4096, 6), (37, 6, 256, 200), (5, 1, 7, 5), (9, 8, 1000, 40)])
@pytest.mark.parametrize("y_dtype,out_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
                                               (torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16)])
def test_moe_combine_matches_reference(device, tokens, k, hidden, rows, y_dtype, out_dtype):
    """Slots added in order in float32; slots with row -1 or outside [0, rows) add nothing, and their rows of y
    (NaN here) are never read."""
    g = torch.Generator().manual_seed(tokens * 7 + k + hidden)
    y = torch.randn(rows, hidden, generator=g).to(y_dtype).to(device)
    slot_rows = torch.randint(0, rows, (tokens, k), generator=g)
    slot_rows[0, 0] = -1
    slot_rows[-1, -1] = rows + 3  # outside: no expert
    poisoned = rows - 1
    slot_rows[slot_rows == poisoned] = -1
    y[poisoned] = float("nan")
    slot_rows = slot_rows.to(device)
    w = torch.rand(tokens, k, generator=g).to(device)
    got = deepinfer_ops.moe_combine(y, slot_rows, w, out_dtype)
    want = refs.moe_combine_ref(y, slot_rows, w, out_dtype)
    assert not torch.isnan(got).any()
    assert_close(got, want, TOLERANCES[out_dtype], name="moe_combine")
    for lo, hi in ((0, 1), (tokens - 1, tokens)):  # batch invariance
        assert torch.equal(deepinfer_ops.moe_combine(y, slot_rows[lo:hi].clone(), w[lo:hi].clone(), out_dtype),
                           got[lo:hi])


@pytest.mark.native_errors
def test_moe_combine_bad_inputs(device):
    y = torch.randn(8, 64, device=device)
    rows = torch.zeros(3, 2, dtype=torch.long, device=device)
    w = torch.ones(3, 2, device=device)
    with pytest.raises(RuntimeError, match="slot_rows must be torch.int64"):
        deepinfer_ops.moe_combine(y, rows.int(), w)
    with pytest.raises(RuntimeError, match="weights shape"):
        deepinfer_ops.moe_combine(y, rows, torch.ones(3, 3, device=device))
    with pytest.raises(RuntimeError, match="weights must be torch.float32"):
        deepinfer_ops.moe_combine(y, rows, w.bfloat16())
    with pytest.raises(RuntimeError, match="y must be float32"):
        deepinfer_ops.moe_combine(y.int(), rows, w)


def test_moe_combine_opcheck(device):
    y = torch.randn(8, 64, dtype=torch.bfloat16, device=device)
    args = (torch.empty(3, 64, dtype=torch.bfloat16, device=device), y,
            torch.tensor([[0, 1], [2, -1], [7, 3]], device=device), torch.rand(3, 2, device=device))
    torch.library.opcheck(torch.ops.deepinfer_ops.moe_combine.default, args)


@pytest.mark.native_errors
def test_moe_combine_out_sharing_memory_with_an_input_is_refused(device):
    """out inside the gaps of a row-strided y (ATen's overlap test cannot decide that layout) or on top of the weights
    would be read after being written: refused naming both tensors."""
    buf = torch.randn(8, 128, device=device)
    y = buf[:, :64]  # rows 128 apart: out below (one 64-wide row) sits in a gap
    rows = torch.tensor([[0, 1]], device=device)
    with pytest.raises(RuntimeError, match="out and y share memory"):
        torch.ops.deepinfer_ops.moe_combine(buf[0:1, 64:128], y, rows, torch.rand(1, 2, device=device))
    out = torch.empty(1, 64, device=device)
    with pytest.raises(RuntimeError, match="out and weights share memory"):
        torch.ops.deepinfer_ops.moe_combine(out, y, rows, out.view(-1)[:2].view(1, 2))
