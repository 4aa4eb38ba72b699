"""DeepSeek-V4 (V4-Flash architecture) forward pass over a paged cache.

Interface (for the engine and the checkpoint code):

* :class:`DeepseekV4Config` (``config.py``) -- ``DeepseekV4Config.from_dict(config_json)`` / ``from_json_file(dir)``;
  ``TINY_CONFIG`` the built-in preset.
* ``expected_parameters(config) -> {native name: (shape, kind)}`` and ``init_parameters(config, seed)``
  (``params.py``); :class:`DeepseekV4ForCausalLM` ``.state_dict()`` has exactly these names, so
  ``model.load_state_dict(tensors)`` loads a native checkpoint 1:1.
* ``CacheSpec`` / ``allocate_cache(config, num_blocks, device, dtype)`` (``cache.py``): the paged decoding state
  (window KV, compressed entries, indexer keys, partial-window compressor state) addressed through block tables.
* ``DeepseekV4ForCausalLM.forward(batch: ForwardBatch, cache) -> logits [num_logits, vocab] float32`` runs one engine
  step (any mix of prefill chunks and decodes, see ``deepinfer/forward_batch.py``) and writes the new tokens' cache
  entries; ``forward_full(input_ids)`` is a convenience over the same code with a temporary cache;
  ``forward_mtp(batch, cache, hidden_streams)`` runs the MTP (next-n) layer.

Architecture (all names are the native checkpoint's):

* mHC: the residual is ``hc_mult`` streams ``[T, hc, D]``; per sublayer ``hc_{attn,ffn}_{fn,base,scale}`` give
  ``pre = sigmoid(.) + eps`` (collapse), ``post = 2 sigmoid(.)`` (expand) and ``comb`` = Sinkhorn-normalised
  ``softmax(.) + eps`` (``hc_sinkhorn_iters`` alternations, column first) mixing ``new = post * out + comb^T @ streams``.
  The mixing logits come from the unweighted-RMS-normalised flattened streams. ``hc_head_*`` collapses at the end.
* Attention: q-LoRA (``wq_a`` -> ``q_norm`` -> ``wq_b``), unweighted per-head q RMSNorm, one shared K=V head
  (``wkv`` -> ``kv_norm``), interleaved RoPE on the trailing ``qk_rope_head_dim`` channels (sliding layers: plain
  ``rope_theta``; compressed layers: ``compress_rope_theta`` with YaRN, attention factor 1), scale ``head_dim^-0.5``,
  a per-head sink logit in the softmax denominator, the output's rope slice rotated back (conjugate), grouped
  low-rank output ``wo_a`` (block diagonal, ``o_groups``) then ``wo_b``.
  Keys: the last ``sliding_window`` raw tokens (query included) plus, for CSA (ratio 4), the top-``index_topk``
  closed compressed entries chosen by the lightning indexer, for HCA (ratio 128) every closed compressed entry.
  One :func:`deepinfer_ops.sparse_mqa_prefill` call per layer and step reads both as index lists into the paged
  caches (window: the ``kv`` pool, block_size 128; compressed: the ``comp`` pool, block_size ``128 // m``), on CPU
  (bf16 or float32) and CUDA (bf16) alike; cache writes go through :func:`deepinfer_ops.kv_cache_write`.
* Compressor: per channel softmax over a window's gate (``wgate x + ape[slot]``, float32) pooling ``wkv x``; CSA
  overlaps windows (entry ``w`` pools window ``w-1``'s first half channels "Ca" and window ``w``'s second half "Cb",
  ``2m`` slots), then ``norm`` and RoPE at position ``w m``. An entry is visible to query ``t`` iff its window closed:
  ``w < (t + 1) // m``.
* Indexer: its own overlapped compressor at ``index_head_dim``; score ``sum_h (weights_proj(x)_h / sqrt(n_h)) *
  ReLU(q_h . k / sqrt(index_head_dim))``, future entries masked: :func:`deepinfer_ops.mqa_logits` over the paged
  indexer keys (both scalings folded into its per-head weights, ``k_end = (t + 1) // m``), then the top-k by
  :func:`deepinfer_ops.topk` (:func:`indexer_topk`).
* MoE: router ``gate`` (score ``sqrtsoftplus``), selection by ``tid2eid[token]`` (hash layers) or top-k of
  ``score + bias`` (the tie rule), weights = selected unbiased scores renormalised x ``routed_scaling_factor``;
  experts ``w2(silu(min(w1 x, L)) * clamp(w3 x, -L, L))``; shared expert (same clamp) added unscaled.
* Head: ``hc_head`` collapse -> ``norm`` -> ``head``.
* MTP layer ``j``: ``x = e_proj(enorm(embed(t+1))) + h_proj(hnorm(streams_t))`` per stream, one decoder block, its
  own ``hc_head`` and ``norm``, the shared ``head``.

Tie rule (indexer and router): higher score first, then lower index (``deepinfer_ops.topk``).

Batch-invariant mode (``ForwardBatch.batch_invariant``, set by ``LLM(batch_invariant=True)`` / ``--batch-invariant``;
an explicit per-step argument, no global state): every token's row is computed with a reduction order that depends
neither on the number of tokens in the step nor on the other sequences, nor on how its prompt was chunked:

* GEMMs (every linear, ``wo_a``'s groups, router, experts, mHC mixes, LM head): the token dimension is zero-padded
  once per step to a multiple of ``BI_GEMM_ROWS`` (128 on CUDA, 16 on the CPU) and every ``torch.mm`` has that many
  rows (:func:`linear_rows`): cuBLAS picks tiles / split-K by M, MKL takes other code paths for small M, so a fixed
  shape is the only way to get one kernel for every row. Experts pad their gathered tokens the same way.
* Attention: ``sparse_mqa_prefill`` computes every query row on its own from its own index lists (window by
  position, entries by id, -1 padding; the kernels are batch-invariant by construction); the indexer's
  ``mqa_logits`` and top-k are row-wise too (masked candidates score -inf, the tie rule fixes the selection) and the
  selected entries are passed in entry order. Padding rows get no entries (output 0).
* Compressor pooling: softmax sum and pooled sum as explicit float32 adds in slot order. mHC stream sums: explicit
  float32 adds in stream order (no batched matmul whose batch count is the number of tokens).
* Norms: ``deepinfer_ops.rms_norm`` (one row per program); rotary: elementwise; router / indexer top-k: the tie
  rule; MoE combine: a token's experts added in ascending expert id (as in the default mode).
* CPU only: transcendental elementwise ops go through :func:`pointwise` (torch's SIMD loops compute tails with
  scalar libm, so a value would depend on its position).

Cost: padded GEMM rows (free while a GEMM is bandwidth-bound on its weight, i.e. a decode step of <= 128 tokens on
the GPU) and one GEMM launch per 128 tokens in prefill.

Source: transformers 5.23 ``modeling_deepseek_v4.py`` (the parity reference, read, not imported);
/work/shared/reference/architecture.md; DeepSeek-V4 paper.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import deepinfer_ops
from deepinfer.forward_batch import ForwardBatch

from .cache import BLOCK_SIZE, CacheSpec, DeepseekV4Cache, allocate_cache
from .config import CSA, HASH_MOE, HCA, MOE, SLIDING, TINY_CONFIG, DeepseekV4Config
from .params import KINDS, expected_parameters, init_parameters

__all__ = [
    "BLOCK_SIZE",
    "CacheSpec",
    "DeepseekV4Cache",
    "DeepseekV4Config",
    "DeepseekV4ForCausalLM",
    "KINDS",
    "TINY_CONFIG",
    "allocate_cache",
    "expected_parameters",
    "indexer_select",
    "indexer_topk",
    "init_parameters",
    "rope_inv_freq",
]


# ----------------------------------------------------------------------------------------------------------------
# RoPE frequencies
# ----------------------------------------------------------------------------------------------------------------
def rope_inv_freq(config: DeepseekV4Config, kind: str) -> torch.Tensor:
    """``[qk_rope_head_dim / 2]`` float32 inverse frequencies. ``kind`` = ``"main"`` (sliding layers: plain,
    ``rope_theta``) or ``"compress"`` (CSA/HCA layers, compressors, indexer: ``compress_rope_theta``, YaRN if
    ``config.rope_scaling``; the YaRN attention factor is 1, cos/sin are not rescaled).
    Source: transformers 5.23 ``_compute_yarn_parameters`` (truncate=True), same float32 arithmetic."""
    dim = config.qk_rope_head_dim
    if kind == "main":
        base = config.rope_theta
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    if kind != "compress":
        raise ValueError(f"rope kind: expected 'main' or 'compress', got {kind!r}")
    base = config.compress_rope_theta
    ys = config.rope_scaling
    if ys is None:
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    factor, orig = ys["factor"], ys["original_max_position_embeddings"]
    beta_fast, beta_slow = ys["beta_fast"], ys["beta_slow"]

    def correction_dim(num_rot: float) -> float:
        return (dim * math.log(orig / (num_rot * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extra_factor = 1 - ramp
    return interpolation * (1 - extra_factor) + extrapolation * extra_factor


# ----------------------------------------------------------------------------------------------------------------
# parameter holders (names = native checkpoint names)
# ----------------------------------------------------------------------------------------------------------------
def _param(*shape: int, dtype=torch.float32) -> nn.Parameter:
    return nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)


def linear_rows(x: torch.Tensor, weight: torch.Tensor, rows: int = 0) -> torch.Tensor:
    """``y = x @ weight.T``; with ``rows > 0`` every GEMM call has exactly ``rows`` rows (batch-invariant mode).

    Args:
        x: ``[..., in]`` activations (any leading dims, flattened to ``[M, in]``).
        weight: ``[out, in]``, same dtype as ``x``.
        rows: 0 = one ``F.linear`` call (the library picks tiles / split-K by M, so a row's bits may depend on M);
            ``rows > 0`` = the rows are cut into chunks of exactly ``rows`` (the last one zero-padded) and each chunk
            is one ``torch.mm`` of the fixed shape ``[rows, in'] x [in', out']`` (``in``, ``out`` zero-padded to
            multiples of 16 -- MKL treats narrow / odd shapes position-dependently; the model's large weights need
            no padding). Every call has the same shape, strides and (>= 256-byte) operand alignment, so cuBLAS /
            MKL choose the same kernel for every chunk and a row's reduction order is the same wherever it sits and
            whoever shares its chunk.
    Returns:
        ``[..., out]`` in ``x.dtype``.
    Cost: ``ceil(M / rows)`` GEMM launches instead of one and up to ``rows - 1`` padded rows; with ``rows`` = 128 on
    CUDA a decode batch of <= 128 tokens is still one launch (bandwidth-bound on the weight, the padding is free).
    """
    if rows <= 0:
        return F.linear(x, weight)
    k, n = x.shape[-1], weight.shape[0]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m == 0:
        return x2.new_empty(*lead, n)
    kp, np_ = -(-k // 16) * 16, -(-n // 16) * 16
    if (kp, np_) != (k, n):
        w = weight.new_zeros(np_, kp)
        w[:n, :k] = weight
        weight = w
    chunks = -(-m // rows)
    align = 256 if x2.is_cuda else 64  # what fresh allocations guarantee (CUDA caching allocator / c10 CPU)
    if m % rows or kp != k or not x2.is_contiguous() or x2.data_ptr() % align:
        # a fresh zero-padded copy; every chunk start then keeps the base alignment, as rows * kp * itemsize is a
        # multiple of 256 for rows >= 8 (and of 64 for any rows)
        xp = x2.new_zeros(chunks * rows, kp)
        xp[:m, :k] = x2
        x2 = xp
    out = x2.new_empty(chunks * rows, np_)
    wt = weight.t()
    for c in range(chunks):
        torch.mm(x2[c * rows:(c + 1) * rows], wt, out=out[c * rows:(c + 1) * rows])
    return out[:m, :n].reshape(*lead, n)


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x [M, ...]`` zero-padded along dim 0 to a multiple of ``rows`` (``x`` itself when it already is one, is
    contiguous and aligned like a fresh allocation): batch-invariant mode keeps the token dimension padded so that
    every :func:`linear_rows` call takes whole chunks without copying."""
    m = x.shape[0]
    align = 256 if x.is_cuda else 64
    if rows <= 0 or (m % rows == 0 and x.is_contiguous() and x.data_ptr() % align == 0):
        return x
    out = x.new_zeros(-(-m // rows) * rows, *x.shape[1:])
    out[:m] = x
    return out


def pad_rows_buffer(like: torch.Tensor, m: int, rows: int) -> torch.Tensor:
    """A fresh ``[ceil(m / rows) * rows, *like.shape[1:]]`` buffer for ``m`` rows of ``like``'s dtype and device.
    Its padding rows are zero on the CPU and left uninitialised on CUDA: a GEMM row (and every row-wise op) depends
    on its own row only, and padding rows are dropped, so their content never matters -- zeros on the CPU only
    avoid slow denormal arithmetic."""
    shape = (-(-m // rows) * rows, *like.shape[1:])
    return like.new_empty(shape) if like.is_cuda else like.new_zeros(shape)


def pointwise(fn, x: torch.Tensor, rows: int = 0) -> torch.Tensor:
    """``fn(x)`` for a transcendental elementwise op (sigmoid, silu, softplus, ...).

    Batch-invariant mode (``rows > 0``) on the CPU: torch's vectorised CPU loops compute the tail of each contiguous
    run (and of each thread's range) with the scalar libm function, whose last bit can differ from the SIMD one,
    so an element's value would depend on where it sits, i.e. on the batch. The op then runs on a stride-2 copy,
    which torch always processes with the scalar function, every element the same way. CUDA elementwise kernels
    apply the same device function to every element, so they run as is.
    """
    if rows <= 0 or x.device.type != "cpu":
        return fn(x)
    spread = torch.empty(*x.shape, 2, dtype=x.dtype)[..., 0]
    spread.copy_(x)
    return fn(spread)


class Linear(nn.Module):
    """``y = x @ weight.T`` on a dequantised ``[out, in]`` weight (FP8/FP4 GEMMs replace this later).
    ``forward(x, rows)``: see :func:`linear_rows` (``rows > 0``: fixed-shape, batch-invariant GEMM chunks)."""

    def __init__(self, out_features: int, in_features: int, dtype: torch.dtype):
        super().__init__()
        self.weight = _param(out_features, in_features, dtype=dtype)

    def forward(self, x: torch.Tensor, rows: int = 0) -> torch.Tensor:
        return linear_rows(x, self.weight, rows)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = _param(dim, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return deepinfer_ops.rms_norm(x.contiguous(), self.weight, self.eps)


class Embedding(nn.Module):
    def __init__(self, vocab: int, dim: int, dtype: torch.dtype):
        super().__init__()
        self.weight = _param(vocab, dim, dtype=dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class Compressor(nn.Module):
    """Gated pooling compressor (``wkv``, ``wgate``, ``ape``, ``norm``); ``overlap`` = CSA's two-series windows."""

    def __init__(self, cfg: DeepseekV4Config, ratio: int, head_dim: int, overlap: bool, dtype: torch.dtype):
        super().__init__()
        self.ratio, self.head_dim, self.overlap = ratio, head_dim, overlap
        coff = 2 if overlap else 1
        self.wkv = Linear(coff * head_dim, cfg.hidden_size, dtype)
        self.wgate = Linear(coff * head_dim, cfg.hidden_size, dtype)
        self.ape = _param(ratio, coff * head_dim)  # float32 in checkpoints
        self.norm = RMSNorm(head_dim, cfg.rms_norm_eps, dtype)


class Indexer(nn.Module):
    """Lightning indexer of a CSA layer (``wq_b``, ``weights_proj``, its own overlapped ``compressor``)."""

    def __init__(self, cfg: DeepseekV4Config, ratio: int, dtype: torch.dtype):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = Linear(cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank, dtype)
        self.weights_proj = Linear(cfg.index_n_heads, cfg.hidden_size, dtype)
        self.compressor = Compressor(cfg, ratio, cfg.index_head_dim, True, dtype)


class Attention(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, ratio: int, dtype: torch.dtype):
        super().__init__()
        H, hd, D = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
        self.layer_type = cfg.layer_type_of_ratio(ratio)
        self.ratio = ratio
        self.rope_kind = "main" if self.layer_type == SLIDING else "compress"
        self.wq_a = Linear(cfg.q_lora_rank, D, dtype)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dtype)
        self.wq_b = Linear(H * hd, cfg.q_lora_rank, dtype)
        self.wkv = Linear(hd, D, dtype)
        self.kv_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype)
        self.wo_a = Linear(cfg.o_groups * cfg.o_lora_rank, H * hd // cfg.o_groups, dtype)
        self.wo_b = Linear(D, cfg.o_groups * cfg.o_lora_rank, dtype)
        self.attn_sink = _param(H)  # float32
        if self.layer_type != SLIDING:
            self.compressor = Compressor(cfg, ratio, hd, self.layer_type == CSA, dtype)
        if self.layer_type == CSA:
            self.indexer = Indexer(cfg, ratio, dtype)


class Expert(nn.Module):
    def __init__(self, dim: int, inter: int, dtype: torch.dtype):
        super().__init__()
        self.w1 = Linear(inter, dim, dtype)  # gate
        self.w2 = Linear(dim, inter, dtype)  # down
        self.w3 = Linear(inter, dim, dtype)  # up

    def forward(self, x: torch.Tensor, limit: float, rows: int = 0) -> torch.Tensor:
        m = x.shape[0]
        x = pad_rows(x, rows)  # batch-invariant mode: pad once, the three GEMMs then take whole chunks
        gate = self.w1(x, rows).clamp(max=limit)
        up = self.w3(x, rows).clamp(min=-limit, max=limit)
        return self.w2(pointwise(F.silu, gate, rows) * up, rows)[:m]


class Gate(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, hashed: bool, dtype: torch.dtype):
        super().__init__()
        self.hashed = hashed
        self.weight = _param(cfg.n_routed_experts, cfg.hidden_size, dtype=dtype)
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.int64))
        else:
            self.bias = _param(cfg.n_routed_experts)  # float32


class MoE(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, mlp_type: str, dtype: torch.dtype):
        super().__init__()
        self.gate = Gate(cfg, mlp_type == HASH_MOE, dtype)
        self.experts = nn.ModuleList(
            Expert(cfg.hidden_size, cfg.moe_intermediate_size, dtype) for _ in range(cfg.n_routed_experts)
        )
        self.shared_experts = Expert(cfg.hidden_size, cfg.moe_intermediate_shared, dtype)


class Block(nn.Module):
    """One decoder block: ``attn_norm``, ``attn``, ``ffn_norm``, ``ffn`` and the two mHC parameter sets."""

    def __init__(self, cfg: DeepseekV4Config, ratio: int, mlp_type: str, dtype: torch.dtype):
        super().__init__()
        D, hc = cfg.hidden_size, cfg.hc_mult
        mix = (2 + hc) * hc
        self.attn_norm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.ffn_norm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.attn = Attention(cfg, ratio, dtype)
        self.ffn = MoE(cfg, mlp_type, dtype)
        for sub in ("attn", "ffn"):
            setattr(self, f"hc_{sub}_fn", _param(mix, hc * D))
            setattr(self, f"hc_{sub}_base", _param(mix))
            setattr(self, f"hc_{sub}_scale", _param(3))


class MTPBlock(Block):
    def __init__(self, cfg: DeepseekV4Config, ratio: int, dtype: torch.dtype):
        super().__init__(cfg, ratio, MOE, dtype)
        D, hc = cfg.hidden_size, cfg.hc_mult
        self.e_proj = Linear(D, D, dtype)
        self.h_proj = Linear(D, D, dtype)
        self.enorm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.norm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.hc_head_fn = _param(hc, hc * D)
        self.hc_head_base = _param(hc)
        self.hc_head_scale = _param(1)


# ----------------------------------------------------------------------------------------------------------------
# per-step bookkeeping
# ----------------------------------------------------------------------------------------------------------------
class _Seq:
    __slots__ = ("a", "b", "c0", "L", "blocks")

    def __init__(self, a: int, b: int, c0: int, L: int, blocks: torch.Tensor):
        self.a, self.b, self.c0, self.L, self.blocks = a, b, c0, L, blocks


def _check_batch(batch: ForwardBatch, cache: DeepseekV4Cache) -> list[_Seq]:
    """Validate a ForwardBatch against the cache; raises ValueError naming the field."""
    ids, pos = batch.input_ids, batch.positions
    if ids.dim() != 1 or ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"input_ids: expected 1-D int64, got {tuple(ids.shape)} {ids.dtype}")
    if pos.shape != ids.shape:
        raise ValueError(f"positions: shape {tuple(pos.shape)} != input_ids {tuple(ids.shape)}")
    if len(batch.query_lens) != len(batch.context_lens):
        raise ValueError("query_lens / context_lens: different number of sequences")
    if sum(batch.query_lens) != ids.shape[0]:
        raise ValueError(f"query_lens: sum {sum(batch.query_lens)} != num_tokens {ids.shape[0]}")
    bt = batch.block_tables
    if bt.dim() != 2 or bt.shape[0] != len(batch.query_lens):
        raise ValueError(f"block_tables: expected [num_seqs={len(batch.query_lens)}, max_blocks], got {tuple(bt.shape)}")
    B = cache.block_size
    seqs, a = [], 0
    pos_cpu = pos.cpu()
    bt_cpu = bt.cpu().long()
    for i, (q, L) in enumerate(zip(batch.query_lens, batch.context_lens)):
        if q < 1 or L < q:
            raise ValueError(f"query_lens[{i}]={q} / context_lens[{i}]={L}: need 1 <= query_len <= context_len")
        c0 = L - q
        if not torch.equal(pos_cpu[a:a + q], torch.arange(c0, L, dtype=pos_cpu.dtype)):
            raise ValueError(f"positions: sequence {i} must hold {c0}..{L - 1} (context_len - query_len .. context_len - 1)")
        nb = (L + B - 1) // B
        if nb > bt.shape[1]:
            raise ValueError(f"block_tables: sequence {i} needs {nb} blocks for {L} tokens, row has {bt.shape[1]}")
        blocks = bt_cpu[i, :nb]
        if bool(((blocks < 0) | (blocks >= cache.num_blocks)).any()):
            raise ValueError(f"block_tables: sequence {i} uses a block id outside [0, {cache.num_blocks}): {blocks.tolist()}")
        seqs.append(_Seq(a, a + q, c0, L, blocks.to(cache.device)))
        a += q
    li = batch.logits_indices
    if li.numel() and (int(li.min()) < 0 or int(li.max()) >= ids.shape[0]):
        raise ValueError(f"logits_indices: out of range [0, {ids.shape[0]})")
    return seqs


def _token_slots(blocks: torch.Tensor, p0: int, p1: int, B: int) -> torch.Tensor:
    p = torch.arange(p0, p1, device=blocks.device)
    return blocks[p // B] * B + p % B


def _entry_slots(blocks: torch.Tensor, w0: int, w1: int, per_block: int) -> torch.Tensor:
    w = torch.arange(w0, w1, device=blocks.device)
    return blocks[w // per_block] * per_block + w % per_block


def indexer_topk(scores: torch.Tensor, visible: torch.Tensor, topk: int) -> tuple[torch.Tensor, int]:
    """Lightning-indexer top-k for one sequence's queries, as entry ids.

    Args:
        scores: ``[num_queries, num_entries]`` float32 index scores (``num_entries >= 1``).
        visible: ``[num_queries, num_entries]`` bool, entry closed before the query (``w < (t + 1) // m``).
        topk: ``index_topk``.
    Returns:
        (``[num_queries, min(topk, num_entries)]`` int64: the ids of the top ``min(topk, #visible)`` visible entries
        of each row, ranked by the tie rule -- higher score first, then lower entry index -- and ``-1`` in the
        remaining columns (fewer visible entries, or a non-finite score); number of rows whose k-th and (k+1)-th
        best visible scores are equal, i.e. where the tie rule decided the selection).
    """
    n = scores.shape[-1]
    masked = scores.masked_fill(~visible, float("-inf"))
    k = min(topk, n)
    kk = min(k + 1, n)
    vals, inds = deepinfer_ops.topk(masked, kk)
    ties = 0
    if kk > k:
        ties = int(((vals[:, k - 1] == vals[:, k]) & torch.isfinite(vals[:, k])).sum())
    vals, inds = vals[:, :k], inds[:, :k]
    ok = torch.isfinite(vals) & visible.gather(1, inds)
    return torch.where(ok, inds, torch.full_like(inds, -1)), ties


def indexer_select(scores: torch.Tensor, visible: torch.Tensor, topk: int) -> tuple[torch.Tensor, int]:
    """:func:`indexer_topk` as a mask: (``[num_queries, num_entries]`` bool, True for the selected entries; the
    number of tie-decided rows)."""
    n = scores.shape[-1]
    if n == 0:
        return torch.zeros_like(visible), 0
    ids, ties = indexer_topk(scores, visible, topk)
    sel = torch.zeros(scores.shape[0], n + 1, dtype=torch.bool, device=scores.device)
    sel.scatter_(1, torch.where(ids >= 0, ids, n), True)
    return sel[:, :n], ties


# ----------------------------------------------------------------------------------------------------------------
# the model
# ----------------------------------------------------------------------------------------------------------------
class DeepseekV4ForCausalLM(nn.Module):
    """DeepSeek-V4 with native parameter names. Parameters are zero until loaded (:meth:`from_parameters`,
    :meth:`from_checkpoint`, :meth:`load_native`).

    Args:
        config: the model config.
        dtype: parameter / activation dtype of matmul weights and norms (float32 for CPU tests, bfloat16 else); mHC
            parameters, sinks, ``ape`` and router biases stay float32 as in the checkpoints; mHC and softmax math
            run in float32.
    """

    QUERY_CHUNK = 512  # queries per lightning-indexer score chunk (bounds the [queries, entries] scores)
    # Batch-invariant mode (``ForwardBatch.batch_invariant``): rows per fixed-shape GEMM call (see ``linear_rows``),
    # per device type. The costs: up to rows - 1 padded GEMM rows per call (free while a call is bandwidth-bound on
    # its weight, as a decode step of <= 128 tokens is on the GPU) and one launch per ``rows`` tokens.
    BI_GEMM_ROWS = {"cuda": 128, "cpu": 16}
    BI_GEMM_ROWS_DEFAULT = 128

    def __init__(self, config: DeepseekV4Config, dtype: torch.dtype = torch.float32):
        super().__init__()
        cfg = self.config = config
        self.dtype = dtype
        D, hc = cfg.hidden_size, cfg.hc_mult
        self.embed = Embedding(cfg.vocab_size, D, dtype)
        self.layers = nn.ModuleList(
            Block(cfg, cfg.compress_ratios[i], cfg.mlp_layer_types[i], dtype) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.hc_head_fn = _param(hc, hc * D)
        self.hc_head_base = _param(hc)
        self.hc_head_scale = _param(1)
        self.head = Linear(cfg.vocab_size, D, dtype)
        self.mtp = nn.ModuleList(MTPBlock(cfg, cfg.mtp_compress_ratios[j], dtype) for j in range(cfg.num_nextn_predict_layers))
        with torch.device("cpu"):
            self._inv_freq = {k: rope_inv_freq(cfg, k) for k in ("main", "compress")}
        self._rope_tables: dict[tuple[str, torch.device], torch.Tensor] = {}
        self._block_size = BLOCK_SIZE  # set from the cache at each forward
        # diagnostics of the last forward: number of indexer rows whose k-th and (k+1)-th best valid scores tie
        self.last_indexer_boundary_ties = 0

    # ---- construction helpers ---------------------------------------------------------------------------------
    @classmethod
    def from_parameters(cls, config: DeepseekV4Config, tensors: dict[str, torch.Tensor],
                        dtype: torch.dtype = torch.float32) -> "DeepseekV4ForCausalLM":
        """Build and load ``tensors`` (native names, dequantised) strictly: every expected name, no extra. The model is
        built on the meta device and takes the tensors over (cast to its dtype where needed, on their device), so
        no second copy of the weights is ever allocated."""
        with torch.device("meta"):
            model = cls(config, dtype)
        model.load_native(tensors)
        return model

    @classmethod
    def from_checkpoint(cls, path=None, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu") -> "DeepseekV4ForCausalLM":
        """Load a native checkpoint folder (``None`` = the built-in tiny one) with :mod:`deepinfer.checkpoint`
        (quantised weights dequantised exactly, then cast to ``dtype``). Raises CheckpointError naming the tensor/file."""
        from deepinfer.checkpoint import load_checkpoint

        ckpt = load_checkpoint(path, dtype=dtype, device=device)
        return cls.from_parameters(ckpt.config, ckpt.params, dtype).to(device)

    def load_native(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take over dequantised native tensors as the parameters (strict: missing / unexpected names and shape
        mismatches raise ValueError naming the tensor). Integer ``tid2eid`` becomes int64, float32-kind tensors stay
        float32, the rest is cast to the model dtype."""
        own = self.state_dict()
        missing = [k for k in own if k not in tensors]
        extra = [k for k in tensors if k not in own]
        if missing or extra:
            raise ValueError(f"load_native: missing tensors {missing[:8]}{'...' if len(missing) > 8 else ''}; "
                             f"unexpected tensors {extra[:8]}{'...' if len(extra) > 8 else ''}")
        for k, t in tensors.items():
            if tuple(t.shape) != tuple(own[k].shape):
                raise ValueError(f"load_native: tensor {k} has shape {tuple(t.shape)}, expected {tuple(own[k].shape)}")
        for k, ref in own.items():
            mod_name, _, leaf = k.rpartition(".")
            mod = self.get_submodule(mod_name) if mod_name else self
            t = tensors[k].detach().to(dtype=ref.dtype)
            if leaf in mod._parameters:
                mod._parameters[leaf] = nn.Parameter(t, requires_grad=False)
            else:
                mod._buffers[leaf] = t

    def allocate_cache(self, num_blocks: int, device: torch.device | str | None = None) -> DeepseekV4Cache:
        return allocate_cache(self.config, num_blocks, device or self.embed.weight.device, self.dtype)

    # ---- rope ---------------------------------------------------------------------------------------------------
    def _rope(self, kind: str, max_pos: int, device: torch.device) -> torch.Tensor:
        key = (kind, device)
        t = self._rope_tables.get(key)
        if t is None or t.shape[0] <= max_pos:
            n = 1 << max(12, int(max_pos).bit_length())
            t = deepinfer_ops.rope_cos_sin_cache(self._inv_freq[kind].to(device), n)
            self._rope_tables[key] = t
        return t

    # ---- mHC ------------------------------------------------------------------------------------------------------
    def batch_invariant_rows(self, device: torch.device) -> int:
        """Rows per fixed-shape GEMM call in batch-invariant mode on ``device``."""
        return self.BI_GEMM_ROWS.get(torch.device(device).type, self.BI_GEMM_ROWS_DEFAULT)

    @staticmethod
    def _collapse(pre: torch.Tensor, streams: torch.Tensor, rows: int) -> torch.Tensor:
        """``sum_i pre[:, i] * streams[:, i]`` -> ``[T, D]`` in ``streams.dtype`` (batch-invariant mode: explicit adds
        in stream order, float32)."""
        if not rows:
            return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        acc = pre[:, 0, None] * streams[:, 0].float()
        for i in range(1, streams.shape[1]):
            acc = acc + pre[:, i, None] * streams[:, i].float()
        return acc.to(streams.dtype)

    def _hc_pre(self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, rows: int = 0):
        """streams ``[T, hc, D]`` -> (post ``[T, hc]``, comb ``[T, hc, hc]`` float32, collapsed ``[T, D]``).
        ``rows``: batch-invariant GEMM rows (0 = off)."""
        cfg = self.config
        hc = cfg.hc_mult
        T = streams.shape[0]
        flat = streams.reshape(T, streams.shape[1] * streams.shape[2]).float().contiguous()
        flat = deepinfer_ops.rms_norm(flat, None, cfg.rms_norm_eps)
        mix = linear_rows(flat, fn.float(), rows)
        pre_w, post_w, comb_w = mix.split([hc, hc, hc * hc], dim=-1)
        base = base.float()
        scale = scale.float()
        pre = pointwise(torch.sigmoid, pre_w * scale[0] + base[:hc], rows) + cfg.hc_eps
        post = 2 * pointwise(torch.sigmoid, post_w * scale[1] + base[hc:2 * hc], rows)
        comb = torch.softmax(comb_w.view(T, hc, hc) * scale[2] + base[2 * hc:].view(hc, hc), dim=-1) + cfg.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + cfg.hc_eps)
        for _ in range(cfg.hc_sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + cfg.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + cfg.hc_eps)
        return post, comb, self._collapse(pre, streams, rows)

    @staticmethod
    def _hc_post(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
                 rows: int = 0) -> torch.Tensor:
        """``new[:, j] = post[:, j] * out + sum_i comb[:, i, j] * streams[:, i]``. Batch-invariant mode (``rows > 0``):
        the mixing sum is explicit float32 adds in stream order instead of a batched matmul whose batch count is
        the number of tokens (cuBLAS would pick its kernel by it)."""
        dt = streams.dtype
        if not rows:
            return post.to(dt).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dt).transpose(-1, -2), streams)
        mixed = comb[:, 0, :, None] * streams[:, 0, None, :].float()
        for i in range(1, streams.shape[1]):
            mixed = mixed + comb[:, i, :, None] * streams[:, i, None, :].float()
        return post.to(dt).unsqueeze(-1) * out.unsqueeze(-2) + mixed.to(dt)

    def _hc_head(self, streams: torch.Tensor, fn, base, scale, rows: int = 0) -> torch.Tensor:
        T = streams.shape[0]
        flat = streams.reshape(T, streams.shape[1] * streams.shape[2]).float().contiguous()
        flat = deepinfer_ops.rms_norm(flat, None, self.config.rms_norm_eps)
        mixes = linear_rows(flat, fn.float(), rows)
        pre = pointwise(torch.sigmoid, mixes * scale.float() + base.float(), rows) + self.config.hc_eps
        return self._collapse(pre, streams, rows)

    # ---- compressor -------------------------------------------------------------------------------------------
    @staticmethod
    def _pool_bi(slot_kv: torch.Tensor, slot_gate: torch.Tensor) -> torch.Tensor:
        """Batch-invariant window pooling: ``[n_win, slots, hd]`` kv and float32 gates -> ``[n_win, hd]`` in the kv
        dtype, ``sum_j kv_j * softmax_j(gate)`` with the softmax sum and the pooled sum as explicit float32 adds in
        slot order (a torch reduction kernel's split of the slots over threads may follow the number of windows
        closing in the step, i.e. the prefill chunking)."""
        n_slots = slot_gate.shape[1]
        shifted = slot_gate - slot_gate.amax(dim=1, keepdim=True)  # max: exact in any order
        e = pointwise(torch.exp, shifted, 1)
        denom = e[:, 0]
        for j in range(1, n_slots):
            denom = denom + e[:, j]
        weights = (e / denom.unsqueeze(1)).to(slot_kv.dtype)
        acc = (slot_kv[:, 0] * weights[:, 0]).float()
        for j in range(1, n_slots):
            acc = acc + (slot_kv[:, j] * weights[:, j]).float()
        return acc.to(slot_kv.dtype)

    def _compress_seq(self, comp: Compressor, kv_new: torch.Tensor, gate_new: torch.Tensor, s: _Seq,
                      pool_state_kv: torch.Tensor, pool_state_gate: torch.Tensor, pool_comp: torch.Tensor,
                      rope_table: torch.Tensor, rows: int = 0) -> None:
        """Emit the entries of every window that closes in this step into ``pool_comp`` and persist the open
        window's (and for CSA the previous window's) projections in the ring of the block of the last token.
        ``kv_new`` / ``gate_new``: ``[q, coff * hd]`` projections of the step's tokens (the rings keep them as
        projected; ``ape`` is added in float32 when a window is pooled, as the reference does)."""
        m, hd, overlap = comp.ratio, comp.head_dim, comp.overlap
        B = self._block_size
        R = pool_state_kv.shape[1]
        c0, L = s.c0, s.L
        first_w, end_w = c0 // m, L // m
        s0 = max(0, first_w * m - m) if overlap else first_w * m
        if c0 > s0:
            blk = s.blocks[(c0 - 1) // B]
            ring = blk * R + torch.arange(s0, c0, device=blk.device) % R
            all_kv = torch.cat([pool_state_kv.view(-1, pool_state_kv.shape[-1])[ring].to(kv_new.dtype), kv_new])
            all_gate = torch.cat([pool_state_gate.view(-1, pool_state_gate.shape[-1])[ring].to(gate_new.dtype), gate_new])
        else:
            all_kv, all_gate = kv_new, gate_new
        n_win = end_w - first_w
        if n_win > 0:
            lo, hi = first_w * m - s0, end_w * m - s0
            ape = comp.ape.float()  # [m, coff * hd]: slot j of every window is position w m + j
            cur_kv = all_kv[lo:hi].view(n_win, m, -1)
            cur_gate = all_gate[lo:hi].view(n_win, m, -1).float() + ape
            if overlap:
                slot_kv = cur_kv.new_zeros(n_win, 2 * m, hd)
                slot_gate = cur_gate.new_full((n_win, 2 * m, hd), float("-inf"))
                slot_kv[:, m:] = cur_kv[..., hd:]
                slot_gate[:, m:] = cur_gate[..., hd:]
                # Ca half of window w-1 (windows w >= 1 only; window 0 keeps -inf gates = weight 0)
                w_from = max(first_w, 1)
                if end_w > w_from:
                    plo, phi = (w_from - 1) * m - s0, (end_w - 1) * m - s0
                    k = end_w - w_from
                    slot_kv[n_win - k:, :m] = all_kv[plo:phi].view(k, m, -1)[..., :hd]
                    slot_gate[n_win - k:, :m] = (all_gate[plo:phi].view(k, m, -1).float() + ape)[..., :hd]
            else:
                slot_kv, slot_gate = cur_kv, cur_gate
            if rows:
                entries = comp.norm(self._pool_bi(slot_kv, slot_gate.float()).contiguous())
            else:
                weights = slot_gate.softmax(dim=1, dtype=torch.float32).to(slot_kv.dtype)
                entries = comp.norm((slot_kv * weights).sum(dim=1))
            w_pos = torch.arange(first_w, end_w, device=entries.device) * m
            deepinfer_ops.rotary_embedding(entries, w_pos, rope_table)
            per_block = pool_comp.shape[1]
            deepinfer_ops.kv_cache_write(pool_comp, entries.to(pool_comp.dtype),
                                         _entry_slots(s.blocks, first_w, end_w, per_block))
        # Persist the state a later step needs: the ring of the block holding position E - 1 gets the state "as of
        # E" for E = every block end crossed by this step (so a full block is an immutable snapshot and can be shared
        # as a prefix) and E = L (the sequence's current end).
        ends = list(range((c0 // B + 1) * B, L, B)) + [L]
        for E in ends:
            r0 = max(0, (E // m) * m - m) if overlap else (E // m) * m
            if E > r0:  # E - r0 < R: the ring slots of one write are distinct
                blk = s.blocks[(E - 1) // B]
                ring = blk * R + torch.arange(r0, E, device=blk.device) % R
                deepinfer_ops.kv_cache_write(pool_state_kv, all_kv[r0 - s0:E - s0].to(pool_state_kv.dtype), ring)
                deepinfer_ops.kv_cache_write(pool_state_gate, all_gate[r0 - s0:E - s0].to(pool_state_gate.dtype), ring)

    # ---- attention ---------------------------------------------------------------------------------------------
    def _attention(self, attn: Attention, x: torch.Tensor, positions: torch.Tensor, seqs: list[_Seq],
                   pools: dict[str, torch.Tensor], rows: int = 0) -> torch.Tensor:
        """One attention sublayer over the step's tokens ``x [T, D]``. ``rows > 0``: batch-invariant mode (fixed-shape
        GEMM chunks of ``rows`` rows; the sparse attention and indexer ops compute each query row on its own)."""
        cfg = self.config
        T = x.shape[0]
        H, hd = cfg.num_attention_heads, cfg.head_dim
        B = self._block_size
        W = cfg.sliding_window
        max_pos = int(positions.max()) + 1 if T else 1
        table = self._rope(attn.rope_kind, max_pos, x.device)

        qr = attn.q_norm(attn.wq_a(x, rows))
        q = attn.wq_b(qr, rows).view(T, H, hd)
        q = deepinfer_ops.rms_norm(q.contiguous(), None, cfg.rms_norm_eps)
        deepinfer_ops.rotary_embedding(q, positions, table)
        kv = attn.kv_norm(attn.wkv(x, rows)).contiguous()
        deepinfer_ops.rotary_embedding(kv, positions, table)

        lt = attn.layer_type
        if lt != SLIDING:
            m = attn.ratio
            comp = attn.compressor
            ckv = comp.wkv(x, rows)
            cgate = comp.wgate(x, rows)
        if lt == CSA:
            idx = attn.indexer
            ikv = idx.compressor.wkv(x, rows)
            igate = idx.compressor.wgate(x, rows)
            iq = idx.wq_b(qr, rows).view(T, idx.n_heads, idx.head_dim).contiguous()
            deepinfer_ops.rotary_embedding(iq, positions, table)
            iw = idx.weights_proj(x, rows).float() * (idx.n_heads ** -0.5)

        # 1. the step's cache writes: raw K=V of every token, then every window closing in this step (compressed
        #    entries and indexer keys)
        kv_cache = pools["kv"]  # [num_blocks, B, hd]: a paged cache with block_size B
        slots = torch.cat([_token_slots(s.blocks, s.c0, s.L, B) for s in seqs])
        deepinfer_ops.kv_cache_write(kv_cache, kv[:slots.shape[0]].to(kv_cache.dtype), slots)  # not the padding rows
        if lt != SLIDING:
            for s in seqs:
                sl = slice(s.a, s.b)
                self._compress_seq(comp, ckv[sl], cgate[sl], s, pools["state_kv"], pools["state_gate"], pools["comp"],
                                   table, rows)
                if lt == CSA:
                    self._compress_seq(idx.compressor, ikv[sl], igate[sl], s, pools["idx_state_kv"],
                                       pools["idx_state_gate"], pools["idx"], table, rows)
        # 2. the index lists: window = the last W raw tokens (query included) in position order; compressed = every
        #    closed entry (HCA) or the indexer's top-k closed entries (CSA) in entry order; -1 = no entry. Per-token
        #    block tables; batch-invariant padding rows (past the sequences) get no block, hence no entry (out = 0).
        dev = x.device
        max_nb = max(s.blocks.numel() for s in seqs)
        tok_bt = torch.full((T, max_nb), -1, dtype=torch.long, device=dev)
        for s in seqs:
            tok_bt[s.a:s.b, :s.blocks.numel()] = s.blocks.to(dev)
        p = positions.view(-1, 1) + torch.arange(-W + 1, 1, device=dev)  # [T, W]
        pc = p.clamp(min=0)
        win_idx = torch.where(p >= 0, tok_bt.gather(1, pc // B) * B + pc % B, -1).to(torch.int32)
        comp_cache = comp_idx = None
        n_ent = max(s.L // m for s in seqs) if lt != SLIDING else 0
        if n_ent > 0:
            comp_cache = pools["comp"]  # [num_blocks, B // m, hd]: a paged cache with block_size B // m
            per_block = comp_cache.shape[1]
            n_vis = (positions + 1) // m  # [T]: entry w is visible to token t iff w < (t + 1) // m
            if lt == HCA:
                w = torch.arange(n_ent, device=dev).view(1, -1)
                comp_idx = torch.where(w < n_vis.view(-1, 1), tok_bt.gather(1, (w // per_block).expand(T, -1)) * per_block
                                       + w % per_block, -1).to(torch.int32)
            else:  # CSA: lightning-indexer scores (mqa_logits over the paged indexer keys), then the top-k
                ent = torch.full((T, idx.topk), -1, dtype=torch.long, device=dev)  # width independent of the batch
                ikeys = pools["idx"].to(iq.dtype)
                k_end = n_vis.to(torch.int32)
                bt32 = tok_bt.to(torch.int32)
                # one index head's weight folds both scalings: weights_proj / sqrt(n_h) and 1 / sqrt(index_head_dim)
                iw = iw * (idx.head_dim ** -0.5)
                for r0 in range(0, T, self.QUERY_CHUNK):  # bounds the [queries, entries] scores
                    r1 = min(T, r0 + self.QUERY_CHUNK)
                    sc = deepinfer_ops.mqa_logits(iq[r0:r1], iw[r0:r1].contiguous(), ikeys, n_ent,
                                                  block_table=bt32[r0:r1].contiguous(), k_end=k_end[r0:r1].contiguous())
                    visible = torch.arange(n_ent, device=dev).view(1, -1) < n_vis[r0:r1].view(-1, 1)
                    ids, ties = indexer_topk(sc, visible, idx.topk)
                    self.last_indexer_boundary_ties += ties
                    ent[r0:r1, :ids.shape[1]] = ids
                # entry order (-1 last) so the keys are summed in the same order for any chunking or batch
                ent = torch.where(ent >= 0, ent, n_ent).sort(dim=1).values
                ec = ent.clamp(max=n_ent - 1)
                comp_idx = torch.where(ent < n_ent, tok_bt.gather(1, ec // per_block) * per_block + ec % per_block,
                                       -1).to(torch.int32)
        # 3. sparse MQA over both lists (K = V, one shared head), the per-head sink in the denominator
        out, _ = deepinfer_ops.sparse_mqa_prefill(
            q.to(kv_cache.dtype).contiguous(), kv_cache, win_idx, hd ** -0.5,
            extra_kv_cache=comp_cache, extra_indices=comp_idx, attn_sink=attn.attn_sink.float().contiguous())
        out = out.to(x.dtype)
        deepinfer_ops.rotary_embedding(out, positions, table, inverse=True)
        G = cfg.o_groups
        wa = attn.wo_a.weight.view(G, cfg.o_lora_rank, -1)
        if rows:  # one fixed-shape GEMM chain per group (the einsum below is a bmm whose kernel depends on T)
            per_group = out.view(T, G, -1).transpose(0, 1).contiguous()
            o = torch.stack([linear_rows(per_group[g], wa[g], rows) for g in range(G)], dim=1)
            return attn.wo_b(o.reshape(T, G * cfg.o_lora_rank), rows)
        grouped = out.view(T, G, -1)
        o = torch.einsum("tgi,goi->tgo", grouped, wa).reshape(T, G * cfg.o_lora_rank)
        return attn.wo_b(o)

    # ---- MoE -------------------------------------------------------------------------------------------------------
    def _route(self, moe: MoE, x: torch.Tensor, input_ids: torch.Tensor,
               rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Router: ``x [T, D]`` -> (weights ``[T, top_k]`` float32, expert ids ``[T, top_k]`` int64). Hash layers take
        ``tid2eid[input_ids]``; score-routed layers the top-k of ``score + bias`` by the tie rule (higher first, then
        lower expert id). Weights are the chosen unbiased scores, renormalised, times ``routed_scaling_factor``."""
        cfg = self.config
        logits = linear_rows(x, moe.gate.weight, rows).float()
        if cfg.scoring_func == "sqrtsoftplus":
            scores = pointwise(F.softplus, logits, rows).sqrt()
        elif cfg.scoring_func == "sigmoid":
            scores = pointwise(torch.sigmoid, logits, rows)
        else:
            scores = torch.softmax(logits, dim=-1)
        if moe.gate.hashed:
            indices = moe.gate.tid2eid[input_ids].long()
        else:
            _, indices = deepinfer_ops.topk(scores + moe.gate.bias.float(), cfg.num_experts_per_tok)
        weights = scores.gather(1, indices)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * cfg.routed_scaling_factor
        return weights, indices

    def _moe(self, moe: MoE, x: torch.Tensor, input_ids: torch.Tensor, rows: int = 0,
             num_tokens: int | None = None) -> torch.Tensor:
        """Routed experts + shared expert. The combine is in a fixed order in both modes: a token's expert outputs
        are added to it in ascending expert id (one ``index_add_`` per expert, each token at most once per call, so
        no atomics race), then the shared expert. ``rows > 0``: every expert GEMM runs in fixed-shape chunks."""
        cfg = self.config
        weights, indices = self._route(moe, x, input_ids, rows)
        if num_tokens is not None:  # batch-invariant mode: rows past num_tokens are padding, never dispatched
            weights, indices = weights[:num_tokens], indices[:num_tokens]
        y = torch.zeros_like(x)
        limit = cfg.swiglu_limit
        for e in torch.unique(indices).tolist():
            tok, slot = torch.where(indices == e)
            if rows:  # gather straight into a buffer of whole GEMM chunks (the expert then copies nothing)
                xe = pad_rows_buffer(x, tok.shape[0], rows)
                torch.index_select(x, 0, tok, out=xe[:tok.shape[0]])
                h = moe.experts[e](xe, limit, rows)[:tok.shape[0]]
            else:
                h = moe.experts[e](x[tok], limit, rows)
            h = h * weights[tok, slot, None].to(x.dtype)
            y.index_add_(0, tok, h)
        return y + moe.shared_experts(x, limit, rows)

    # ---- blocks -----------------------------------------------------------------------------------------------------
    def _block(self, blk: Block, streams: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
               seqs: list[_Seq], pools: dict[str, torch.Tensor], rows: int = 0) -> torch.Tensor:
        post, comb, collapsed = self._hc_pre(streams, blk.hc_attn_fn, blk.hc_attn_base, blk.hc_attn_scale, rows)
        a = self._attention(blk.attn, blk.attn_norm(collapsed), positions, seqs, pools, rows)
        streams = self._hc_post(streams, a, post, comb, rows)
        post, comb, collapsed = self._hc_pre(streams, blk.hc_ffn_fn, blk.hc_ffn_base, blk.hc_ffn_scale, rows)
        f = self._moe(blk.ffn, blk.ffn_norm(collapsed), input_ids, rows, seqs[-1].b if rows else None)
        return self._hc_post(streams, f, post, comb, rows)

    # ---- public forward --------------------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, batch: ForwardBatch, cache: DeepseekV4Cache, return_hidden: bool = False):
        """One engine step.

        Args:
            batch: the step (see ``deepinfer/forward_batch.py``); sequence i's tokens are positions
                ``context_lens[i] - query_lens[i] .. context_lens[i] - 1`` and its cache lives in the blocks of
                ``block_tables[i]`` (``ceil(context_lens[i] / 128)`` valid ids needed).
            cache: from :func:`allocate_cache` for this config; mutated (the new tokens' entries are written).
            return_hidden: also return the final mHC streams ``[num_tokens, hc_mult, hidden]`` (MTP input).
        Returns:
            logits ``[num_logits, vocab]`` float32 for ``batch.logits_indices`` (and the streams if asked).
        Raises:
            ValueError naming the ForwardBatch field at fault (shapes, positions, block ids).
        """
        seqs = _check_batch(batch, cache)
        if max(batch.context_lens, default=0) > self.config.max_position_embeddings:
            raise ValueError(f"context_lens: {max(batch.context_lens)} exceeds max_position_embeddings="
                             f"{self.config.max_position_embeddings}")
        self._block_size = cache.block_size
        self.last_indexer_boundary_ties = 0
        cfg = self.config
        dev = self.embed.weight.device
        if batch.num_tokens == 0:  # an empty step: nothing to write, no logits
            logits = torch.empty(0, cfg.vocab_size, dtype=torch.float32, device=dev)
            streams = torch.empty(0, cfg.hc_mult, cfg.hidden_size, dtype=self.dtype, device=dev)
            return (logits, streams) if return_hidden else logits
        rows = self.batch_invariant_rows(dev) if batch.batch_invariant else 0
        T = batch.num_tokens
        # batch-invariant mode: the token dimension is zero-padded to whole GEMM chunks for the whole step (token 0
        # at position 0); the padding rows are never attended to, routed, cached or returned
        ids = pad_rows(batch.input_ids.long(), rows)
        positions = pad_rows(batch.positions.long(), rows)
        emb = self.embed(ids)
        streams = emb.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        for i, blk in enumerate(self.layers):
            streams = self._block(blk, streams, ids, positions, seqs, cache.layers[i], rows)
        streams = streams[:T]
        li = batch.logits_indices.long()
        sel = streams[li]
        x = self.norm(self._hc_head(sel, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, rows))
        logits = self.head(x, rows).float()
        return (logits, streams) if return_hidden else logits

    @torch.no_grad()
    def forward_mtp(self, batch: ForwardBatch, cache: DeepseekV4Cache, hidden_streams: torch.Tensor, mtp_idx: int = 0,
                    return_hidden: bool = False):
        """Run MTP layer ``mtp_idx``: token at row r of ``batch`` is the NEXT token ``t+1`` of the main model's
        position ``t = batch.positions[r]``, ``hidden_streams[r]`` the main model's final mHC streams at ``t``
        (``forward(..., return_hidden=True)``). Uses cache layer ``num_hidden_layers + mtp_idx``.
        Returns logits ``[num_logits, vocab]`` float32 (the prediction of token ``t+2``), and with ``return_hidden``
        the MTP block's output streams ``[num_tokens, hc_mult, hidden]`` (the next draft step's ``hidden_streams``).
        Source: the public V4 MTP ports (sglang ``deepseek_v4_nextn``, vLLM ``deepseek_v4_mtp``): e_proj on the
        embedding broadcast over the streams, h_proj per stream; transformers 5.23 does not implement MTP."""
        if not 0 <= mtp_idx < len(self.mtp):
            raise ValueError(f"mtp_idx: {mtp_idx} outside [0, {len(self.mtp)})")
        T = batch.num_tokens
        if tuple(hidden_streams.shape) != (T, self.config.hc_mult, self.config.hidden_size):
            raise ValueError(f"hidden_streams: expected {(T, self.config.hc_mult, self.config.hidden_size)}, "
                             f"got {tuple(hidden_streams.shape)}")
        seqs = _check_batch(batch, cache)
        self._block_size = cache.block_size
        cfg = self.config
        if T == 0:
            logits = torch.empty(0, cfg.vocab_size, dtype=torch.float32, device=hidden_streams.device)
            return (logits, hidden_streams[:0].to(self.dtype)) if return_hidden else logits
        blk = self.mtp[mtp_idx]
        rows = self.batch_invariant_rows(hidden_streams.device) if batch.batch_invariant else 0
        ids = pad_rows(batch.input_ids.long(), rows)  # batch-invariant mode: whole GEMM chunks, see forward
        positions = pad_rows(batch.positions.long(), rows)
        e = blk.e_proj(blk.enorm(self.embed(ids)), rows)
        h = blk.h_proj(blk.hnorm(pad_rows(hidden_streams.to(self.dtype).contiguous(), rows)), rows)
        streams = e.unsqueeze(1) + h
        streams = self._block(blk, streams, ids, positions, seqs,
                              cache.layers[self.config.num_hidden_layers + mtp_idx], rows)[:T]
        sel = streams[batch.logits_indices.long()]
        x = blk.norm(self._hc_head(sel, blk.hc_head_fn, blk.hc_head_base, blk.hc_head_scale, rows))
        logits = self.head(x, rows).float()
        return (logits, streams) if return_hidden else logits

    @torch.no_grad()
    def forward_full(self, input_ids: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
        """Whole-sequence forward with a temporary cache: ``input_ids [S]`` or ``[B, S]`` -> logits ``[S, vocab]`` or
        ``[B, S, vocab]`` float32 (every position). Same code path as :meth:`forward` (``batch_invariant``: see
        ``ForwardBatch``)."""
        squeeze = input_ids.dim() == 1
        ids = input_ids.view(1, -1) if squeeze else input_ids
        Bsz, S = ids.shape
        if S == 0:
            raise ValueError("input_ids: empty sequence")
        nb = (S + BLOCK_SIZE - 1) // BLOCK_SIZE
        cache = self.allocate_cache(Bsz * nb, ids.device)
        batch = ForwardBatch(
            input_ids=ids.reshape(-1),
            positions=torch.arange(S, device=ids.device).repeat(Bsz),
            query_lens=[S] * Bsz,
            context_lens=[S] * Bsz,
            block_tables=torch.arange(Bsz * nb, dtype=torch.int32, device=ids.device).view(Bsz, nb),
            logits_indices=torch.arange(Bsz * S, device=ids.device),
            batch_invariant=batch_invariant,
        )
        logits = self.forward(batch, cache)
        return logits.view(S, -1) if squeeze else logits.view(Bsz, S, -1)
