"""Sparse MQA's lse to fp32 rounding: |lse - ref| <= 1e-6 + 2 ** -15 |ref| against the fp32 reference.

FlashMLA's test grid on CUDA (b 4 / 74 / 321, s_q 1 / 3, h 64 / 128, topk up to 2048, sinks with +-inf, invalid
indices, topk_length); small shapes on the CPU. The "few values" caches hold a handful of distinct rows, so the
scores take a few values and weights rounded to bf16 all err the same way: a denominator summing rounded weights
misses this bound by about 10x there (the rule engines that merge attention states by lse need).
"""

from __future__ import annotations

import pytest
import torch

import deepinfer_ops
from deepinfer_ops.testing import refs
from deepinfer_ops.testing.compare import LSE_TOLERANCE, TOLERANCES, assert_close, poison_

DIM, BLOCK = 512, 64


def assert_lse(lse: torch.Tensor, ref: torch.Tensor) -> None:
    assert_close(lse, ref, LSE_TOLERANCE, "lse")


def _case(device, b, s_q, h, topk, window, seed, few_values=False, sink="random"):
    g = torch.Generator().manual_seed(seed)
    slots = max(4096, 2 * topk)
    if few_values:  # 3 distinct rows: every score is one of 3 values per head
        rows = torch.randn(3, DIM, generator=g)
        cache = rows[torch.randint(0, 3, (slots,), generator=g)]
        q = torch.randn(b, s_q, h, DIM, generator=g) * 0.5
    else:
        cache = torch.randn(slots, DIM, generator=g)
        q = torch.randn(b, s_q, h, DIM, generator=g) * 2.0  # peaked softmax: scores of a few units
    cache = cache.bfloat16().view(slots // BLOCK, BLOCK, DIM).to(device)
    idx = torch.randint(0, slots, (b, s_q, topk), generator=g, dtype=torch.int32)
    bad = torch.rand(idx.shape, generator=g) < 0.1
    junk = torch.where(torch.rand(idx.shape, generator=g) < 0.5, -1, slots + 5).to(torch.int32)
    kw = {"topk_length": torch.randint(0, topk + 1, (b,), generator=g, dtype=torch.int32).to(device)}
    if window:
        kw["extra_kv_cache"] = cache
        kw["extra_indices"] = torch.randint(0, slots, (b, s_q, window), generator=g, dtype=torch.int32).to(device)
    if sink != "none":
        s = torch.randn(h, generator=g)
        if sink == "inf":
            s[0], s[1] = float("inf"), float("-inf")
        kw["attn_sink"] = s.to(device)
    return q.bfloat16().to(device), cache, torch.where(bad, junk, idx).to(device), kw


def _ref(q, cache, idx, scale, kw, chunk=64):
    """The fp32 reference in batch chunks (bounded memory at b = 321, topk 2048)."""
    outs, lses = [], []
    for b0 in range(0, q.shape[0], chunk):
        sl = slice(b0, b0 + chunk)
        sub = {k: (v[sl] if k in ("topk_length", "extra_indices") else v) for k, v in kw.items()}
        o, l = refs.sparse_mqa_decode_ref(q[sl], cache, idx[sl], scale, **sub)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs), torch.cat(lses)


def _decode(q, cache, idx, scale, kw):
    out = poison_(torch.empty_like(q))
    lse = poison_(torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device))
    torch.ops.deepinfer_ops.sparse_mqa_decode(out, lse, q, cache, idx, kw.get("topk_length"), kw.get("extra_kv_cache"),
                                              kw.get("extra_indices"), None, kw.get("attn_sink"), DIM ** -0.5)
    return out, lse


def _check(device, b, s_q, h, topk, window, seed, few_values=False, sink="random"):
    q, cache, idx, kw = _case(device, b, s_q, h, topk, window, seed, few_values, sink)
    out, lse = _decode(q, cache, idx, DIM ** -0.5, kw)
    ref_out, ref_lse = _ref(q, cache, idx, DIM ** -0.5, kw)
    assert_lse(lse, ref_lse)
    assert_close(out, ref_out, TOLERANCES[torch.bfloat16], "out")


@pytest.mark.parametrize("s_q,topk,window,few_values,sink", [
    (1, 64, 0, False, "random"), (3, 200, 16, False, "inf"), (2, 128, 0, True, "none"), (1, 96, 8, True, "inf"),
])
def test_lse_to_fp32_rounding(device, s_q, topk, window, few_values, sink):
    _check(device, 3, s_q, 8, topk, window, seed=topk + s_q, few_values=few_values, sink=sink)


@pytest.mark.cuda
@pytest.mark.parametrize("b", [4, 74, 321])
@pytest.mark.parametrize("s_q", [1, 3])
@pytest.mark.parametrize("h", [64, 128])
@pytest.mark.parametrize("topk", [128, 2048])
def test_cuda_lse_flashmla_grid(b, s_q, h, topk):
    _check("cuda", b, s_q, h, topk, 128 if topk == 128 else 0, seed=b * 7 + s_q * 3 + h + topk,
           sink="inf" if b == 74 else "random")


@pytest.mark.cuda
@pytest.mark.parametrize("h,topk", [(64, 512), (128, 2048)])
def test_cuda_lse_few_values(h, topk):
    _check("cuda", 16, 2, h, topk, 0, seed=h + topk, few_values=True)


@pytest.mark.cuda
def test_cuda_lse_prefill():
    q, cache, idx, kw = _case("cuda", 300, 1, 128, 1024, 0, seed=5)
    kw.pop("topk_length")
    out, lse = deepinfer_ops.sparse_mqa_prefill(q[:, 0], cache, idx[:, 0], DIM ** -0.5, **kw)
    ref_out, ref_lse = _ref(q, cache, idx, DIM ** -0.5, kw)
    assert_lse(lse, ref_lse[:, 0])
    assert_close(out, ref_out[:, 0], TOLERANCES[torch.bfloat16], "out")


@pytest.mark.parametrize("n", [4096, 8192])
def test_lse_of_many_entries_near_zero(device, n):
    """Thousands of entries whose lse is near 0 (each weight small): a long fp32 running sum drifts past the abs
    1e-6 bound; checked against a float64 logsumexp. (CUDA: not yet run on the H200.)"""
    g = torch.Generator().manual_seed(n)
    cache = torch.zeros(n, 1, DIM)
    cache[:, 0, 0] = -torch.log(torch.tensor(float(n))) - 0.16 + 2 * torch.rand(n, generator=g) - 1
    cache = cache.bfloat16()
    q = torch.zeros(1, 1, 64, DIM, dtype=torch.bfloat16)
    q[..., 0] = 1.0
    idx = torch.arange(n, dtype=torch.int32).view(1, 1, n)
    _, lse = deepinfer_ops.sparse_mqa_decode(q.to(device), cache.to(device), idx.to(device), 1.0)
    want = torch.logsumexp(cache[:, 0, 0].double(), 0).float().expand(1, 1, 64)
    assert_lse(lse, want)


def test_reference_empty_set_with_a_nan_sink_gives_zero_out():
    """No valid entry: out 0 and lse -inf whatever the sink, a NaN sink included (as the kernels)."""
    cache = torch.randn(1, 4, DIM).bfloat16()
    q = torch.randn(1, 1, 2, DIM).bfloat16()
    idx = torch.tensor([[[-1, 4]]], dtype=torch.int32)
    sink = torch.tensor([float("nan"), 0.0])
    out, lse = refs.sparse_mqa_decode_ref(q, cache, idx, 0.1, attn_sink=sink)
    k_out, k_lse = deepinfer_ops.sparse_mqa_decode(q, cache, idx, 0.1, attn_sink=sink)
    assert torch.equal(out, torch.zeros_like(out)) and torch.equal(k_out, out)
    assert torch.all(torch.isneginf(lse)) and torch.equal(k_lse, lse)
