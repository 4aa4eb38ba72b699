"""mHC ops (hc_mix, hc_collapse, hc_post) against their fp32 references: V4 shapes, odd sizes, dtypes, empty and
strided inputs, poisoned outputs, in-place update, batch invariance, bad inputs."""

import pytest
import torch

import deepinfer_ops
from deepinfer_ops.testing import refs
from deepinfer_ops.testing.compare import TOLERANCES, Tolerance, assert_close, poison_

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# hc_mix returns float32 from rounded-dtype inputs: the error is float32 accumulation over K (not an output rounding)
MIX_TOL = Tolerance(atol=2e-4, rtol=2e-4, min_cosine=0.999999)


def _streams(tokens, hc, hidden, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(tokens, hc, hidden, generator=g) * 2).to(dtype).to(device), g


@pytest.mark.parametrize("tokens,k,m", [(1, 16384, 24), (7, 16384, 4), (83, 1000, 24), (1030, 256, 24),
                                        (5, 3, 1), (33, 4099, 32), (2050, 16384, 24)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_hc_mix_matches_reference(device, tokens, k, m, dtype):
    if tokens * k > 2_000_000 and (dtype != torch.bfloat16 or device == "cpu"):
        pytest.skip("largest shape covered on CUDA in bf16 only (keeps the CPU suite fast)")
    g = torch.Generator().manual_seed(tokens * 7 + k + m)
    x = (torch.randn(tokens, k, generator=g) * 3).to(dtype).to(device)
    fn = (torch.randn(m, k, generator=g) * 0.02).to(device)
    out = poison_(torch.empty(tokens, m, device=device))
    deepinfer_ops.hc_mix(x, fn, 1e-6, out=out)
    assert_close(out, refs.hc_mix_ref(x, fn, 1e-6), MIX_TOL, name="hc_mix")


@pytest.mark.cuda
@pytest.mark.parametrize("k,m", [(16384, 24), (4099, 13), (1000, 8), (300, 4), (256, 1), (5000, 16), (4096, 25)])
def test_cuda_hc_mix_bf16_any_token_count(k, m):
    """bf16 streams with M <= 24 take the tensor-core kernel (split fp32 weights): close to the fp32 reference and to
    the FMA kernel (DEEPINFER_HC_MIX_MMA=0), and a token's bits do not depend on how many tokens share the call;
    strided and misaligned rows too. M = 25 keeps the FMA kernel."""
    dtype = torch.bfloat16
    g = torch.Generator().manual_seed(k + m)
    tokens = 2048 + 37
    base = (torch.randn(tokens, k + 3, generator=g) * 3).to(dtype).cuda()
    fn = (torch.randn(m, k, generator=g) * 0.02).cuda()
    # contiguous rows (the cp.async path, several tiles a CTA when K is long), strided, strided and misaligned
    for x in (base[:, :k].contiguous(), base[:, :k], base[:, 1:k + 1]):
        full = deepinfer_ops.hc_mix(x, fn, 1e-6)
        assert_close(full, refs.hc_mix_ref(x, fn, 1e-6), MIX_TOL, name="hc_mix")
        split = torch.cat([deepinfer_ops.hc_mix(x[lo:lo + 1000], fn, 1e-6) for lo in range(0, tokens, 1000)])
        assert torch.equal(full, split), "hc_mix: a token's bits depend on the number of tokens"
        assert torch.equal(deepinfer_ops.hc_mix(x[5:6], fn, 1e-6), full[5:6])
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("DEEPINFER_HC_MIX_MMA", "0")
            fma = deepinfer_ops.hc_mix(x, fn, 1e-6)
        assert_close(full, fma, MIX_TOL, name="hc_mix (tensor cores vs FMA)")
        assert torch.equal(full, fma) == (m > 24), "the M > 24 call should take the FMA kernel, the others not"


def test_hc_mix_row_strided_and_misaligned(device):
    base = torch.randn(9, 4096 + 5, device=device, dtype=torch.bfloat16)
    fn = torch.randn(24, 4096, device=device) * 0.02
    for x in (base[:, :4096], base[:, 1:4097]):  # row stride 4101; the second also 2 bytes off alignment
        assert_close(deepinfer_ops.hc_mix(x, fn, 1e-6), refs.hc_mix_ref(x, fn, 1e-6), MIX_TOL, name="hc_mix")


def test_hc_mix_empty(device):
    out = deepinfer_ops.hc_mix(torch.empty(0, 64, device=device), torch.randn(24, 64, device=device), 1e-6)
    assert out.shape == (0, 24)


@pytest.mark.parametrize("tokens,hc,hidden", [(1, 4, 4096), (7, 4, 64), (83, 3, 200), (5, 1, 8), (40, 8, 1001),
                                              (9, 4, 24), (1500, 4, 4096)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_hc_collapse_and_post_match_reference(device, tokens, hc, hidden, dtype):
    if tokens * hidden > 1_000_000 and (dtype != torch.bfloat16 or device == "cpu"):
        pytest.skip("largest shape covered on CUDA in bf16 only (keeps the CPU suite fast)")
    streams, g = _streams(tokens, hc, hidden, dtype, device, tokens + hc * 31 + hidden)
    pre = torch.rand(tokens, hc, generator=g).to(device) + 0.5
    x = torch.randn(tokens, hidden, generator=g).to(dtype).to(device)
    post = 2 * torch.rand(tokens, hc, generator=g).to(device)
    comb = torch.rand(tokens, hc, hc, generator=g).to(device)
    out = poison_(torch.empty(tokens, hidden, dtype=dtype, device=device))
    deepinfer_ops.hc_collapse(streams, pre, out=out)
    assert_close(out, refs.hc_collapse_ref(streams, pre), TOLERANCES[dtype], name="hc_collapse")
    out = poison_(torch.empty_like(streams))
    deepinfer_ops.hc_post(streams, x, post, comb, out=out)
    assert_close(out, refs.hc_post_ref(streams, x, post, comb), TOLERANCES[dtype], name="hc_post")


def test_hc_post_in_place(device):
    streams, g = _streams(19, 4, 4096, torch.bfloat16, device, 3)
    x = torch.randn(19, 4096, generator=g).to(torch.bfloat16).to(device)
    post, comb = torch.rand(19, 4, generator=g).to(device), torch.rand(19, 4, 4, generator=g).to(device)
    expected = deepinfer_ops.hc_post(streams, x, post, comb)
    deepinfer_ops.hc_post(streams, x, post, comb, out=streams)
    assert torch.equal(streams, expected)


def test_hc_ops_empty(device):
    streams = torch.empty(0, 4, 64, device=device)
    assert deepinfer_ops.hc_collapse(streams, torch.empty(0, 4, device=device)).shape == (0, 64)
    out = deepinfer_ops.hc_post(streams, torch.empty(0, 64, device=device), torch.empty(0, 4, device=device),
                                torch.empty(0, 4, 4, device=device))
    assert out.shape == (0, 4, 64)


def test_hc_ops_batch_invariant(device):
    """A token's outputs are bitwise the same alone and inside batches of any size (CUDA: across the 1- and
    4-token-per-CTA hc_mix kernels)."""
    torch.manual_seed(0)
    T, hc, D = 2048 if device == "cuda" else 64, 4, 4096 if device == "cuda" else 256
    streams = torch.randn(T, hc, D, dtype=torch.bfloat16, device=device)
    fn = torch.randn(24, hc * D, device=device) * 0.02
    pre, post = torch.rand(T, hc, device=device), torch.rand(T, hc, device=device)
    comb = torch.rand(T, hc, hc, device=device)
    x = torch.randn(T, D, dtype=torch.bfloat16, device=device)
    full = (deepinfer_ops.hc_mix(streams.view(T, -1), fn, 1e-6), deepinfer_ops.hc_collapse(streams, pre),
            deepinfer_ops.hc_post(streams, x, post, comb))
    for lo, hi in ((0, 1), (0, 7), (5, 38), (T - 1, T)):
        part = (deepinfer_ops.hc_mix(streams[lo:hi].reshape(hi - lo, -1).clone(), fn, 1e-6),
                deepinfer_ops.hc_collapse(streams[lo:hi].clone(), pre[lo:hi].clone()),
                deepinfer_ops.hc_post(streams[lo:hi].clone(), x[lo:hi].clone(), post[lo:hi].clone(),
                                      comb[lo:hi].clone()))
        for name, a, b in zip(("hc_mix", "hc_collapse", "hc_post"), part, full):
            assert torch.equal(a, b[lo:hi]), f"{name}: tokens {lo}..{hi} differ alone vs in a batch of {T}"


@pytest.mark.native_errors
def test_hc_ops_bad_inputs(device):
    x = torch.randn(4, 64, device=device)
    with pytest.raises(RuntimeError, match="fn must be torch.float32"):
        deepinfer_ops.hc_mix(x, torch.randn(24, 64, device=device, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(RuntimeError, match=r"fn must be \[M, 64\]"):
        deepinfer_ops.hc_mix(x, torch.randn(24, 32, device=device), 1e-6)
    with pytest.raises(RuntimeError, match="fn must have 1 to 32 rows"):
        deepinfer_ops.hc_mix(x, torch.randn(33, 64, device=device), 1e-6)
    with pytest.raises(RuntimeError, match="x must be float32, bfloat16 or float16"):
        deepinfer_ops.hc_mix(x.int(), torch.randn(24, 64, device=device), 1e-6)
    buf = torch.randn(2 * 4 * 4 * 64, device=device)
    streams = buf[:1024].view(4, 4, 64)
    with pytest.raises(RuntimeError, match=r"pre must be \[4, 4\]"):
        deepinfer_ops.hc_collapse(streams, torch.rand(4, 3, device=device))
    with pytest.raises(RuntimeError, match="streams must have 1 to 8 streams"):
        deepinfer_ops.hc_collapse(torch.randn(4, 9, 64, device=device), torch.rand(4, 9, device=device))
    with pytest.raises(RuntimeError, match="streams must be contiguous"):
        deepinfer_ops.hc_collapse(streams.transpose(0, 1), torch.rand(4, 4, device=device))
    with pytest.raises(RuntimeError, match="x dtype"):
        deepinfer_ops.hc_post(streams, x.bfloat16(), torch.rand(4, 4, device=device),
                              torch.rand(4, 4, 4, device=device))
    with pytest.raises(RuntimeError, match=r"comb must be \[4, 4, 4\]"):
        deepinfer_ops.hc_post(streams, x, torch.rand(4, 4, device=device), torch.rand(4, 4, device=device))
    with pytest.raises(RuntimeError, match="out and streams share memory partially"):
        deepinfer_ops.hc_post(streams, x, torch.rand(4, 4, device=device), torch.rand(4, 4, 4, device=device),
                              out=buf[8:8 + 1024].view(4, 4, 64))


def test_hc_ops_opcheck(device):
    streams = torch.randn(5, 4, 64, dtype=torch.bfloat16, device=device)
    fn = torch.randn(24, 256, device=device)
    pre, comb = torch.rand(5, 4, device=device), torch.rand(5, 4, 4, device=device)
    x = torch.randn(5, 64, dtype=torch.bfloat16, device=device)
    torch.library.opcheck(torch.ops.deepinfer_ops.hc_mix.default,
                          (torch.empty(5, 24, device=device), streams.view(5, -1), fn, 1e-6))
    torch.library.opcheck(torch.ops.deepinfer_ops.hc_collapse.default,
                          (torch.empty(5, 64, dtype=torch.bfloat16, device=device), streams, pre))
    torch.library.opcheck(torch.ops.deepinfer_ops.hc_post.default,
                          (torch.empty_like(streams), streams, x, pre, comb))


@pytest.mark.parametrize("tokens,hc,iters", [(1, 4, 20), (37, 4, 20), (300, 4, 1), (5, 1, 3), (9, 8, 7), (4, 3, 0),
                                             (33, 2, 20), (131, 4, 20), (3, 4, 0)])
def test_hc_weights_matches_reference(device, tokens, hc, iters):
    g = torch.Generator().manual_seed(tokens * 13 + hc + iters)
    m = 2 * hc + hc * hc
    mix = (torch.randn(tokens, m, generator=g) * 3).to(device)
    base = torch.randn(m, generator=g).to(device)
    scale = (torch.rand(3, generator=g) + 0.5).to(device)
    got = deepinfer_ops.hc_weights(mix, base, scale, hc, 1e-6, iters)
    want = refs.hc_weights_ref(mix, base, scale, hc, 1e-6, iters)
    for name, a, b in zip(("pre", "post", "comb"), got, want):
        assert_close(a, b, Tolerance(atol=2e-6, rtol=2e-5, min_cosine=0.999999), name=f"hc_weights {name}")
    # comb is (close to) doubly stochastic after enough iterations
    if iters >= 20:
        torch.testing.assert_close(got[2].sum(dim=-2), torch.ones(tokens, hc, device=device), atol=1e-4, rtol=0)


def test_hc_weights_batch_invariant_and_nan(device):
    g = torch.Generator().manual_seed(1)
    mix = torch.randn(50, 24, generator=g).to(device)
    mix[7, 3] = float("nan")
    base, scale = torch.randn(24, generator=g).to(device), torch.ones(3, device=device)
    full = deepinfer_ops.hc_weights(mix, base, scale, 4, 1e-6, 20)
    assert torch.isnan(full[0][7, 3]) and not torch.isnan(full[0][8]).any()
    for lo, hi in ((0, 1), (6, 9), (49, 50)):
        part = deepinfer_ops.hc_weights(mix[lo:hi].clone(), base, scale, 4, 1e-6, 20)
        for a, b in zip(part, full):
            assert torch.equal(a.view(torch.int32), b[lo:hi].view(torch.int32))


@pytest.mark.native_errors
def test_hc_weights_bad_inputs(device):
    mix = torch.randn(4, 24, device=device)
    base, scale = torch.randn(24, device=device), torch.ones(3, device=device)
    with pytest.raises(RuntimeError, match=r"mix must be \[4, 15\]"):
        deepinfer_ops.hc_weights(mix, base, scale, 3, 1e-6, 20)
    with pytest.raises(RuntimeError, match=r"scale must be \[3\]"):
        deepinfer_ops.hc_weights(mix, base, torch.ones(2, device=device), 4, 1e-6, 20)
    with pytest.raises(RuntimeError, match="base must be torch.float32"):
        deepinfer_ops.hc_weights(mix, base.double(), scale, 4, 1e-6, 20)
    with pytest.raises(RuntimeError, match="sinkhorn_iters must be >= 0"):
        deepinfer_ops.hc_weights(mix, base, scale, 4, 1e-6, -1)
    with pytest.raises(RuntimeError, match="hc <= 8"):
        deepinfer_ops.hc_weights(torch.randn(4, 2 * 9 + 81, device=device), torch.randn(99, device=device), scale, 9,
                                 1e-6, 20)


def test_hc_weights_opcheck(device):
    mix = torch.randn(5, 24, device=device)
    args = (torch.empty(5, 4, device=device), torch.empty(5, 4, device=device), torch.empty(5, 4, 4, device=device),
            mix, torch.randn(24, device=device), torch.ones(3, device=device), 1e-6, 20)
    torch.library.opcheck(torch.ops.deepinfer_ops.hc_weights.default, args)


@pytest.mark.native_errors
def test_hc_ops_out_sharing_memory_with_an_input_is_refused(device):
    # out over the float32 weights (fn / pre / post / comb), or over a row-strided x (a layout ATen's overlap test
    # calls "too hard"), would be read after it is written: silently wrong results before the check.
    w = torch.randn(5, 5, device=device)
    with pytest.raises(RuntimeError, match="out and fn share memory"):
        deepinfer_ops.hc_mix(torch.randn(5, 5, device=device), w, 1e-6, out=w)
    base = torch.randn(5 * 16, device=device)
    x = base.view(5, 16)[:, :8]  # row stride 16
    with pytest.raises(RuntimeError, match="out and x share memory"):
        deepinfer_ops.hc_mix(x, torch.randn(4, 8, device=device), 1e-6, out=base[:20].view(5, 4))
    pre = torch.rand(3, 4, device=device)
    with pytest.raises(RuntimeError, match="out and pre share memory"):
        deepinfer_ops.hc_collapse(torch.randn(3, 4, 4, device=device), pre, out=pre)
    streams, xo = torch.randn(3, 4, 4, device=device), torch.randn(3, 4, device=device)
    post, comb = torch.rand(3, 4, device=device), torch.rand(3, 4, 4, device=device)
    with pytest.raises(RuntimeError, match="out and comb share memory"):
        deepinfer_ops.hc_post(streams, xo, post, comb, out=comb)
    buf = torch.rand(48, device=device)
    with pytest.raises(RuntimeError, match="out and post share memory"):
        deepinfer_ops.hc_post(streams, xo, buf[:12].view(3, 4), comb, out=buf.view(3, 4, 4))
    # disjoint parts of one buffer are fine (rows of a row-strided x with out in another part of the storage)
    out = base.view(5, 16)[:, 8:12]
    with pytest.raises(RuntimeError, match="out must be contiguous"):
        deepinfer_ops.hc_mix(x, torch.randn(4, 8, device=device), 1e-6, out=out)
    big = torch.randn(5 * 16 + 20, device=device)
    xb = big[:80].view(5, 16)[:, :8]
    got = deepinfer_ops.hc_mix(xb, w.new_ones(4, 8), 1e-6, out=big[80:].view(5, 4))
    assert_close(got, refs.hc_mix_ref(xb, w.new_ones(4, 8), 1e-6), MIX_TOL, name="hc_mix")


@pytest.mark.native_errors
def test_hc_ops_zero_dim_inputs_name_the_tensor(device):
    """0-dim tensors (no out given): the op's own error naming the tensor, not an IndexError from the wrapper's
    output allocation."""
    s = torch.tensor(1.0, device=device)
    with pytest.raises(RuntimeError, match=r"hc_mix: x must be \[tokens, K\]"):
        deepinfer_ops.hc_mix(s, torch.randn(3, 4, device=device), 1e-6)
    with pytest.raises(RuntimeError, match=r"hc_mix: fn must be \[M, 4\]"):
        deepinfer_ops.hc_mix(torch.randn(2, 4, device=device), s, 1e-6)
    with pytest.raises(RuntimeError, match=r"hc_collapse: streams must be \[tokens, hc, hidden\]"):
        deepinfer_ops.hc_collapse(s, torch.rand(2, 4, device=device))
    with pytest.raises(RuntimeError, match=r"hc_post: streams must be \[tokens, hc, hidden\]"):
        deepinfer_ops.hc_post(s, torch.randn(2, device=device), torch.rand(2, 4, device=device),
                              torch.rand(2, 4, 4, device=device))


@pytest.mark.cuda
@pytest.mark.native_errors
def test_hc_mix_cuda_refuses_k_past_the_grid_limit():
    """hc_mix's CUDA split path runs one CTA row per 256 columns of K (gridDim.y <= 65535): a longer K is refused
    naming x and the limit instead of a failed launch."""
    k = 65535 * 1024 + 1
    x = torch.zeros(1, k, dtype=torch.bfloat16, device="cuda")
    fn = torch.zeros(1, k, device="cuda")
    with pytest.raises(RuntimeError, match=r"hc_mix: x has K = 67107841 columns; the CUDA kernel takes at most"):
        deepinfer_ops.hc_mix(x, fn, 1e-6)
