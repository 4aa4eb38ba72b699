"""Sparse MQA attention for DeepSeek-V4 (decode and prefill over paged caches with sinks), the lightning indexer's
logits, and paged-cache writes.

V4 attention reads, for every query, a set of KV entries (the sliding window plus compressed entries) through one
shared K = V head of 512 dims (448 without RoPE then 64 with RoPE), with a learned sink logit per query head. One
call reads two index lists (window cache + compressed cache), each with its own paged cache.

Paged cache layout (bf16): ``[num_blocks, block_size, head_dim]``, last dim contiguous, any block/token strides
(multiples of 8 elements and a 16-byte-aligned base on CUDA). An index ``idx`` addresses slot
``(idx // block_size, idx % block_size)``; ``-1``, any negative index and any index ``>= num_blocks * block_size``
are invalid and skipped. Byte offsets are computed in 64 bits, so page ids whose byte offset exceeds 2^31 are fine.

Edge cases (same on CPU, CUDA and in ``testing.refs``):
  * no valid entry for a (row, head) (all indices invalid, ``topk_length`` 0, or empty lists): ``out = 0`` and
    ``lse = -inf``; the sink does not change this (its term only enlarges the denominator of a zero numerator);
  * every score of a (row, head) ``-inf`` (e.g. ``-inf`` in q, or scores overflowing to ``-inf``): the same rule; a
    ``+inf`` or NaN score gives NaN ``out`` and ``lse`` (NaN in, NaN out);
  * ``topk_length`` values are clamped to ``[0, topk]``;
  * the sink is ``exp(attn_sink[h])`` added to the softmax denominator; ``lse`` never includes it.

FP8 cache ("MODEL1", V4, head_dim 512), FlashMLA's layout byte for byte: a uint8 cache ``[num_blocks, block_size,
584]`` (584 bytes per token; stride(1) == 584, blocks may be padded: FlashMLA rounds a block up to a multiple of 576
bytes). A block holds first its tokens' 576-byte rows, token t's at byte ``576 t``: ``[0, 448)`` e4m3 codes of the
448 no-RoPE dims, ``[448, 576)`` the 64 RoPE dims as bf16; then their scales, token t's 8 bytes at
``576 block_size + 8 t``: 7 UE8M0 exponents (one per 64 no-RoPE dims, ``scale = 2 ** (byte - 127)``; bytes 0 and
0xFF decode to 0 and NaN; the encoders write 114 and up, so decoding their bytes is exact) and a zero pad byte
(not read). Quantisation per 64-dim tile, FlashMLA's recipe: ``scale = 2 ** ceil(log2(max(amax / 448,
1e-4)))``, ``code = e4m3(clamp(x / scale, -448, 448))`` round-to-nearest-even. A tile holding NaN gets the byte
0xFF and NaN codes (0x7F), one holding +-inf the byte 0xFF and codes ``x / inf``: either decodes to NaN. Decoding
is exact in bf16, so attention over an FP8 cache equals attention over its decoded bf16 cache. Either list of a
sparse MQA call may be bf16 or FP8. Checked byte for byte against FlashMLA's quantiser recipe
(tests/ops/test_fp8_cache_layout.py).

float32 (CPU only): q, the caches and out may all be float32 instead of bf16 (the model's fp32 CPU path; same math,
no output rounding). CUDA takes bf16 q only.

CUDA kernel: Hopper (sm_90a) only -- other GPUs get a RuntimeError naming their compute capability. One CTA per
(query row, 64 heads): a producer warpgroup gathers the row's entries into shared memory, two consumer warpgroups run
QK^T and PV on wgmma with an fp32 online softmax (weights rounded to bf16 before PV, as FlashMLA). Not yet: split-KV
(a row's entries are one CTA's work, so results are batch-invariant by construction).

FP8 indexer keys (the lightning indexer's key cache; DeepGEMM ``fp8_paged_mqa_logits`` / vLLM
``indexer_k_quant_and_cache`` paged layout): a uint8 cache ``[num_blocks, block_size, head_dim + 4]`` whose block
holds the ``block_size x head_dim`` e4m3 codes of its keys (key j at byte ``j * head_dim``) followed by
``block_size`` fp32 scales (key j's at byte ``block_size * head_dim + 4 j``), so each block must be dense
(strides ``[>= block_size * (head_dim + 4), head_dim + 4, 1]``, the block stride a multiple of 4); the
``[.., head_dim + 4]`` shape is a view of that block, row j is *not* key j's codes and scale. One scale per key, a
power of two stored as a plain fp32 (vLLM's "ue8m0" scale format), the same recipe with one group of ``head_dim``
dims: ``scale = 2 ** ceil(log2(max(amax, 1e-10) / 448))`` (an all-zero key: scale 2^-42, zero codes; vLLM's writer
floors amax at 1e-4 instead: keys with amax < 1e-4 are coded differently; any fp32 scale written by another engine
reads the same).
Decoding (``bf16(e4m3 * scale)``) is exact, so :func:`mqa_logits` over an FP8 key cache equals it over the decoded
bf16 cache bit for bit (NaN keys give NaN logits; NaN bit patterns may differ from torch's).

Source: DeepSeek-V4 attention (DeepSeek-V4 technical report; transformers ``DeepseekV4ForCausalLM``); FlashMLA ``flash_mla_with_kvcache`` sparse interface (the
index convention and sink formula ``out *= exp(lse) / (exp(lse) + exp(sink))``).
"""

from __future__ import annotations

import torch


def _sparse_mqa(op, q, kv_cache, indices, softmax_scale, topk_length, extra_kv_cache, extra_indices,
                extra_topk_length, attn_sink):
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
    op(out, lse, q, kv_cache, indices, topk_length, extra_kv_cache, extra_indices, extra_topk_length, attn_sink,
       float(softmax_scale))
    return out, lse


def sparse_mqa_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    *,
    topk_length: torch.Tensor | None = None,
    extra_kv_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse multi-query attention for decode (``s_q >= 1`` query positions per sequence, e.g. speculative
    verification), reading KV entries by index from one or two paged caches.

    For query row (b, s) and head h, with the valid entries j of ``indices`` then of ``extra_indices``:
    ``s_j = softmax_scale * q[b, s, h] . k_j`` (all ``head_dim`` dims), ``lse = log(sum_j exp(s_j))`` and
    ``out[b, s, h] = sum_j exp(s_j) k_j / (sum_j exp(s_j) + exp(attn_sink[h]))`` (K = V: the value is the same cache
    row), for every h (CUDA works on blocks of 64 heads, padding the last). fp32 accumulation. The CPU kernel
    rounds only ``out`` to bf16; the CUDA kernel, like FlashMLA, also rounds the softmax weights to bf16 before P.V
    (``out``'s denominator sums the rounded weights), so the two differ by up to about ``2 ** -7 * sum_j p_j |v_j|``
    per element (``deepinfer_ops.testing.compare.BF16_WEIGHTS_REL``). ``lse`` sums the fp32 weights on both: exact
    to fp32 rounding (abs 1e-6 / rel 2 ** -15 against an fp32 reference), for merging attention states by lse.

    Args:
        q: ``[b, s_q, h, head_dim]`` bf16 (CPU also float32, with float32 caches), contiguous; head_dim 512 for V4
            (64/128/256 also accepted).
        kv_cache: ``[num_blocks, block_size, head_dim]`` bf16 paged cache (e.g. the compressed-entry cache), or
            ``[num_blocks, block_size, 584]`` uint8 MODEL1 FP8 cache (head_dim 512; layout in the module doc).
        indices: ``[b, s_q, topk]`` int32, contiguous: ``block_id * block_size + offset``; -1 / out of range invalid.
        softmax_scale: multiplies ``q . k`` (V4: ``512 ** -0.5``), natural-log units.
        topk_length: optional ``[b]`` int32: only ``indices[b, :, :topk_length[b]]`` are read (clamped to
            ``[0, topk]``).
        extra_kv_cache, extra_indices, extra_topk_length: an optional second list, same layouts (e.g. the sliding
            window cache and its ``[b, s_q, window]`` indices): the cache and its indices are given together,
            ``extra_topk_length`` (``[b]`` int32) is optional.
        attn_sink: optional ``[h]`` fp32 sink logits.
    Returns:
        ``(out [b, s_q, h, head_dim] q.dtype, lse [b, s_q, h] fp32)``; see the module doc for the empty-set rule.
    Raises:
        RuntimeError naming the tensor at fault (dtype, shape, device, contiguity, alignment on CUDA).
    Source: DeepSeek-V4 attention; FlashMLA sparse decode interface.
    """
    return _sparse_mqa(torch.ops.deepinfer_ops.sparse_mqa_decode, q, kv_cache, indices, softmax_scale, topk_length,
                       extra_kv_cache, extra_indices, extra_topk_length, attn_sink)


def sparse_mqa_prefill(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    indices: torch.Tensor,
    softmax_scale: float,
    *,
    topk_length: torch.Tensor | None = None,
    extra_kv_cache: torch.Tensor | None = None,
    extra_indices: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse multi-query attention over packed variable-length query sequences (prefill, chunked prefill).

    Same math as :func:`sparse_mqa_decode`, one row per query token. Because every index is an absolute cache
    slot, the packing needs no ``cu_seqlens``: the sequence boundaries (and causality) are carried by each token's
    indices and ``topk_length``.

    Args:
        q: ``[num_tokens, h, head_dim]`` bf16 (CPU also float32), contiguous (tokens of all sequences packed).
        kv_cache: ``[num_blocks, block_size, head_dim]`` bf16 (float32 with a float32 q), or MODEL1 FP8 uint8.
        indices: ``[num_tokens, topk]`` int32; ``topk_length``: optional ``[num_tokens]`` int32.
        extra_kv_cache, extra_indices ``[num_tokens, topk2]``, extra_topk_length ``[num_tokens]``: optional second list.
        softmax_scale, attn_sink: as in :func:`sparse_mqa_decode`.
    Returns:
        ``(out [num_tokens, h, head_dim] q.dtype, lse [num_tokens, h] fp32)``.
    Raises:
        RuntimeError naming the tensor at fault.
    Source: DeepSeek-V4 attention; FlashMLA sparse prefill interface.
    """
    return _sparse_mqa(torch.ops.deepinfer_ops.sparse_mqa_prefill, q, kv_cache, indices, softmax_scale, topk_length,
                       extra_kv_cache, extra_indices, extra_topk_length, attn_sink)


def mqa_logits(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    num_candidates: int | None = None,
    *,
    block_table: torch.Tensor | None = None,
    k_start: torch.Tensor | None = None,
    k_end: torch.Tensor | None = None,
) -> torch.Tensor:
    """Lightning-indexer logits: ``logits[t, c] = sum_h weights[t, h] * relu(q[t, h] . k_c)`` (fp32; the CPU sums
    the heads in index order, the CUDA kernel in a fixed order of its own, so the two may differ in the last bits;
    neither depends on the batch), ``-inf`` for candidates that are masked or invalid. Fold any softmax scale or ``H ** -0.5`` into
    ``weights``.

    Candidate c of token t is key ``c % block_size`` of block ``blk = c // block_size`` (no block_table) or
    ``blk = block_table[t, c // block_size]`` (paged; a block past the table's end -- e.g. a table with no
    columns -- or outside ``[0, num_blocks)``, -1 included, is invalid). For a bf16 / float32 cache that key is
    the row ``k_cache[blk, c % block_size]``; FP8 keys (uint8 cache) are stored per block, all codes then all
    scales (module doc), and are decoded exactly to bf16 first: the logits equal those over the decoded cache bit
    for bit. ``k_start`` / ``k_end`` mask candidates c (logical positions, before the block-table lookup) outside
    ``[k_start[t], k_end[t])`` (e.g. future entries; any int32 values). Slots of a valid block that were never
    written are not masked: their keys are whatever the cache holds (zeros in a zeroed cache: logit 0), so mask
    them with ``k_end`` or the block table. Every column of the output is written.

    Args:
        q: ``[num_tokens, H, head_dim]`` bf16 (CPU also float32, with a float32 k_cache; FP8 keys need a bf16 q),
            contiguous; head_dim 48 (the tiny test preset), 64 or 128 (V4: H 64, head_dim 128); any H >= 1 on the
            CPU, H <= 128 on CUDA.
        weights: ``[num_tokens, H]`` fp32, contiguous.
        k_cache: ``[num_blocks, block_size, head_dim]`` bf16 (or float32, CPU) indexer-key cache, last dim
            contiguous, or FP8 keys ``[num_blocks, block_size, head_dim + 4]`` uint8 (written by
            :func:`indexer_k_cache_write_fp8`; each block dense, block stride a multiple of 4 bytes, on CUDA of 16
            and 16-byte aligned). Always 3-D.
        num_candidates: columns of the output; default ``num_blocks * block_size`` (no block_table) or
            ``max_blocks * block_size`` (with block_table).
        block_table: optional ``[num_tokens, max_blocks]`` int32, contiguous.
        k_start, k_end: optional ``[num_tokens]`` int32, contiguous.
    Returns:
        ``logits [num_tokens, num_candidates]`` fp32. (The registered op
        ``torch.ops.deepinfer_ops.mqa_logits(logits!, q, weights, k_cache, block_table?, k_start?, k_end?)`` fills a
        caller-allocated ``logits``; its column count is num_candidates.)
    Raises:
        RuntimeError naming the tensor at fault; ValueError for a q that is not 3-D, a bad num_candidates, or (when
        num_candidates is left to default) a k_cache that is not 3-D or a block_table that is not 2-D.
    Source: DeepSeek-V3.2/V4 lightning indexer (DeepGEMM ``fp8_mqa_logits`` / ``fp8_paged_mqa_logits`` semantics;
    q stays bf16).
    """
    if q.dim() != 3:
        raise ValueError(f"mqa_logits: q must be [num_tokens, num_heads, head_dim], got shape {tuple(q.shape)}")
    if num_candidates is None:
        if k_cache.dim() != 3 or (block_table is not None and block_table.dim() != 2):
            raise ValueError(f"mqa_logits: k_cache must be [num_blocks, block_size, width] and block_table "
                             f"[num_tokens, max_blocks], got shapes {tuple(k_cache.shape)} and "
                             f"{None if block_table is None else tuple(block_table.shape)}")
        blocks = block_table.shape[1] if block_table is not None else k_cache.shape[0]
        num_candidates = blocks * k_cache.shape[1]
    if isinstance(num_candidates, bool) or not isinstance(num_candidates, int) or num_candidates < 0:
        raise ValueError(f"mqa_logits: num_candidates must be an int >= 0, got {num_candidates!r}")
    logits = torch.empty((q.shape[0], num_candidates), dtype=torch.float32, device=q.device)
    torch.ops.deepinfer_ops.mqa_logits(logits, q, weights, k_cache, block_table, k_start, k_end)
    return logits


def kv_cache_write(kv_cache: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Append rows into a paged cache in place: ``kv_cache[s // block_size, s % block_size] = kv[i]`` with
    ``s = slot_mapping[i]``. One op serves the window KV (512 dims), the compressed entries (512) and the indexer
    keys (128). Slots ``< 0`` (padding) or ``>= num_blocks * block_size`` are skipped; two rows naming one slot in a
    call is not supported.

    Args:
        kv_cache: ``[num_blocks, block_size, entry_dim]`` any dtype, last dim contiguous (mutated).
        kv: ``[num_tokens, entry_dim]`` same dtype, last dim contiguous.
        slot_mapping: ``[num_tokens]`` int64.
    Raises:
        RuntimeError naming the tensor at fault.
    Source: vLLM ``reshape_and_cache`` (semantics).
    """
    torch.ops.deepinfer_ops.kv_cache_write(kv_cache, kv, slot_mapping)


def kv_cache_write_fp8(kv_cache: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantise bf16 rows into MODEL1 FP8 entries of a paged cache, in place (layout and recipe in the module doc):
    entry ``s = slot_mapping[i]`` of ``kv_cache`` encodes ``kv[i]``; slots ``< 0`` or past the cache are skipped.

    Args:
        kv_cache: ``[num_blocks, block_size, 584]`` uint8 (mutated), FlashMLA's block layout: stride(1) == 584,
            stride(2) == 1, blocks that do not overlap.
        kv: ``[num_tokens, 512]`` bf16 (448 no-RoPE dims then 64 RoPE dims), last dim contiguous.
        slot_mapping: ``[num_tokens]`` int64.
    Raises:
        RuntimeError naming the tensor at fault.
    Source: FlashMLA "MODEL1" FP8 sparse cache (DeepSeek-V4) and its quantiser's scale rule.
    """
    torch.ops.deepinfer_ops.kv_cache_write_fp8(kv_cache, kv, slot_mapping)


def kv_cache_dequant_fp8(kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Decode the MODEL1 FP8 entries at ``slot_mapping`` to bf16 ``[num_tokens, 512]`` (exact); slots outside the
    cache give zero rows.

    Args:
        kv_cache: ``[num_blocks, block_size, 584]`` uint8.
        slot_mapping: ``[num_tokens]`` int64.
    Returns:
        ``[num_tokens, 512]`` bf16.
    Raises:
        ValueError if slot_mapping is not a 1-D tensor; RuntimeError naming the tensor at fault otherwise.
    Source: FlashMLA "MODEL1" FP8 sparse cache.
    """
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dim() != 1:
        raise ValueError("kv_cache_dequant_fp8: slot_mapping must be a 1-D int64 tensor")
    out = torch.empty((slot_mapping.shape[0], 512), dtype=torch.bfloat16, device=kv_cache.device)
    torch.ops.deepinfer_ops.kv_cache_dequant_fp8(out, kv_cache, slot_mapping)
    return out


def indexer_k_cache_write_fp8(k_cache: torch.Tensor, k: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantise bf16 indexer keys into an FP8 indexer-key cache, in place (layout and recipe in the module doc): key
    ``s = slot_mapping[i]`` (key ``s % block_size`` of block ``s // block_size``) encodes ``k[i]``; slots ``< 0`` or
    past the cache are skipped; two rows naming one slot in a call is not supported. A key holding NaN or +-inf gets
    a NaN scale (all its dims decode to NaN), as in :func:`kv_cache_write_fp8`.

    Args:
        k_cache: ``[num_blocks, block_size, head_dim + 4]`` uint8 (mutated), each block dense.
        k: ``[num_tokens, head_dim]`` bf16, head_dim 48, 64 or 128, last dim contiguous.
        slot_mapping: ``[num_tokens]`` int64.
    Raises:
        RuntimeError naming the tensor at fault.
    Source: vLLM ``indexer_k_quant_and_cache`` (layout; its "ue8m0" power-of-two scales, stored as fp32), DeepGEMM
    ``fp8_paged_mqa_logits``.
    """
    torch.ops.deepinfer_ops.indexer_k_cache_write_fp8(k_cache, k, slot_mapping)


def indexer_k_cache_dequant_fp8(k_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Decode the FP8 indexer keys at ``slot_mapping`` to bf16 ``[num_tokens, head_dim]`` (exact); slots outside the
    cache give zero rows.

    Args:
        k_cache: ``[num_blocks, block_size, head_dim + 4]`` uint8, each block dense.
        slot_mapping: ``[num_tokens]`` int64.
    Returns:
        ``[num_tokens, head_dim]`` bf16.
    Raises:
        RuntimeError naming the tensor at fault.
    Source: DeepGEMM ``fp8_paged_mqa_logits`` key layout.
    """
    if k_cache.dim() != 3 or k_cache.shape[2] - 4 not in (48, 64, 128):
        raise ValueError(f"indexer_k_cache_dequant_fp8: k_cache must be [num_blocks, block_size, head_dim + 4] with "
                         f"head_dim 48, 64 or 128, got shape {tuple(k_cache.shape)}")
    if not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dim() != 1:
        raise ValueError("indexer_k_cache_dequant_fp8: slot_mapping must be a 1-D int64 tensor")
    out = torch.empty((slot_mapping.shape[0], k_cache.shape[2] - 4), dtype=torch.bfloat16, device=k_cache.device)
    torch.ops.deepinfer_ops.indexer_k_cache_dequant_fp8(out, k_cache, slot_mapping)
    return out


def compressor_pool(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The V4 compressor's window pooling: ``out[w, d] = sum_s kv[w, s, d] * softmax_s(gate[w, :, d])``.

    Each ``(window, dim)`` is computed on its own over the window's slots in slot order (max, then the exp-sum and
    the exp-weighted kv sum in float32, one division, one rounding), so a window's entry does not depend on how many
    windows close in the call (batch-invariant; the same kernel serves both modes).

    Args:
        kv: ``[windows, slots, head_dim]`` float32 / bfloat16 / float16, last dim contiguous (any other strides).
        gate: ``[windows, slots, head_dim]`` float32 gate logits (``gate + ape``); ``-inf`` = slot not used.
    Returns:
        ``[windows, head_dim]`` in ``kv.dtype``. A ``(window, dim)`` whose gates are all ``-inf`` (or that has no
        slots), or hold NaN or +inf, gives NaN (as ``torch.softmax``). A ``(window, dim)`` whose exp-weighted kv sum
        overflows float32 (``|kv|`` near FLT_MAX / slots) is redone with kv scaled by a power of two, so its finite
        mean is not reported as inf (other entries keep the one-pass bits).
    Raises:
        RuntimeError naming the tensor at fault.
    Source: DeepSeek-V4 compressor (CSA / HCA): softmax over the window's positions of the gate plus the absolute
    position embedding, the gated sum of the kv rows (transformers ``modeling_deepseek_v4.py``).
    """
    if kv.dim() != 3:
        raise ValueError(f"compressor_pool: kv must be [windows, slots, head_dim], got shape {tuple(kv.shape)}")
    out = torch.empty(kv.shape[0], kv.shape[2], dtype=kv.dtype, device=kv.device)
    torch.ops.deepinfer_ops.compressor_pool(out, kv, gate)
    return out

def compressor_pool_rows(ring_kv: torch.Tensor, ring_gate: torch.Tensor, new_kv: torch.Tensor,
                         new_gate: torch.Tensor, ape: torch.Tensor, ring_src: torch.Tensor, cur: torch.Tensor,
                         prev: torch.Tensor | None, prev_ok: torch.Tensor | None, dst: torch.Tensor) -> torch.Tensor:
    """:func:`compressor_pool` of windows whose slot rows are picked by index lists (no gathered copies).

    Row ``r`` of ``all = cat(ring[ring_src], new)`` is ring row ``ring_src[r]`` for ``r < len(ring_src)``, else new
    row ``r - len(ring_src)``. Window ``w`` pools, in slot order:
    - no overlap (HCA, ``prev`` None): the rows ``cur[w]``, channels ``[0, C)``, gate ``+ ape[s]``;
    - overlap (CSA, ``C = 2 hd``): the rows ``prev[w]`` on channels ``[0, hd)`` (only if ``prev_ok[w]``), then the
      rows ``cur[w]`` on channels ``[hd, 2 hd)``, gate ``+ ape[s]`` on the same channels.
    The arithmetic equals :func:`compressor_pool` on the gathered ``[kv, gate + ape]`` (missing slots weigh 0).

    Args:
        ring_kv / ring_gate: ``[ring_slots, C]`` contiguous state rings (float32 / bfloat16 / float16).
        new_kv / new_gate: ``[new_rows, C]`` this step's projections, same dtype, contiguous in C (any row stride).
        ape: ``[m, C]`` float32 absolute position embedding of the window slots.
        ring_src: ``[n_ring]`` int64 ring slots; cur / prev: ``[n, m]`` int64 rows of ``all``; prev_ok: ``[n]``
            int64 (0: no previous window); dst: ``[n]`` int64, ``< 0``: window not needed (its row is 0, nothing
            read).
    Returns:
        ``[n, hd]`` in the rings' dtype. A window with a row or ring slot out of range gives NaN.
    Raises:
        RuntimeError naming the tensor at fault.
    Source: DeepSeek-V4 compressor (transformers ``modeling_deepseek_v4.py``), as :func:`compressor_pool`.
    """
    if cur.dim() != 2:
        raise ValueError(f"compressor_pool_rows: cur must be [windows, ratio], got shape {tuple(cur.shape)}")
    hd = ring_kv.shape[-1] // 2 if prev is not None else ring_kv.shape[-1]
    out = torch.empty(cur.shape[0], hd, dtype=ring_kv.dtype, device=ring_kv.device)
    torch.ops.deepinfer_ops.compressor_pool_rows(out, ring_kv, ring_gate, new_kv, new_gate, ape, ring_src, cur, prev,
                                                 prev_ok, dst)
    return out


def compressor_state_write(ring_kv: torch.Tensor, ring_gate: torch.Tensor, new_kv: torch.Tensor,
                           new_gate: torch.Tensor, ring_src: torch.Tensor, st_src: torch.Tensor,
                           st_dst: torch.Tensor) -> None:
    """Persist the compressor's open-window rows, in place: ``ring[st_dst[i]] = all[st_src[i]]`` for kv and gate
    (``all`` as in :func:`compressor_pool_rows`).

    Args:
        ring_kv / ring_gate: ``[ring_slots, C]`` contiguous rings, written; new_kv / new_gate: ``[new_rows, C]``.
        ring_src: ``[n_ring]`` int64; st_src / st_dst: ``[n_st]`` int64 (``st_dst < 0`` or past the ring: skipped;
            an ``st_src`` out of range writes NaN).
    A slot written must not be a ring slot that another ``st_src`` row reads (the step plan never does: state moves
    to another block's ring, or only new rows are written).
    Raises:
        RuntimeError naming the tensor at fault.
    """
    torch.ops.deepinfer_ops.compressor_state_write(ring_kv, ring_gate, new_kv, new_gate, ring_src, st_src, st_dst)

