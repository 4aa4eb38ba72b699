"""Sparse MQA attention (decode, prefill), indexer logits, top-k and paged-cache writes against the fp32 references.

CPU cases use small shapes (seconds); `cuda` cases add V4-Flash shapes (h=64, head_dim 512, topk 512 + window 128),
the h / s_q sweep, 64-bit cache offsets and batch invariance. Outputs are NaN-poisoned before every call.
"""

from __future__ import annotations

import pytest
import torch

import deepinfer_ops
from deepinfer_ops.testing import refs
from deepinfer_ops.testing.compare import BF16_WEIGHTS_REL, TOLERANCES, assert_close, poison_

BF16 = TOLERANCES[torch.bfloat16]
FP32 = TOLERANCES[torch.float32]
V4_DIM, V4_HEADS, V4_TOPK, V4_WINDOW, V4_SCALE = 512, 64, 512, 128, 512 ** -0.5


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _cache(num_blocks, block_size, dim, g, device, block_pad=0):
    """Random bf16 paged cache; block_pad > 0 gives a block stride larger than block_size * dim."""
    base = torch.randn(num_blocks, block_size * dim + block_pad, generator=g).bfloat16()
    return base.to(device)[:, : block_size * dim].view(num_blocks, block_size, dim)


def _indices(shape, num_slots, g, device, invalid_frac=0.1):
    idx = torch.randint(0, max(num_slots, 1), shape, generator=g, dtype=torch.int32)
    bad = torch.rand(shape, generator=g) < invalid_frac
    junk = torch.where(torch.rand(shape, generator=g) < 0.5, torch.full(shape, -1, dtype=torch.int32),
                       torch.full(shape, num_slots + 7, dtype=torch.int32))
    return torch.where(bad, junk, idx).to(device)


def _run_decode(q, cache, idx, scale, **kw):
    out = poison_(torch.empty_like(q))
    lse = poison_(torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device))
    torch.ops.deepinfer_ops.sparse_mqa_decode(out, lse, q, cache, idx, kw.get("topk_length"), kw.get("extra_kv_cache"),
                                              kw.get("extra_indices"), kw.get("extra_topk_length"),
                                              kw.get("attn_sink"), scale)
    return out, lse


def _check(out, lse, ref_out, ref_lse):
    assert_close(out, ref_out, BF16, "out")
    assert_close(lse, ref_lse, BF16, "lse")


def _decode_case(device, b, s_q, h, dim, topk, window, block_size, seed, sink=True, lengths=True, q_scale=1.0):
    g = _gen(seed)
    q = (torch.randn(b, s_q, h, dim, generator=g) * q_scale).bfloat16().to(device)
    comp = _cache(max(1, (b * topk) // block_size + 3), block_size, dim, g, device, block_pad=8)
    win = _cache(max(1, (b * window) // block_size + 2), block_size, dim, g, device)
    idx = _indices((b, s_q, topk), comp.shape[0] * block_size, g, device)
    widx = _indices((b, s_q, window), win.shape[0] * block_size, g, device)
    kw = dict(extra_kv_cache=win, extra_indices=widx)
    if lengths:
        kw["topk_length"] = torch.randint(0, topk + 3, (b,), generator=g, dtype=torch.int32).to(device)
        kw["extra_topk_length"] = torch.randint(0, window + 1, (b,), generator=g, dtype=torch.int32).to(device)
    if sink:
        kw["attn_sink"] = torch.randn(h, generator=g).to(device)
    return q, comp, idx, kw


# ---- sparse_mqa_decode ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("b,s_q,h,dim,topk,window,block_size", [
    (2, 1, 1, 64, 20, 8, 4), (3, 2, 8, 128, 37, 16, 16), (2, 3, 16, 512, 64, 0, 64), (1, 4, 5, 256, 70, 9, 7),
])
@pytest.mark.parametrize("sink,lengths", [(True, True), (False, False)])
def test_decode_matches_ref(device, b, s_q, h, dim, topk, window, block_size, sink, lengths):
    q, comp, idx, kw = _decode_case(device, b, s_q, h, dim, topk, window, block_size, b * 100 + h, sink, lengths)
    if window == 0:
        kw.pop("extra_kv_cache"), kw.pop("extra_indices"), kw.pop("extra_topk_length", None)
    out, lse = _run_decode(q, comp, idx, dim ** -0.5, **kw)
    _check(out, lse, *refs.sparse_mqa_decode_ref(q, comp, idx, dim ** -0.5, **kw))


def test_decode_wrapper_and_peaked_softmax(device):
    # Large logits (scale 1, |q.k| ~ 20) stress the online-softmax rescaling.
    q, comp, idx, kw = _decode_case(device, 2, 2, 8, 128, 150, 24, 16, 7, q_scale=2.0)
    out, lse = deepinfer_ops.sparse_mqa_decode(q, comp, idx, 1.0 / 8, **kw)
    _check(out, lse, *refs.sparse_mqa_decode_ref(q, comp, idx, 1.0 / 8, **kw))


def test_decode_all_invalid_gives_zero_out_and_neg_inf_lse(device):
    g = _gen(1)
    q = torch.randn(2, 2, 8, 64, generator=g).bfloat16().to(device)
    cache = _cache(4, 8, 64, g, device)
    idx = torch.tensor([-1, 32, 1000, -5], dtype=torch.int32, device=device).repeat(2, 2, 3)  # none in [0, 32)
    for sink in (None, torch.randn(8, generator=g).to(device)):
        out, lse = _run_decode(q, cache, idx, 0.125, attn_sink=sink)
        assert torch.equal(out.float().cpu(), torch.zeros(2, 2, 8, 64))
        assert torch.all(lse.cpu() == float("-inf"))
        ref_out, ref_lse = refs.sparse_mqa_decode_ref(q, cache, idx, 0.125, attn_sink=sink)
        _check(out, lse, ref_out, ref_lse)


def test_decode_nonfinite_scores(device):
    """Every score -inf (q = -inf against positive keys, or a scale that overflows the scores to -inf) follows the
    empty-set rule (out 0, lse -inf, with or without a sink); a +inf or NaN score gives NaN out and lse (NaN in, NaN
    out); the other heads are unaffected."""
    g = _gen(31)
    cache = (torch.rand(2, 4, 64, generator=g) + 0.1).bfloat16().to(device)
    idx = torch.arange(8, dtype=torch.int32).view(1, 1, 8).to(device)
    q = torch.randn(1, 1, 4, 64, generator=g).bfloat16()
    q[0, 0, 0], q[0, 0, 1], q[0, 0, 2] = float("-inf"), float("inf"), float("nan")
    q = q.to(device)
    for sink in (None, torch.randn(4, generator=g).to(device)):
        out, lse = _run_decode(q, cache, idx, 0.125, attn_sink=sink)
        ref_out, ref_lse = refs.sparse_mqa_decode_ref(q, cache, idx, 0.125, attn_sink=sink)
        for o, l in ((out.float().cpu(), lse.cpu()), (ref_out.float().cpu(), ref_lse.cpu())):
            assert torch.all(o[0, 0, 0] == 0) and l[0, 0, 0] == float("-inf")
            assert torch.all(torch.isnan(o[0, 0, 1:3])) and torch.all(torch.isnan(l[0, 0, 1:3]))
        mag = ref_out[0, 0, 3:].float().abs().amax()
        assert_close(out[0, 0, 3:], ref_out[0, 0, 3:], BF16, "out", extra_atol=BF16_WEIGHTS_REL * mag)
        assert_close(lse[0, 0, 3:], ref_lse[0, 0, 3:], BF16, "lse")
    qn = -(torch.rand(1, 1, 2, 64, generator=g) + 0.1).bfloat16().to(device)  # q . k < 0: * 1e38 -> -inf
    out, lse = _run_decode(qn, cache, idx, 1e38)
    assert torch.equal(out.float().cpu(), torch.zeros(1, 1, 2, 64)) and torch.all(lse.cpu() == float("-inf"))
    ref_out, ref_lse = refs.sparse_mqa_decode_ref(qn, cache, idx, 1e38)
    assert torch.equal(ref_out.float().cpu(), torch.zeros(1, 1, 2, 64)) and torch.all(ref_lse.cpu() == float("-inf"))


def test_decode_topk_length_zero_and_partial(device):
    q, comp, idx, kw = _decode_case(device, 3, 2, 4, 64, 40, 10, 8, 3)
    kw["topk_length"] = torch.tensor([0, 40, 17], dtype=torch.int32, device=device)
    kw["extra_topk_length"] = torch.tensor([0, 3, 10], dtype=torch.int32, device=device)
    out, lse = _run_decode(q, comp, idx, 0.125, **kw)
    _check(out, lse, *refs.sparse_mqa_decode_ref(q, comp, idx, 0.125, **kw))
    assert torch.all(out[0].float() == 0) and torch.all(lse[0] == float("-inf"))
    # Entries past topk_length are never read: changing them changes nothing.
    idx2 = idx.clone()
    idx2[2, :, 17:] = 0
    out2, lse2 = _run_decode(q, comp, idx2, 0.125, **kw)
    assert torch.equal(out2.cpu(), out.cpu()) and torch.equal(lse2.cpu(), lse.cpu())


def test_decode_out_of_range_indices_are_invalid(device):
    g = _gen(5)
    q = torch.randn(1, 1, 8, 64, generator=g).bfloat16().to(device)
    cache = _cache(3, 4, 64, g, device)
    good = torch.tensor([[[0, 5, 11]]], dtype=torch.int32, device=device)
    mixed = torch.tensor([[[0, 12, 5, -1, 11, 2**31 - 1, -2**31]]], dtype=torch.int32, device=device)
    out_a, lse_a = _run_decode(q, cache, good, 0.125)
    out_b, lse_b = _run_decode(q, cache, mixed, 0.125)
    assert torch.equal(out_a.cpu(), out_b.cpu()) and torch.equal(lse_a.cpu(), lse_b.cpu())


def test_decode_empty_inputs(device):
    g = _gen(2)
    cache = _cache(2, 4, 64, g, device)
    q = torch.randn(0, 2, 8, 64, generator=g).bfloat16().to(device)
    out, lse = _run_decode(q, cache, torch.zeros(0, 2, 5, dtype=torch.int32, device=device), 0.125)
    assert out.shape == (0, 2, 8, 64) and lse.shape == (0, 2, 8)
    q = torch.randn(1, 2, 8, 64, generator=g).bfloat16().to(device)
    out, lse = _run_decode(q, cache, torch.zeros(1, 2, 0, dtype=torch.int32, device=device), 0.125)  # topk = 0
    assert torch.all(out.float() == 0) and torch.all(lse == float("-inf"))


@pytest.mark.native_errors
def test_decode_errors_name_the_tensor(device):
    g = _gen(4)
    q = torch.randn(1, 1, 8, 64, generator=g).bfloat16().to(device)
    cache = _cache(2, 4, 64, g, device)
    idx = torch.zeros(1, 1, 3, dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError, match="indices must be torch.int32"):
        deepinfer_ops.sparse_mqa_decode(q, cache, idx.long(), 0.1)
    with pytest.raises(RuntimeError, match="kv_cache head_dim"):
        deepinfer_ops.sparse_mqa_decode(q, _cache(2, 4, 128, g, device), idx, 0.1)
    with pytest.raises(RuntimeError, match="attn_sink must be"):
        deepinfer_ops.sparse_mqa_decode(q, cache, idx, 0.1, attn_sink=torch.zeros(3, device=device))
    with pytest.raises(RuntimeError, match="topk_length must be"):
        deepinfer_ops.sparse_mqa_decode(q, cache, idx, 0.1, topk_length=torch.zeros(2, dtype=torch.int32,
                                                                                     device=device))
    with pytest.raises(RuntimeError, match="given together"):
        deepinfer_ops.sparse_mqa_decode(q, cache, idx, 0.1, extra_kv_cache=cache)


@pytest.mark.native_errors
def test_outputs_with_shared_elements_are_refused(device):
    # Every tensor an attention op writes: an expanded (stride-0) view is refused with an error naming the tensor,
    # before anything is written.
    g = _gen(5)
    ops = torch.ops.deepinfer_ops
    q = torch.randn(1, 2, 8, 64, generator=g).bfloat16().to(device)
    cache = _cache(2, 4, 64, g, device)
    idx = torch.zeros(1, 2, 3, dtype=torch.int32, device=device)
    out, lse = torch.empty_like(q), torch.empty(1, 2, 8, device=device)
    out_x = torch.empty(1, 1, 8, 64, dtype=torch.bfloat16, device=device).expand(1, 2, 8, 64)
    lse_x = torch.empty(1, 1, 8, device=device).expand(1, 2, 8)
    with pytest.raises(RuntimeError, match="sparse_mqa_decode: out has elements that share memory"):
        ops.sparse_mqa_decode(out_x, lse, q, cache, idx, None, None, None, None, None, 0.1)
    with pytest.raises(RuntimeError, match="sparse_mqa_decode: lse has elements that share memory"):
        ops.sparse_mqa_decode(out, lse_x, q, cache, idx, None, None, None, None, None, 0.1)
    with pytest.raises(RuntimeError, match="sparse_mqa_prefill: out has elements that share memory"):
        ops.sparse_mqa_prefill(out_x[0], lse[0], q[0], cache, idx[0], None, None, None, None, None, 0.1)
    with pytest.raises(RuntimeError, match="sparse_mqa_prefill: lse has elements that share memory"):
        ops.sparse_mqa_prefill(out[0], lse_x[0], q[0], cache, idx[0], None, None, None, None, None, 0.1)

    qi = torch.randn(2, 4, 64, generator=g).bfloat16().to(device)
    w = torch.randn(2, 4, device=device)
    logits_x = torch.empty(1, 8, device=device).expand(2, 8)
    with pytest.raises(RuntimeError, match="mqa_logits: logits has elements that share memory"):
        ops.mqa_logits(logits_x, qi, w, cache, None, None, None)

    scores = torch.randn(3, 10, generator=g).to(device)
    values, indices = torch.empty(3, 4, device=device), torch.empty(3, 4, dtype=torch.int64, device=device)
    with pytest.raises(RuntimeError, match="topk_rows: values has elements that share memory"):
        ops.topk_rows(torch.empty(1, 4, device=device).expand(3, 4), indices, scores)
    with pytest.raises(RuntimeError, match="topk_rows: indices has elements that share memory"):
        ops.topk_rows(values, torch.empty(3, 1, dtype=torch.int64, device=device).expand(3, 4), scores)

    slots = torch.arange(2, device=device)
    before = cache.clone()
    with pytest.raises(RuntimeError, match="kv_cache_write: kv_cache has elements that share memory"):
        ops.kv_cache_write(cache[:1].expand(2, 4, 64), torch.randn(2, 64, generator=g).bfloat16().to(device), slots)
    assert torch.equal(cache, before), "the refused call wrote into the cache"
    cache8 = _fp8_cache(2, 4, device)
    with pytest.raises(RuntimeError, match="kv_cache_write_fp8: kv_cache has elements that share memory"):
        ops.kv_cache_write_fp8(cache8[:, :1].expand(2, 4, 584), _fp8_rows(2, g, device), slots)
    with pytest.raises(RuntimeError, match="kv_cache_dequant_fp8: out has elements that share memory"):
        ops.kv_cache_dequant_fp8(torch.empty(1, 512, dtype=torch.bfloat16, device=device).expand(2, 512), cache8,
                                 slots)


def _fp32_cache(num_blocks, block_size, dim, g, block_pad=0):
    base = torch.randn(num_blocks, block_size * dim + block_pad, generator=g)
    return base[:, : block_size * dim].view(num_blocks, block_size, dim)


@pytest.mark.parametrize("b,s_q,h,dim,topk,window,block_size", [(1, 1, 4, 64, 40, 128, 128), (3, 2, 8, 128, 17, 9, 7),
                                                                 (2, 4, 16, 512, 64, 16, 1)])
def test_decode_and_prefill_fp32_cpu_match_ref(b, s_q, h, dim, topk, window, block_size):
    """float32 q / out / caches (CPU only: the model's fp32 CPU path) against the fp32 reference at fp32 tolerance."""
    g = _gen(b * 100 + dim)
    q = torch.randn(b, s_q, h, dim, generator=g)
    comp = _fp32_cache(max(1, (b * topk) // block_size + 3), block_size, dim, g, block_pad=8)
    win = _fp32_cache(max(1, (b * window) // block_size + 2), block_size, dim, g)
    idx = _indices((b, s_q, topk), comp.shape[0] * block_size, g, "cpu")
    widx = _indices((b, s_q, window), win.shape[0] * block_size, g, "cpu")
    kw = dict(topk_length=torch.randint(0, topk + 3, (b,), generator=g, dtype=torch.int32), extra_kv_cache=win,
              extra_indices=widx, attn_sink=torch.randn(h, generator=g))
    out, lse = _run_decode(q, comp, idx, dim ** -0.5, **kw)
    ref_out, ref_lse = refs.sparse_mqa_decode_ref(q, comp, idx, dim ** -0.5, **kw)
    assert out.dtype == torch.float32
    assert_close(out, ref_out, FP32, "fp32 out")
    assert_close(lse, ref_lse, FP32, "fp32 lse")
    # prefill: the rows of the decode call packed as tokens (topk_length per token)
    t = b * s_q
    pkw = dict(kw, topk_length=kw["topk_length"].repeat_interleave(s_q), extra_indices=widx.view(t, window))
    out_p, lse_p = deepinfer_ops.sparse_mqa_prefill(q.view(t, h, dim), comp, idx.view(t, topk), dim ** -0.5, **pkw)
    assert torch.equal(out_p, out.view(t, h, dim)) and torch.equal(lse_p, lse.view(t, h))


@pytest.mark.native_errors
def test_fp32_dtype_rules(device):
    """float32 needs float32 everywhere and only on the CPU; bf16 q never reads a float32 cache."""
    g = _gen(5)
    idx = torch.zeros(1, 1, 3, dtype=torch.int32, device=device)
    q32 = torch.randn(1, 1, 8, 64, generator=g).to(device)
    c32 = _fp32_cache(2, 4, 64, g).to(device)
    if device == "cuda":
        with pytest.raises(RuntimeError, match="q must be torch.bfloat16"):
            deepinfer_ops.sparse_mqa_decode(q32, c32, idx, 0.1)
        return
    with pytest.raises(RuntimeError, match="kv_cache must be torch.float32 with a float32 q"):
        deepinfer_ops.sparse_mqa_decode(q32, _cache(2, 4, 64, g, device), idx, 0.1)
    with pytest.raises(RuntimeError, match="extra_kv_cache must be torch.float32 with a float32 q"):
        deepinfer_ops.sparse_mqa_decode(q32, c32, idx, 0.1, extra_kv_cache=c32.bfloat16(), extra_indices=idx)
    with pytest.raises(RuntimeError, match="kv_cache must be torch.bfloat16 or torch.uint8"):
        deepinfer_ops.sparse_mqa_decode(q32.bfloat16(), c32, idx, 0.1)
    with pytest.raises(RuntimeError, match="q must be torch.bfloat16 or torch.float32"):
        deepinfer_ops.sparse_mqa_decode(q32.half(), c32, idx, 0.1)
    out, lse = torch.empty_like(q32).bfloat16(), torch.empty(1, 1, 8)
    with pytest.raises(RuntimeError, match="out must be torch.float32"):
        torch.ops.deepinfer_ops.sparse_mqa_decode(out, lse, q32, c32, idx, None, None, None, None, None, 0.1)


# ---- sparse_mqa_prefill -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("t,h,dim,topk,window", [(1, 8, 64, 10, 4), (37, 16, 128, 50, 12), (9, 64, 512, 64, 16)])
def test_prefill_matches_ref(device, t, h, dim, topk, window):
    g = _gen(t + h)
    q = torch.randn(t, h, dim, generator=g).bfloat16().to(device)
    comp = _cache(8, 16, dim, g, device)
    win = _cache(4, 16, dim, g, device, block_pad=16)
    kw = dict(topk_length=torch.randint(0, topk + 1, (t,), generator=g, dtype=torch.int32).to(device),
              extra_kv_cache=win, extra_indices=_indices((t, window), 64, g, device),
              attn_sink=torch.randn(h, generator=g).to(device))
    idx = _indices((t, topk), 128, g, device)
    out, lse = deepinfer_ops.sparse_mqa_prefill(q, comp, idx, dim ** -0.5, **kw)
    _check(out, lse, *refs.sparse_mqa_prefill_ref(q, comp, idx, dim ** -0.5, **kw))
    # A prefill token equals the same query as a decode row.
    out_d, lse_d = deepinfer_ops.sparse_mqa_decode(q.unsqueeze(1), comp, idx.unsqueeze(1), dim ** -0.5,
                                                   **{**kw, "extra_indices": kw["extra_indices"].unsqueeze(1)})
    assert torch.equal(out_d.squeeze(1).cpu(), out.cpu()) and torch.equal(lse_d.squeeze(1).cpu(), lse.cpu())


# ---- mqa_logits -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("t,H,dim,block_size,num_blocks", [(1, 1, 64, 16, 3), (5, 8, 128, 64, 7), (3, 64, 128, 7, 9),
                                                           (4, 16, 48, 32, 5)])
@pytest.mark.parametrize("paged", [False, True])
def test_mqa_logits_matches_ref(device, t, H, dim, block_size, num_blocks, paged):
    g = _gen(t * H + dim)
    q = (torch.randn(t, H, dim, generator=g) * 0.3).bfloat16().to(device)
    w = torch.randn(t, H, generator=g).to(device)
    k = (_cache(num_blocks, block_size, dim, g, device).float() * 0.3).bfloat16()
    kw = {}
    n = num_blocks * block_size
    if paged:
        table = torch.randint(-1, num_blocks + 1, (t, num_blocks + 1), generator=g, dtype=torch.int32).to(device)
        kw["block_table"] = table
        n = (num_blocks + 2) * block_size - 3  # partly past the table's end
    kw["k_start"] = torch.randint(0, 3, (t,), generator=g, dtype=torch.int32).to(device)
    kw["k_end"] = torch.randint(n // 2, n + 2, (t,), generator=g, dtype=torch.int32).to(device)
    logits = poison_(torch.empty(t, n, device=device))
    torch.ops.deepinfer_ops.mqa_logits(logits, q, w, k, kw.get("block_table"), kw["k_start"], kw["k_end"])
    assert_close(logits, refs.mqa_logits_ref(q, w, k, n, **kw), FP32, "logits")
    assert_close(deepinfer_ops.mqa_logits(q, w, k, n, **kw), logits, FP32, "logits (wrapper)")


@pytest.mark.parametrize("dim", [48, 128])
def test_mqa_logits_fp32_cpu_matches_ref(dim):
    """float32 q / keys (CPU only: the model's fp32 CPU path), paged, with a future mask, at fp32 tolerance."""
    g = _gen(dim + 1)
    t, H, block_size, num_blocks = 6, 16, 32, 5
    q = torch.randn(t, H, dim, generator=g)
    w = torch.randn(t, H, generator=g)
    k = _fp32_cache(num_blocks, block_size, dim, g, block_pad=8)
    table = torch.randint(-1, num_blocks, (t, 3), generator=g, dtype=torch.int32)
    n = 3 * block_size + 5
    k_end = torch.randint(0, n + 1, (t,), generator=g, dtype=torch.int32)
    logits = poison_(torch.empty(t, n))
    torch.ops.deepinfer_ops.mqa_logits(logits, q, w, k, table, None, k_end)
    assert_close(logits, refs.mqa_logits_ref(q, w, k, n, block_table=table, k_end=k_end), FP32, "fp32 logits")


@pytest.mark.native_errors
def test_mqa_logits_fp32_dtype_rules(device):
    g = _gen(7)
    q32, w = torch.randn(2, 4, 64, generator=g).to(device), torch.randn(2, 4, generator=g).to(device)
    k32 = _fp32_cache(2, 8, 64, g).to(device)
    if device == "cuda":
        with pytest.raises(RuntimeError, match="q must be torch.bfloat16"):
            deepinfer_ops.mqa_logits(q32, w, k32)
        return
    with pytest.raises(RuntimeError, match="k_cache must be torch.float32 with a float32 q"):
        deepinfer_ops.mqa_logits(q32, w, k32.bfloat16())
    with pytest.raises(RuntimeError, match="k_cache must be torch.bfloat16"):
        deepinfer_ops.mqa_logits(q32.bfloat16(), w, k32)
    with pytest.raises(RuntimeError, match="head_dim must be 48, 64 or 128"):
        deepinfer_ops.mqa_logits(q32[..., :32].contiguous(), w, k32[..., :32])


@pytest.mark.cuda
@pytest.mark.parametrize("t,H,dim,n", [(1, 64, 128, 5000), (4, 64, 128, 4097), (3, 13, 64, 777), (2, 128, 128, 300),
                                       (3, 10, 48, 1000)])
def test_cuda_mqa_logits_tensor_core_kernel_matches_ref(t, H, dim, n):
    # The tensor-core kernel against the fp32 reference, paged, with invalid blocks and per-token ranges; V4 indexer
    # shapes (H = 64, d = 128), head counts not a multiple of 8 and the tiny preset's head_dim 48 included.
    g = _gen(t * 1000 + H)
    block_size = 64
    num_blocks = (n + block_size - 1) // block_size
    q = (torch.randn(t, H, dim, generator=g) * 0.3).bfloat16().to("cuda")
    w = torch.randn(t, H, generator=g).to("cuda")
    k = (_cache(num_blocks + 2, block_size, dim, g, "cuda").float() * 0.3).bfloat16()
    table = torch.randint(-1, num_blocks + 3, (t, num_blocks), generator=g, dtype=torch.int32).to("cuda")
    kw = dict(block_table=table, k_start=torch.randint(0, 70, (t,), generator=g, dtype=torch.int32).to("cuda"),
              k_end=torch.randint(n // 2, n + 2, (t,), generator=g, dtype=torch.int32).to("cuda"))
    new = deepinfer_ops.mqa_logits(q, w, k, n, **kw)
    ref = refs.mqa_logits_ref(q, w, k, n, **kw)
    assert_close(new, ref, FP32, "logits (tensor cores)")
    assert torch.equal(torch.isinf(new).cpu(), torch.isinf(ref).cpu())


# ---- kv_cache_write ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dim,dtype", [(512, torch.bfloat16), (128, torch.bfloat16), (584, torch.uint8)])
def test_kv_cache_write_matches_ref(device, dim, dtype):
    g = _gen(dim)
    num_blocks, block_size, t = 5, 16, 23
    base = torch.randint(0, 100, (num_blocks, block_size * dim + 32), generator=g).to(dtype).to(device)
    cache = base[:, : block_size * dim].view(num_blocks, block_size, dim)  # padded block stride
    kv = torch.randint(0, 100, (t, dim), generator=g).to(dtype).to(device)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:t]
    slots[3], slots[7], slots[11] = -1, num_blocks * block_size, 10**12  # skipped
    slots = slots.to(device)
    expected = refs.kv_cache_write_ref(cache, kv, slots)
    padding = base[:, block_size * dim:].clone()
    deepinfer_ops.kv_cache_write(cache, kv, slots)
    assert torch.equal(cache.cpu(), expected.cpu())
    assert torch.equal(base[:, block_size * dim:].cpu(), padding.cpu()), "wrote into the block padding"


def test_opcheck_cpu():
    g = _gen(11)
    q = torch.randn(1, 2, 4, 64, generator=g).bfloat16()
    cache = _cache(2, 4, 64, g, "cpu")
    idx = torch.randint(-1, 8, (1, 2, 5), generator=g, dtype=torch.int32)
    out, lse = torch.empty_like(q), torch.empty(1, 2, 4)
    torch.library.opcheck(torch.ops.deepinfer_ops.sparse_mqa_decode,
                          (out, lse, q, cache, idx, None, None, None, None, None, 0.125),
                          test_utils=("test_schema", "test_faketensor"))
    s = torch.randn(3, 40, generator=g)
    torch.library.opcheck(torch.ops.deepinfer_ops.topk_rows,
                          (torch.empty(3, 7), torch.empty(3, 7, dtype=torch.int64), s),
                          test_utils=("test_schema", "test_faketensor"))


# ---- batch invariance -------------------------------------------------------------------------------------------


def test_decode_batch_invariant(device):
    q, comp, idx, kw = _decode_case(device, 7, 2, 16, 128, 90, 20, 16, 21)
    out, lse = _run_decode(q, comp, idx, 0.1, **kw)
    for r in (0, 3, 6):
        sub = {k: (v[r:r + 1] if k in ("topk_length", "extra_topk_length", "extra_indices") else v)
               for k, v in kw.items()}
        o1, l1 = _run_decode(q[r:r + 1].contiguous(), comp, idx[r:r + 1].contiguous(), 0.1, **sub)
        assert torch.equal(o1.cpu(), out[r:r + 1].cpu()) and torch.equal(l1.cpu(), lse[r:r + 1].cpu())
    out2, lse2 = _run_decode(q, comp, idx, 0.1, **kw)
    assert torch.equal(out2.cpu(), out.cpu()) and torch.equal(lse2.cpu(), lse.cpu())


# ---- CUDA only: V4-Flash shapes, sweeps, large caches -----------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("s_q", [1, 2, 3, 4])
def test_cuda_decode_v4_flash_shapes(s_q):
    q, comp, idx, kw = _decode_case("cuda", 4, s_q, V4_HEADS, V4_DIM, V4_TOPK, V4_WINDOW, 64, 40 + s_q)
    out, lse = _run_decode(q, comp, idx, V4_SCALE, **kw)
    ref = refs.sparse_mqa_decode_ref(q, comp, idx, V4_SCALE, **kw)
    _check(out, lse, *ref)
    # The CPU implementation agrees too.
    cpu_kw = {k: v.cpu() for k, v in kw.items()}
    out_c, lse_c = _run_decode(q.cpu(), comp.cpu(), idx.cpu(), V4_SCALE, **cpu_kw)
    _check(out, lse, out_c, lse_c)


@pytest.mark.cuda
@pytest.mark.parametrize("h", [1, 8, 16, 64, 128])
@pytest.mark.parametrize("s_q", [1, 4])
def test_cuda_decode_head_sweep(h, s_q):
    q, comp, idx, kw = _decode_case("cuda", 3, s_q, h, V4_DIM, 200, 64, 64, h * 10 + s_q)
    out, lse = _run_decode(q, comp, idx, V4_SCALE, **kw)
    _check(out, lse, *refs.sparse_mqa_decode_ref(q, comp, idx, V4_SCALE, **kw))


@pytest.mark.cuda
@pytest.mark.parametrize("topk", [512, 1024])
def test_cuda_prefill_v4_flash_shapes(topk):
    g = _gen(topk)
    t = 300
    q = torch.randn(t, V4_HEADS, V4_DIM, generator=g).bfloat16().cuda()
    comp = _cache(64, 64, V4_DIM, g, "cuda")
    win = _cache(16, 64, V4_DIM, g, "cuda")
    kw = dict(topk_length=torch.randint(0, topk + 1, (t,), generator=g, dtype=torch.int32).cuda(),
              extra_kv_cache=win, extra_indices=_indices((t, V4_WINDOW), 1024, g, "cuda"),
              attn_sink=torch.randn(V4_HEADS, generator=g).cuda())
    idx = _indices((t, topk), 4096, g, "cuda")
    out, lse = deepinfer_ops.sparse_mqa_prefill(q, comp, idx, V4_SCALE, **kw)
    _check(out, lse, *refs.sparse_mqa_prefill_ref(q, comp, idx, V4_SCALE, **kw))


@pytest.mark.cuda
def test_cuda_decode_64bit_offsets():
    # 2.1M slots x 1 KiB = 2.15 GB: byte offsets of the last pages exceed 2^31.
    block_size, num_blocks = 64, (2**31 // 1024) // 64 + 64
    cache = torch.empty(num_blocks, block_size, V4_DIM, dtype=torch.bfloat16, device="cuda")
    g = _gen(64)
    num_slots = num_blocks * block_size
    idx = torch.cat([torch.randint(num_slots - 4096, num_slots, (2, 1, 96), generator=g),
                     torch.randint(0, 4096, (2, 1, 32), generator=g)], dim=-1).to(torch.int32).cuda()
    used = idx.long().flatten().unique()
    cache.view(-1, V4_DIM)[used] = torch.randn(used.numel(), V4_DIM, generator=g).bfloat16().cuda()
    q = torch.randn(2, 1, V4_HEADS, V4_DIM, generator=g).bfloat16().cuda()
    out, lse = _run_decode(q, cache, idx, V4_SCALE)
    _check(out, lse, *refs.sparse_mqa_decode_ref(q, cache, idx, V4_SCALE))
    del cache


@pytest.mark.cuda
@pytest.mark.parametrize("n", [32768 + 5, 131072, 262144])
def test_cuda_indexer_logits_and_topk(n):
    g = _gen(n)
    t, H, dim, block_size = 3, 64, 128, 64
    q = (torch.randn(t, H, dim, generator=g) * 0.3).bfloat16().cuda()
    w = (torch.randn(t, H, generator=g) * H ** -0.5).cuda()
    k = (torch.randn(-(-n // block_size), block_size, dim, generator=g) * 0.3).bfloat16().cuda()
    k_end = torch.tensor([n, n // 2, 17], dtype=torch.int32).cuda()
    logits = deepinfer_ops.mqa_logits(q, w, k, n, k_end=k_end)
    assert_close(logits, refs.mqa_logits_ref(q, w, k, n, k_end=k_end), FP32, "logits")
    relu_ties = logits.clamp_min(0)  # many exact zeros: the tie rule decides
    for kk in (512, 2048):
        v, i = deepinfer_ops.topk(relu_ties, kk)
        rv, ri = refs.topk_ref(relu_ties, kk)
        assert torch.equal(i, ri) and torch.equal(v, rv)


@pytest.mark.cuda
def test_cuda_decode_matches_cpu_bitwise_rerun():
    q, comp, idx, kw = _decode_case("cuda", 16, 2, V4_HEADS, V4_DIM, V4_TOPK, V4_WINDOW, 64, 99)
    runs = [_run_decode(q, comp, idx, V4_SCALE, **kw) for _ in range(3)]
    for o, l in runs[1:]:
        assert torch.equal(o, runs[0][0]) and torch.equal(l, runs[0][1])


# ---- FP8 (MODEL1) cache -----------------------------------------------------------------------------------------


def _fp8_rows(t, g, device):
    kv = torch.randn(t, V4_DIM, generator=g) * torch.logspace(-3, 3, t).unsqueeze(1)
    kv[0, :64] = 0.0  # an all-zero tile: finite scale, zero codes
    kv[1, 64:128] = 1e-20  # tiny values
    return kv.bfloat16().to(device)


def _fp8_cache(num_blocks, block_size, device, pad=8):
    base = torch.full((num_blocks, block_size * 584 + pad), 0x7F, dtype=torch.uint8, device=device)
    return base[:, : block_size * 584].view(num_blocks, block_size, 584)


def test_fp8_cache_write_nonfinite_tiles_bit_exact(device):
    """A 64-dim tile holding NaN gets the scale byte 0xFF and every code 0x7F; one holding +-inf the byte 0xFF and
    codes x / inf (+-0, 0x7F at the inf), as FlashMLA's quantiser. Either decodes to NaN over the tile; the reference's
    bytes exactly; the entry's other tiles and its RoPE dims are unaffected."""
    g = _gen(585)
    kv = torch.randn(3, V4_DIM, generator=g)
    kv[0, 5], kv[1, 70], kv[2, 447] = float("inf"), float("-inf"), float("nan")
    kv = kv.bfloat16().to(device)
    cache = _fp8_cache(1, 4, device)
    slots = torch.tensor([0, 1, 2], device=device)
    expected = refs.kv_cache_write_fp8_ref(cache, kv, slots)
    deepinfer_ops.kv_cache_write_fp8(cache, kv, slots)
    assert torch.equal(cache.cpu(), expected.cpu()), "FP8 entries differ from the reference"
    deq = deepinfer_ops.kv_cache_dequant_fp8(cache, slots).float().cpu()
    entries = refs.fp8_cache_entries(cache.cpu())
    for row, tile, at in ((0, 0, 5), (1, 1, 70), (2, 6, 447)):
        entry = entries[0, row]
        codes = entry[tile * 64:(tile + 1) * 64]
        assert entry[576 + tile] == 0xFF and codes[at - tile * 64] == 0x7F
        assert torch.all(codes == 0x7F) if row == 2 else torch.all((codes == 0) | (codes == 0x80) | (codes == 0x7F))
        bad = torch.zeros(V4_DIM, dtype=torch.bool)
        bad[tile * 64:(tile + 1) * 64] = True
        assert torch.all(torch.isnan(deq[row, bad])) and torch.all(torch.isfinite(deq[row, ~bad]))


def test_fp8_cache_write_and_dequant_bit_exact(device):
    g = _gen(584)
    t, num_blocks, block_size = 37, 6, 8
    kv = _fp8_rows(t, g, device)
    cache = _fp8_cache(num_blocks, block_size, device)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:t]
    slots[5], slots[9] = -1, num_blocks * block_size + 3
    slots = slots.to(device)
    expected = refs.kv_cache_write_fp8_ref(cache, kv, slots)
    deepinfer_ops.kv_cache_write_fp8(cache, kv, slots)
    assert torch.equal(cache.cpu(), expected.cpu()), "FP8 entries differ from the reference"
    deq = deepinfer_ops.kv_cache_dequant_fp8(cache, slots)
    ref_deq = refs.kv_cache_dequant_fp8_ref(cache, slots)
    assert torch.equal(deq.cpu(), ref_deq.cpu())
    ok = torch.ones(t, dtype=torch.bool)
    ok[5] = ok[9] = False
    assert torch.all(deq[~ok.to(device)].float() == 0)
    # The RoPE dims are stored exactly; the no-RoPE dims within e4m3 precision of their tile scale.
    assert torch.equal(deq[ok.to(device), 448:].cpu(), kv[ok.to(device), 448:].cpu())
    err = (deq[ok.to(device), :448].float() - kv[ok.to(device), :448].float()).abs()
    amax = kv[ok.to(device), :448].float().abs().view(-1, 7, 64).amax(-1, keepdim=True).expand(-1, 7, 64)
    assert torch.all(err.view(-1, 7, 64) <= amax.clamp_min(1e-10) * 2 ** -3)  # half an e4m3 ulp at most


# ---- FP8 indexer keys -------------------------------------------------------------------------------------------


def _idx_fp8_cache(num_blocks, block_size, d, device, pad=12):
    """A uint8 FP8 indexer-key cache [num_blocks, block_size, d + 4] filled with 0x7F (e4m3 NaN), blocks padded so the
    block stride is a multiple of 16 bytes (CUDA's rule)."""
    width = block_size * (d + 4)
    stride = -(-(width + pad) // 16) * 16
    base = torch.full((num_blocks, stride), 0x7F, dtype=torch.uint8, device=device)
    return base[:, :width].view(num_blocks, block_size, d + 4)


def _idx_keys(t, d, g, device):
    k = torch.randn(t, d, generator=g) * torch.logspace(-6, 4, t).unsqueeze(1)
    k[0] = 0.0  # all-zero key: finite scale, zero codes
    k[1, :] = 1e-30  # below the amax floor
    k[2, 3] = float("nan")  # NaN scale, NaN codes
    k[3, 5] = float("inf")  # inf: NaN scale too
    k[4, 7] = -3e38
    return k.bfloat16().to(device)


@pytest.mark.parametrize("d,block_size", [(128, 64), (64, 7), (48, 1)])
def test_indexer_k_cache_fp8_write_and_dequant_bit_exact(device, d, block_size):
    g = _gen(d + block_size)
    t, num_blocks = 29, 40 // block_size + 2
    k = _idx_keys(t, d, g, device)
    cache = _idx_fp8_cache(num_blocks, block_size, d, device)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:t]
    slots[5], slots[9] = -1, num_blocks * block_size + 3
    slots = slots.to(device)
    expected = refs.indexer_k_cache_write_fp8_ref(cache, k, slots)
    padding = cache.as_strided((num_blocks, 12), (cache.stride(0), 1), block_size * (d + 4)).clone()
    deepinfer_ops.indexer_k_cache_write_fp8(cache, k, slots)
    assert torch.equal(cache.cpu(), expected.cpu()), "FP8 indexer keys differ from the reference"
    assert torch.equal(cache.as_strided((num_blocks, 12), (cache.stride(0), 1), block_size * (d + 4)).cpu(),
                       padding.cpu()), "wrote into the block padding"
    deq = deepinfer_ops.indexer_k_cache_dequant_fp8(cache, slots)
    torch.testing.assert_close(deq.cpu(), refs.indexer_k_cache_dequant_fp8_ref(cache, slots).cpu(), rtol=0, atol=0,
                               equal_nan=True)
    ok = torch.ones(t, dtype=torch.bool)
    ok[5] = ok[9] = False
    okd = ok.to(device)
    assert torch.all(deq[~okd].float() == 0)
    assert torch.isnan(deq[2]).all() and torch.isnan(deq[3]).all(), "a NaN / inf key decodes to NaN"
    assert torch.all(deq[0].float() == 0)
    fine = okd.clone()
    fine[2] = fine[3] = False
    err = (deq[fine].float() - k[fine].float()).abs()
    amax = k[fine].float().abs().amax(-1, keepdim=True)
    assert torch.all(err <= amax.clamp_min(1e-10) * 2 ** -3)  # half an e4m3 ulp at most


@pytest.mark.parametrize("t,H,d,block_size,num_blocks", [(5, 8, 128, 64, 7), (3, 64, 128, 16, 9), (4, 13, 64, 7, 5),
                                                         (2, 16, 48, 32, 4)])
def test_mqa_logits_fp8_keys_equal_decoded_keys(device, t, H, d, block_size, num_blocks):
    """Logits over an FP8 key cache equal, bit for bit, the logits over its decoded bf16 cache (same kernel sums over
    exact bf16 keys), and match the fp32 reference; paged, with invalid blocks and per-token ranges."""
    g = _gen(t * H + d)
    q = (torch.randn(t, H, d, generator=g) * 0.3).bfloat16().to(device)
    w = torch.randn(t, H, generator=g).to(device)
    cache = _idx_fp8_cache(num_blocks, block_size, d, device)
    keys = (torch.randn(num_blocks * block_size, d, generator=g) * 0.3).bfloat16().to(device)
    deepinfer_ops.indexer_k_cache_write_fp8(cache, keys, torch.arange(num_blocks * block_size, device=device))
    decoded = refs.indexer_k_cache_decode_ref(cache)
    table = torch.randint(-1, num_blocks + 1, (t, num_blocks + 1), generator=g, dtype=torch.int32).to(device)
    n = (num_blocks + 2) * block_size - 3
    kw = dict(block_table=table, k_start=torch.randint(0, 3, (t,), generator=g, dtype=torch.int32).to(device),
              k_end=torch.randint(n // 2, n + 2, (t,), generator=g, dtype=torch.int32).to(device))
    got = deepinfer_ops.mqa_logits(q, w, cache, n, **kw)
    want = deepinfer_ops.mqa_logits(q, w, decoded, n, **kw)
    assert torch.equal(got.cpu(), want.cpu()), "FP8-key logits differ from the decoded bf16 cache's"
    assert_close(got, refs.mqa_logits_ref(q, w, cache, n, **kw), FP32, "FP8-key logits")
    assert torch.equal(torch.isinf(got).cpu(), torch.isinf(refs.mqa_logits_ref(q, w, decoded, n, **kw)).cpu())


@pytest.mark.native_errors
def test_indexer_fp8_cache_errors_name_the_tensor(device):
    g = _gen(3)
    q, w = torch.randn(2, 4, 64, generator=g).bfloat16().to(device), torch.randn(2, 4, generator=g).to(device)
    cache = _idx_fp8_cache(3, 16, 64, device)
    k = torch.randn(4, 64, generator=g).bfloat16().to(device)
    slots = torch.arange(4, device=device)
    with pytest.raises(RuntimeError, match=r"k_cache must be uint8 \[num_blocks, block_size > 0, 68\]"):
        deepinfer_ops.mqa_logits(q, w, _idx_fp8_cache(3, 16, 128, device))
    with pytest.raises(RuntimeError, match="k_cache must hold each block densely"):
        deepinfer_ops.mqa_logits(q, w, torch.zeros(3, 16, 80, dtype=torch.uint8, device=device)[..., :68])
    with pytest.raises(RuntimeError, match="k_cache must be torch.float32 with a float32 q"):
        deepinfer_ops.mqa_logits(q.float(), w, cache) if device == "cpu" else deepinfer_ops.mqa_logits(
            q.float(), w, cache.float())
    with pytest.raises(RuntimeError, match="indexer_k_cache_write_fp8: k must be torch.bfloat16"):
        deepinfer_ops.indexer_k_cache_write_fp8(cache, k.float(), slots)
    with pytest.raises(RuntimeError, match="indexer_k_cache_write_fp8: k must be \\[num_tokens, head_dim\\]"):
        deepinfer_ops.indexer_k_cache_write_fp8(cache, k[:, :32], slots)
    with pytest.raises(RuntimeError, match="indexer_k_cache_write_fp8: k_cache must be torch.uint8"):
        deepinfer_ops.indexer_k_cache_write_fp8(cache.view(torch.int8), k, slots)
    with pytest.raises(RuntimeError, match="slot_mapping must be a contiguous \\[4\\]"):
        deepinfer_ops.indexer_k_cache_write_fp8(cache, k, slots[:3])
    with pytest.raises(RuntimeError, match="indexer_k_cache_dequant_fp8: k_cache must be uint8 .* 132"):
        torch.ops.deepinfer_ops.indexer_k_cache_dequant_fp8(torch.empty(4, 128, dtype=torch.bfloat16, device=device),
                                                             cache, slots)
    if device == "cuda":
        odd = torch.zeros(3 * 16 * 68 + 1, dtype=torch.uint8, device=device)[1:].view(3, 16, 68)
        with pytest.raises(RuntimeError, match="k_cache \\(FP8 keys\\) must be 16-byte aligned"):
            deepinfer_ops.mqa_logits(q, w, odd)


@pytest.mark.parametrize("fp8", [False, True])
def test_mqa_logits_empty_block_table_gives_all_invalid(device, fp8):
    """A block table with no columns addresses no block: every candidate is invalid (-inf), not the flat cache."""
    g = _gen(17)
    q, w = (torch.randn(3, 2, 64, generator=g) * 0.3).bfloat16().to(device), torch.randn(3, 2, generator=g).to(device)
    cache = _idx_fp8_cache(2, 4, 64, device) if fp8 else _cache(2, 4, 64, g, device)
    if fp8:
        deepinfer_ops.indexer_k_cache_write_fp8(cache, (torch.randn(8, 64, generator=g)).bfloat16().to(device),
                                                torch.arange(8, device=device))
    table = torch.zeros(3, 0, dtype=torch.int32, device=device)
    got = deepinfer_ops.mqa_logits(q, w, cache, 5, block_table=table)
    assert torch.equal(got.cpu(), refs.mqa_logits_ref(q, w, cache, 5, block_table=table).cpu())
    assert torch.all(got == float("-inf"))


@pytest.mark.native_errors
def test_cache_ops_refuse_aliasing_layouts(device):
    """Reads that share bytes with the written tensor are refused for any layout (strided, padded), not only for the
    dense overlaps ATen can decide."""
    base = torch.zeros(2 * 4 * 68 + 64, dtype=torch.uint8, device=device)
    cache = base[:2 * 4 * 68].view(2, 4, 68)
    k_in_cache = base[:512].view(torch.bfloat16).view(2, 128)[:, :64]  # strided rows inside the cache
    with pytest.raises(RuntimeError, match="k_cache and k share memory"):
        deepinfer_ops.indexer_k_cache_write_fp8(cache, k_in_cache, torch.tensor([0, 1], device=device))
    slots_in_cache = base[8:24].view(torch.int64)  # slot_mapping aliasing the cache
    with pytest.raises(RuntimeError, match="k_cache and slot_mapping share memory"):
        deepinfer_ops.indexer_k_cache_write_fp8(cache, torch.zeros(2, 64, dtype=torch.bfloat16, device=device),
                                                slots_in_cache)
    q, w = torch.zeros(1, 2, 64, dtype=torch.bfloat16, device=device), torch.zeros(1, 2, device=device)
    logits_in_cache = base[:64].view(torch.float32).view(1, 16)
    with pytest.raises(RuntimeError, match="logits and k_cache share memory"):
        torch.ops.deepinfer_ops.mqa_logits(logits_in_cache, q, w, cache, None, None, None)
    kv = torch.zeros(3, 8, 16, device=device)
    with pytest.raises(RuntimeError, match="kv_cache and kv share memory"):  # every other row of block 1
        deepinfer_ops.kv_cache_write(kv, kv[1, ::2], torch.tensor([1, 2, 3, 4], device=device))


@pytest.mark.native_errors
def test_sparse_mqa_and_topk_refuse_aliased_outputs(device):
    """sparse MQA's out / lse and topk_rows' values / indices share no byte with each other or with what the op
    reads (here: out over the cache, lse over the indices, values inside the scores)."""
    q = torch.zeros(2, 4, 64, dtype=torch.bfloat16, device=device)
    buf = torch.zeros(2, 4, 64, dtype=torch.bfloat16, device=device)
    idx = torch.zeros(2, 4, dtype=torch.int32, device=device)
    lse = torch.empty(2, 4, device=device)
    op = torch.ops.deepinfer_ops.sparse_mqa_prefill
    with pytest.raises(RuntimeError, match="out and kv_cache share memory"):
        op(buf, lse, q, buf, idx, None, None, None, None, None, 0.125)
    with pytest.raises(RuntimeError, match="lse and indices share memory"):
        op(torch.empty_like(q), idx.view(torch.float32), q, buf, idx, None, None, None, None, None, 0.125)
    scores = torch.tensor([[3.0, 1.0, 5.0, 0.0]], device=device)
    with pytest.raises(RuntimeError, match="values and scores share memory"):
        torch.ops.deepinfer_ops.topk_rows(scores[:, :2], torch.empty(1, 2, dtype=torch.long, device=device), scores)


def test_indexer_fp8_fakes_check_the_layout():
    """The meta kernels refuse the cache layouts and shapes the native ops refuse."""
    bad = torch.zeros(2, 4, 80, dtype=torch.uint8, device="meta")[..., :68]  # last dim sliced: blocks not dense
    k = torch.zeros(3, 64, dtype=torch.bfloat16, device="meta")
    with pytest.raises(RuntimeError, match="hold each block densely"):
        torch.ops.deepinfer_ops.indexer_k_cache_write_fp8(bad, k, torch.zeros(3, dtype=torch.int64, device="meta"))
    q, w = torch.zeros(3, 7, 64, dtype=torch.bfloat16, device="meta"), torch.zeros(3, 7, device="meta")
    with pytest.raises(RuntimeError, match="k_cache must be"):
        torch.ops.deepinfer_ops.mqa_logits(torch.empty(3, 8, device="meta"), q, w,
                                           torch.zeros(2, 4, 99, dtype=torch.uint8, device="meta"), None, None, None)
    with pytest.raises(RuntimeError, match="weights must be float32"):
        torch.ops.deepinfer_ops.mqa_logits(torch.empty(3, 8, device="meta"), q, w.bfloat16(),
                                           torch.zeros(2, 4, 68, dtype=torch.uint8, device="meta"), None, None, None)


def test_wrappers_refuse_bad_ranks_with_value_errors():
    with pytest.raises(ValueError, match="mqa_logits: k_cache must be \\[num_blocks, block_size, width\\]"):
        deepinfer_ops.mqa_logits(torch.zeros(1, 2, 64, dtype=torch.bfloat16), torch.zeros(1, 2),
                                 torch.zeros(64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="block_table \\[num_tokens, max_blocks\\]"):
        deepinfer_ops.mqa_logits(torch.zeros(1, 2, 64, dtype=torch.bfloat16), torch.zeros(1, 2),
                                 torch.zeros(2, 4, 64, dtype=torch.bfloat16),
                                 block_table=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="kv_cache_dequant_fp8: slot_mapping must be a 1-D"):
        deepinfer_ops.kv_cache_dequant_fp8(torch.zeros(1, 4, 584, dtype=torch.uint8), torch.tensor(0))


def test_indexer_fp8_wrapper_and_opcheck():
    with pytest.raises(ValueError, match="indexer_k_cache_dequant_fp8: k_cache must be"):
        deepinfer_ops.indexer_k_cache_dequant_fp8(torch.zeros(2, 4, dtype=torch.uint8),
                                                  torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="head_dim 48, 64 or 128"):
        deepinfer_ops.indexer_k_cache_dequant_fp8(torch.zeros(2, 4, 64, dtype=torch.uint8),
                                                  torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="slot_mapping must be a 1-D"):
        deepinfer_ops.indexer_k_cache_dequant_fp8(torch.zeros(2, 4, 68, dtype=torch.uint8), torch.tensor(3))
    with pytest.raises(ValueError, match="mqa_logits: q must be"):
        deepinfer_ops.mqa_logits(torch.tensor(1.0), torch.ones(1, 1), torch.zeros(1, 4, 64, dtype=torch.bfloat16))
    g = _gen(5)
    cache = _idx_fp8_cache(2, 8, 64, "cpu")
    k = torch.randn(3, 64, generator=g).bfloat16()
    slots = torch.tensor([0, 9, -1])
    for op, args in ((torch.ops.deepinfer_ops.indexer_k_cache_write_fp8, (cache, k, slots)),
                     (torch.ops.deepinfer_ops.indexer_k_cache_dequant_fp8, (torch.empty(3, 64, dtype=torch.bfloat16),
                                                                            cache, slots))):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def _decode_weight_magnitude(q, cache, idx, scale, topk_length=None, extra_kv_cache=None, extra_indices=None,
                             extra_topk_length=None, attn_sink=None):
    """``sum_j p_j |v_j|`` [b, s_q, h, d] fp32 (p_j: the reference's softmax weights, sink in the denominator): the
    scale of the error from bf16-rounded softmax weights (compare.BF16_WEIGHTS_REL)."""
    kv, valid = refs._gather_kv_list_ref(cache, idx, topk_length)
    if extra_kv_cache is not None:
        kv2, valid2 = refs._gather_kv_list_ref(extra_kv_cache, extra_indices, extra_topk_length)
        kv, valid = torch.cat([kv, kv2], dim=2), torch.cat([valid, valid2], dim=2)
    scores = (torch.einsum("bshd,bskd->bshk", q.float(), kv) * scale).masked_fill(~valid.unsqueeze(2), float("-inf"))
    total = torch.logsumexp(scores, dim=-1)
    if attn_sink is not None:
        total = torch.logaddexp(total, attn_sink.float().view(1, 1, -1))
    p = torch.nan_to_num(torch.exp(scores - total.unsqueeze(-1)), nan=0.0)  # rows without valid entries: 0
    return torch.einsum("bshk,bskd->bshd", p, kv.abs())


@pytest.mark.parametrize("seed", [585, 586, 587])
def test_decode_fp8_cache_equals_decoded_bf16_cache(device, seed):
    # Wide-range rows (1e-3 .. 1e3, times 0.05): outputs are sums of large values that cancel, so the reference check
    # allows for the bf16-rounded softmax weights (seen on the H200: one element off by 0.016 at |v| ~ 64, exactly
    # the value a CPU emulation of bf16 weights gives). The FP8 path must equal the bf16 path bit for bit, run after
    # run.
    g = _gen(seed)
    b, s_q, h, topk, block_size = 3, 2, 16, 40, 16
    kv = _fp8_rows(8 * block_size, g, device) * 0.05
    cache8 = _fp8_cache(8, block_size, device)
    deepinfer_ops.kv_cache_write_fp8(cache8, kv, torch.arange(8 * block_size, device=device))
    cache16 = refs.fp8_entry_decode_ref(refs.fp8_cache_entries(cache8)).contiguous()
    q = torch.randn(b, s_q, h, V4_DIM, generator=g).bfloat16().to(device)
    # > 64 entries per row (two lists): several gather tiles, a partial last tile, both pipeline buffers in use.
    idx = _indices((b, s_q, topk * 4), 8 * block_size, g, device)
    win = _cache(4, block_size, V4_DIM, g, device)
    kw = dict(extra_kv_cache=win, extra_indices=_indices((b, s_q, 9), 64, g, device),
              attn_sink=torch.randn(h, generator=g).to(device),
              topk_length=torch.tensor([topk * 4, 0, 13 + seed % 64], dtype=torch.int32, device=device))
    out8, lse8 = _run_decode(q, cache8, idx, V4_SCALE, **kw)
    out16, lse16 = _run_decode(q, cache16, idx, V4_SCALE, **kw)
    assert torch.equal(out8.cpu(), out16.cpu()) and torch.equal(lse8.cpu(), lse16.cpu())
    for _ in range(3):
        again, lse_again = _run_decode(q, cache8, idx, V4_SCALE, **kw)
        assert torch.equal(again.cpu(), out8.cpu()) and torch.equal(lse_again.cpu(), lse8.cpu())
    ref_out, ref_lse = refs.sparse_mqa_decode_ref(q, cache8, idx, V4_SCALE, **kw)
    mag = _decode_weight_magnitude(q, cache8, idx, V4_SCALE, **kw)
    assert_close(out8, ref_out, BF16, "out", extra_atol=BF16_WEIGHTS_REL * mag)
    assert_close(lse8, ref_lse, BF16, "lse")


@pytest.mark.cuda
@pytest.mark.parametrize("fp8", [False, True])
def test_cuda_decode_batch_invariant_across_cta_shapes(fp8):
    # 160 rows (two waves of CTAs on the H200) and one row alone (one CTA): a row's result does not depend on the
    # batch around it. Same bits, bf16 and FP8 caches.
    q, comp, idx, kw = _decode_case("cuda", 160, 1, V4_HEADS, V4_DIM, V4_TOPK, V4_WINDOW, 64, 160)
    if fp8:
        rows = comp.reshape(-1, V4_DIM)
        comp = _fp8_cache(comp.shape[0], 64, "cuda")
        deepinfer_ops.kv_cache_write_fp8(comp, rows, torch.arange(rows.shape[0], device="cuda"))
    out, lse = _run_decode(q, comp, idx, V4_SCALE, **kw)
    for r in (0, 77, 159):
        sub = {k: (v[r:r + 1] if k in ("topk_length", "extra_topk_length", "extra_indices") else v)
               for k, v in kw.items()}
        o1, l1 = _run_decode(q[r:r + 1].contiguous(), comp, idx[r:r + 1].contiguous(), V4_SCALE, **sub)
        assert torch.equal(o1, out[r:r + 1]) and torch.equal(l1, lse[r:r + 1])


@pytest.mark.cuda
@pytest.mark.parametrize("rows,h,dim,fp8", [
    (1, 64, 512, False), (100, 64, 512, False), (200, 64, 512, False),  # one CTA, one wave, two waves
    (100, 64, 512, True), (8, 64, 512, True),  # FP8 entries decoded by the producer warps
    (3, 16, 128, False), (2, 5, 64, False), (1, 20, 256, False),
])
def test_cuda_decode_cta_shapes_match_ref(rows, h, dim, fp8):
    # Grid sizes, head counts below the CTA's 64 rows and every head_dim against the reference; reruns give the
    # same bits.
    q, comp, idx, kw = _decode_case("cuda", rows, 1, h, dim, 150, 40, 16, 900 + rows)
    if fp8:
        g = _gen(901)
        comp = _fp8_cache(comp.shape[0], 16, "cuda")
        deepinfer_ops.kv_cache_write_fp8(comp, _fp8_rows(comp.shape[0] * 16, g, "cuda") * 0.05,
                                         torch.arange(comp.shape[0] * 16, device="cuda"))
    out2, lse2 = _run_decode(q, comp, idx, dim ** -0.5, **kw)
    out1, lse1 = _run_decode(q, comp, idx, dim ** -0.5, **kw)
    assert torch.equal(out1.cpu(), out2.cpu()) and torch.equal(lse1.cpu(), lse2.cpu())
    if fp8:  # FP8 entries decode exactly to bf16: the same bits as the decoded bf16 cache
        comp16 = refs.fp8_entry_decode_ref(refs.fp8_cache_entries(comp)).contiguous()
        out16, lse16 = _run_decode(q, comp16, idx, dim ** -0.5, **kw)
        assert torch.equal(out2.cpu(), out16.cpu()) and torch.equal(lse2.cpu(), lse16.cpu())
        mag = _decode_weight_magnitude(q, comp, idx, dim ** -0.5, **kw)  # wide-range FP8 rows: see the test above
        ref_out, ref_lse = refs.sparse_mqa_decode_ref(q, comp, idx, dim ** -0.5, **kw)
        assert_close(out2, ref_out, BF16, "out", extra_atol=BF16_WEIGHTS_REL * mag)
        assert_close(lse2, ref_lse, BF16, "lse")
    else:
        _check(out2, lse2, *refs.sparse_mqa_decode_ref(q, comp, idx, dim ** -0.5, **kw))


@pytest.mark.native_errors
def test_cache_write_from_its_own_cache_refused(device):
    """Rows taken from the cache being written would be read after they are overwritten: refused by name."""
    kv = torch.randn(3, 8, 16, device=device)
    with pytest.raises(RuntimeError, match="kv_cache and kv share memory"):
        deepinfer_ops.kv_cache_write(kv, kv[0, :4], torch.tensor([1, 2, 3, 4], device=device))


def test_wrapper_argument_errors():
    """Python-side argument errors name the op and the argument (before any kernel)."""
    with pytest.raises(TypeError, match="topk: k must be an int"):
        deepinfer_ops.topk(torch.randn(3, 10), 2.5)
    with pytest.raises(ValueError, match="topk: scores must have at least 1 dim"):
        deepinfer_ops.topk(torch.tensor(1.0), 1)
    q = torch.randn(2, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="num_candidates must be an int >= 0"):
        deepinfer_ops.mqa_logits(q, torch.ones(2, 4), torch.randn(1, 16, 64, dtype=torch.bfloat16), num_candidates=-1)
