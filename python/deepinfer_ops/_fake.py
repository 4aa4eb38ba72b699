"""Fake (meta) implementations of every deepinfer op, so torch.compile and other engines can trace them.

All current ops write preallocated outputs and return nothing, so their fake implementations only
check what the real ones would and return None.

Every fake is registered through ``_register_fake``, which first checks that all tensor arguments are on one device.
That check matters beyond tracing: a call mixing ``meta`` tensors with CPU/CUDA ones dispatches to the Meta kernel
(Meta outranks every backend in torch's dispatch order), i.e. to these fakes, where the real ops' C++ device checks
never run; it would otherwise return a meta result or leave a CPU output unwritten. Under ``FakeTensorMode`` /
``torch.compile`` the fake tensors carry their real device, so consistent calls pass unchanged.
"""

from __future__ import annotations

import functools
import inspect

import torch

#: Ops whose fake implementation checks devices (every op; tests compare this with the registered schemas).
CHECKED_OPS: set[str] = set()


def check_same_device(op: str, bound: dict) -> None:
    """Raise RuntimeError ``deepinfer_ops.<op>: <name> is on <device> but <first> is on <device>`` unless every tensor
    in ``bound`` (argument name -> value; None, numbers and lists of tensors allowed) is on the first tensor's device."""
    first = None
    for name, value in bound.items():
        items = value if isinstance(value, (list, tuple)) else (value,)
        for t in items:
            if not isinstance(t, torch.Tensor):
                continue
            if first is None:
                first = (name, t.device)
            elif t.device != first[1]:
                raise RuntimeError(f"deepinfer_ops.{op}: {name} is on {t.device} but {first[0]} is on {first[1]} "
                                   "(all tensor arguments must be on one device)")


def _register_fake(qualname: str):
    """``torch.library.register_fake(qualname)`` for a fake that is first given the same-device check."""
    op = qualname.split("::", 1)[1]

    def deco(fn):
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def checked(*args, **kwargs):
            check_same_device(op, sig.bind(*args, **kwargs).arguments)
            return fn(*args, **kwargs)

        CHECKED_OPS.add(op)
        torch.library.register_fake(qualname)(checked)
        return fn

    return deco


@_register_fake("deepinfer_ops::rms_norm")
def _rms_norm_fake(out, input, weight, eps):
    torch._check(out.shape == input.shape, lambda: "rms_norm: out shape != input shape")
    return None


@_register_fake("deepinfer_ops::hc_mix")
def _hc_mix_fake(out, x, fn, eps):
    torch._check(out.shape == (x.shape[0], fn.shape[0]), lambda: "hc_mix: out must be [tokens, M]")
    return None


@_register_fake("deepinfer_ops::moe_combine")
def _moe_combine_fake(out, y, slot_rows, weights):
    torch._check(out.shape == (slot_rows.shape[0], y.shape[-1]), lambda: "moe_combine: out must be [tokens, hidden]")
    return None


@_register_fake("deepinfer_ops::moe_permute")
def _moe_permute_fake(m_indices, token_of_row, slot_rows, topk_idx, num_experts):
    # the native op's argument checks (moe_checks.h), so meta calls and traces refuse what eager refuses
    torch._check(topk_idx.dtype in (torch.int32, torch.int64),
                 lambda: f"moe_permute: topk_idx must be int32 or int64, got {topk_idx.dtype}")
    torch._check(topk_idx.dim() == 2, lambda: f"moe_permute: topk_idx must be [tokens, top_k], got {topk_idx.shape}")
    torch._check(0 <= num_experts < 2**31, lambda: f"moe_permute: num_experts must be in [0, 2^31), got {num_experts}")
    for t, name, dtype in ((m_indices, "m_indices", torch.int32), (token_of_row, "token_of_row", torch.int64),
                           (slot_rows, "slot_rows", torch.int64)):
        torch._check(t.dtype == dtype,
                     lambda t=t, name=name, dtype=dtype: f"moe_permute: {name} must be {dtype}, got {t.dtype}")
    torch._check(slot_rows.shape == topk_idx.shape, lambda: "moe_permute: slot_rows must be [tokens, top_k]")
    torch._check(m_indices.shape == (topk_idx.numel(),) and token_of_row.shape == (topk_idx.numel(),),
                 lambda: "moe_permute: m_indices and token_of_row must be [tokens * top_k]")
    return None


@_register_fake("deepinfer_ops::hc_weights")
def _hc_weights_fake(pre, post, comb, mix, base, scale, eps, sinkhorn_iters):
    hc = pre.shape[1]
    torch._check(mix.shape == (pre.shape[0], 2 * hc + hc * hc), lambda: "hc_weights: mix must be [tokens, 2 hc + hc^2]")
    return None


@_register_fake("deepinfer_ops::hc_collapse")
def _hc_collapse_fake(out, streams, pre):
    torch._check(out.shape == (streams.shape[0], streams.shape[-1]), lambda: "hc_collapse: out must be [tokens, hidden]")
    return None


@_register_fake("deepinfer_ops::hc_post")
def _hc_post_fake(out, streams, x, post, comb):
    torch._check(out.shape == streams.shape, lambda: "hc_post: out shape != streams shape")
    return None


@_register_fake("deepinfer_ops::per_token_group_quant_fp8")
def _per_token_group_quant_fp8_fake(out_q, out_scale, input, group_size, scale_ue8m0):
    torch._check(out_q.shape == input.shape, lambda: "per_token_group_quant_fp8: out_q shape != input shape")
    return None


@_register_fake("deepinfer_ops::rotary_embedding")
def _rotary_embedding_fake(x, positions, cos_sin_cache, inverse):
    return None


@_register_fake("deepinfer_ops::fp8_gemm_nt")
def _fp8_gemm_nt_fake(out, a, a_scale, b, b_scale, accumulate, split_k=1):
    torch._check(out.shape == (a.shape[0], b.shape[0]), lambda: "fp8_gemm_nt: out must be [M, N]")
    return None


@_register_fake("deepinfer_ops::m_grouped_fp8_gemm_nt_contiguous")
def _m_grouped_fp8_gemm_nt_contiguous_fake(out, a, a_scale, b, b_scale, m_indices):
    torch._check(out.shape == (a.shape[0], b.shape[1]), lambda: "m_grouped_fp8_gemm_nt_contiguous: out must be [M, N]")
    return None


@_register_fake("deepinfer_ops::m_grouped_fp8_gemm_nt_masked")
def _m_grouped_fp8_gemm_nt_masked_fake(out, a, a_scale, b, b_scale, masked_m):
    torch._check(out.shape == (a.shape[0], a.shape[1], b.shape[1]),
                 lambda: "m_grouped_fp8_gemm_nt_masked: out must be [G, max_m, N]")
    return None


@_register_fake("deepinfer_ops::fp4_to_fp8_blockscaled")
def _fp4_to_fp8_blockscaled_fake(out_q, out_scale, w, w_scale):
    torch._check(out_q.shape == (w.shape[0], 2 * w.shape[1]), lambda: "fp4_to_fp8_blockscaled: out_q must be [N, K]")
    return None


@_register_fake("deepinfer_ops::swiglu_clamp_quant_fp8")
def _swiglu_clamp_quant_fp8_fake(out_q, out_scale, gate_up, limit, scale_ue8m0):
    torch._check(out_q.shape == (gate_up.shape[0], gate_up.shape[1] // 2),
                 lambda: "swiglu_clamp_quant_fp8: out_q must be [rows, I]")
@_register_fake("deepinfer_ops::sparse_mqa_decode")
def _sparse_mqa_decode_fake(out, lse, q, kv_cache, indices, topk_length, extra_kv_cache, extra_indices,
                            extra_topk_length, attn_sink, softmax_scale):
    torch._check(out.shape == q.shape, lambda: "sparse_mqa_decode: out shape != q shape")
    torch._check(lse.shape == q.shape[:-1], lambda: "sparse_mqa_decode: lse shape != q.shape[:-1]")
    return None


@_register_fake("deepinfer_ops::sparse_mqa_prefill")
def _sparse_mqa_prefill_fake(out, lse, q, kv_cache, indices, topk_length, extra_kv_cache, extra_indices,
                             extra_topk_length, attn_sink, softmax_scale):
    torch._check(out.shape == q.shape, lambda: "sparse_mqa_prefill: out shape != q shape")
    torch._check(lse.shape == q.shape[:-1], lambda: "sparse_mqa_prefill: lse shape != q.shape[:-1]")
    return None


@_register_fake("deepinfer_ops::mqa_logits")
def _mqa_logits_fake(logits, q, weights, k_cache, block_table, k_start, k_end):
    torch._check(q.dim() == 3 and logits.dim() == 2 and logits.shape[0] == q.shape[0],
                 lambda: "deepinfer_ops.mqa_logits: q must be [num_tokens, H, head_dim], logits [num_tokens, n]")
    torch._check(weights.dtype == torch.float32 and tuple(weights.shape) == tuple(q.shape[:2]),
                 lambda: f"deepinfer_ops.mqa_logits: weights must be float32 {tuple(q.shape[:2])}, got "
                         f"{weights.dtype} {tuple(weights.shape)}")
    width = q.shape[2] + 4 if k_cache.dtype == torch.uint8 else q.shape[2]
    torch._check(k_cache.dim() == 3 and k_cache.shape[2] == width,
                 lambda: f"deepinfer_ops.mqa_logits: k_cache must be [num_blocks, block_size, {width}], got "
                         f"{tuple(k_cache.shape)}")
    if k_cache.dtype == torch.uint8 and k_cache.numel() > 0:
        _check_indexer_block_layout("mqa_logits", k_cache, q.shape[2])
    return None


@_register_fake("deepinfer_ops::topk_rows")
def _topk_rows_fake(values, indices, scores):
    torch._check(values.shape == indices.shape, lambda: "topk_rows: values shape != indices shape")
    return None


@_register_fake("deepinfer_ops::kv_cache_write")
def _kv_cache_write_fake(kv_cache, kv, slot_mapping):
    return None


@_register_fake("deepinfer_ops::kv_cache_write_fp8")
def _kv_cache_write_fp8_fake(kv_cache, kv, slot_mapping):
    return None


@_register_fake("deepinfer_ops::kv_cache_dequant_fp8")
def _kv_cache_dequant_fp8_fake(out, kv_cache, slot_mapping):
    return None


@_register_fake("deepinfer_ops::indexer_k_cache_write_fp8")
def _indexer_k_cache_write_fp8_fake(k_cache, k, slot_mapping):
    _check_indexer_k_cache_fp8("indexer_k_cache_write_fp8", k_cache, k, "k", slot_mapping)
    return None


@_register_fake("deepinfer_ops::indexer_k_cache_dequant_fp8")
def _indexer_k_cache_dequant_fp8_fake(out, k_cache, slot_mapping):
    _check_indexer_k_cache_fp8("indexer_k_cache_dequant_fp8", k_cache, out, "out", slot_mapping)
    return None


def _check_indexer_k_cache_fp8(op, k_cache, rows, rows_name, slot_mapping):
    torch._check(rows.dtype == torch.bfloat16 and rows.dim() == 2 and rows.shape[1] in (48, 64, 128),
                 lambda: f"deepinfer_ops.{op}: {rows_name} must be bf16 [num_tokens, head_dim in (48, 64, 128)], got "
                         f"{rows.dtype} {tuple(rows.shape)}")
    torch._check(k_cache.dtype == torch.uint8 and k_cache.dim() == 3 and k_cache.shape[2] == rows.shape[1] + 4,
                 lambda: f"deepinfer_ops.{op}: k_cache must be uint8 [num_blocks, block_size, {rows.shape[1] + 4}], "
                         f"got {k_cache.dtype} {tuple(k_cache.shape)}")
    torch._check(slot_mapping.dtype == torch.int64 and slot_mapping.shape == (rows.shape[0],) and
                 (slot_mapping.numel() == 0 or slot_mapping.is_contiguous()),
                 lambda: f"deepinfer_ops.{op}: slot_mapping must be a contiguous int64 [{rows.shape[0]}]")
    torch._check(rows.numel() == 0 or rows.stride(1) == 1,
                 lambda: f"deepinfer_ops.{op}: {rows_name} must be contiguous in its last dim")
    if k_cache.numel() > 0:
        _check_indexer_block_layout(op, k_cache, rows.shape[1])


def _check_indexer_block_layout(op, k_cache, d):
    """Each block of an FP8 indexer-key cache is one dense [block_size, d + 4] byte view (as the native check)."""
    w = d + 4
    torch._check(k_cache.stride(2) == 1 and k_cache.stride(1) == w and k_cache.stride(0) >= k_cache.shape[1] * w
                 and k_cache.stride(0) % 4 == 0,
                 lambda: f"deepinfer_ops.{op}: k_cache must hold each block densely (strides [>= block_size * {w} "
                         f"and a multiple of 4, {w}, 1]), got strides {k_cache.stride()}")


@_register_fake("deepinfer_ops::compressor_pool")
def _compressor_pool_fake(out, kv, gate):
    torch._check(out.shape == (kv.shape[0], kv.shape[-1]), lambda: "compressor_pool: out must be [windows, head_dim]")
    return None


@_register_fake("deepinfer_ops::compressor_pool_rows")
def _compressor_pool_rows_fake(out, ring_kv, ring_gate, new_kv, new_gate, ape, ring_src, cur, prev, prev_ok, dst):
    hd = ring_kv.shape[-1] // 2 if prev is not None else ring_kv.shape[-1]
    torch._check(out.shape == (cur.shape[0], hd), lambda: "compressor_pool_rows: out must be [windows, head_dim]")
    return None


@_register_fake("deepinfer_ops::compressor_state_write")
def _compressor_state_write_fake(ring_kv, ring_gate, new_kv, new_gate, ring_src, st_src, st_dst):
    torch._check(st_src.shape == st_dst.shape, lambda: "compressor_state_write: st_src and st_dst must match")
    return None


@_register_fake("deepinfer_ops::logsumexp_rows")
def _logsumexp_rows_fake(out, x):
    torch._check(out.shape == (x.shape[0],), lambda: "logsumexp_rows: out must be [rows]")
    return None


@_register_fake("deepinfer_ops::decode_plan_fill")
def _decode_plan_fill_fake(out, c0, query_lens, row_starts, block_tables, window_tables, shared_len, input_ids,
                           logits_indices, num_seqs, tokens_per_seq, max_blocks, block_size, lookback, ratios, overlaps):
    torch._check(out.dtype == torch.int64 and out.dim() == 1, lambda: "decode_plan_fill: out must be 1-D int64")


@_register_fake("deepinfer_ops::step_tables_check")
def _step_tables_check_fake(out, c0, query_lens, block_tables, window_tables, shared_len, window_floor, block_size,
                            lookback, num_blocks, window_blocks, max_positions):
    torch._check(out.dtype == torch.int64 and out.numel() == 1, lambda: "step_tables_check: out must hold one int64")
    return None
