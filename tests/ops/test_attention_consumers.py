"""The sparse MQA kernel's alternate-tile consumers (CUDA only): each consumer warpgroup scores every other 64-entry
tile over all dims and passes its weights to the other (bench/NOTES-attention.md section 12). Every tile count from
0 to 11 (odd and even: either consumer scores the last tile) against the fp32 reference, with batch invariance and
decode == prefill bit for bit, and the FP8 cache.
"""

from __future__ import annotations

import pytest
import torch

import deepinfer_ops
from deepinfer_ops.testing import refs

from test_attention import _check, _decode_case, _run_decode

# Tile counts 0 .. 11 per row (topk_length draws vary them inside a case), odd and even; every head_dim the kernel
# takes; head counts that leave padded rows in the 64-row tile.
@pytest.mark.cuda
@pytest.mark.parametrize("b,s_q,h,dim,topk,window,block_size", [
    (5, 1, 64, 512, 512, 128, 64), (3, 2, 64, 512, 200, 64, 64), (2, 3, 16, 512, 70, 7, 16),
    (4, 1, 128, 256, 130, 60, 32), (3, 2, 8, 128, 33, 31, 7), (6, 1, 40, 64, 64, 0, 64), (1, 4, 64, 512, 1, 1, 64),
])
def test_cuda_alternate_consumers_match_ref(b, s_q, h, dim, topk, window, block_size):
    q, comp, idx, kw = _decode_case("cuda", b, s_q, h, dim, topk, window, block_size, 7 * b + dim + topk)
    if window == 0:
        kw = {k: v for k, v in kw.items() if k not in ("extra_kv_cache", "extra_indices", "extra_topk_length")}
    scale = dim ** -0.5
    out, lse = _run_decode(q, comp, idx, scale, **kw)
    _check(out, lse, *refs.sparse_mqa_decode_ref(q, comp, idx, scale, **kw))
    again = _run_decode(q, comp, idx, scale, **kw)
    assert torch.equal(again[0], out) and torch.equal(again[1], lse)
    # Batch invariance: one sequence alone gives its rows of the batch bit for bit.
    per_seq = ("topk_length", "extra_topk_length", "extra_indices")
    r = b - 1
    one = _run_decode(q[r:r + 1].contiguous(), comp, idx[r:r + 1].contiguous(), scale,
                      **{k: (v[r:r + 1].contiguous() if k in per_seq else v) for k, v in kw.items()})
    assert torch.equal(one[0], out[r:r + 1]) and torch.equal(one[1], lse[r:r + 1])


@pytest.mark.cuda
def test_cuda_alternate_consumers_decode_equals_prefill():
    """One query row per token through sparse_mqa_prefill gives the decode rows bit for bit (one kernel)."""
    q, comp, idx, kw = _decode_case("cuda", 6, 1, 64, 512, 300, 128, 64, 3, lengths=False)
    win, widx, sink = kw["extra_kv_cache"], kw["extra_indices"], kw["attn_sink"]
    out, lse = _run_decode(q, comp, idx, 512 ** -0.5, **kw)
    out_p, lse_p = deepinfer_ops.sparse_mqa_prefill(q[:, 0].contiguous(), comp, idx[:, 0].contiguous(), 512 ** -0.5,
                                                    extra_kv_cache=win, extra_indices=widx[:, 0].contiguous(),
                                                    attn_sink=sink)
    assert torch.equal(out_p, out[:, 0]) and torch.equal(lse_p, lse[:, 0])


@pytest.mark.cuda
def test_cuda_alternate_consumers_fp8_cache():
    """The FP8 MODEL1 compressed cache (rows decoded by the producer) against the reference on the decoded cache."""
    q, comp, idx, kw = _decode_case("cuda", 3, 2, 64, 512, 256, 128, 64, 11)
    comp8 = torch.empty(comp.shape[0], comp.shape[1], 584, dtype=torch.uint8, device="cuda")
    deepinfer_ops.kv_cache_write_fp8(comp8, comp.reshape(-1, 512), torch.arange(comp8.shape[0] * comp8.shape[1],
                                                                                 device="cuda"))
    out, lse = _run_decode(q, comp8, idx, 512 ** -0.5, **kw)
    slots = torch.arange(comp8.shape[0] * comp8.shape[1], device="cuda")
    deq = deepinfer_ops.kv_cache_dequant_fp8(comp8, slots).view(comp.shape)
    _check(out, lse, *refs.sparse_mqa_decode_ref(q, deq, idx, 512 ** -0.5, **kw))
