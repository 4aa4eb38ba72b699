"""DeepSeek-V4 (V4-Flash architecture) forward pass over a paged cache.

Interface (for the engine and the checkpoint code):

* :class:`DeepseekV4Config` (``config.py``) -- ``DeepseekV4Config.from_dict(config_json)`` / ``from_json_file(dir)``;
  ``TINY_CONFIG`` the built-in preset.
* ``expected_parameters(config) -> {native name: (shape, kind)}`` and ``init_parameters(config, seed)``
  (``params.py``); a freshly built :class:`DeepseekV4ForCausalLM` ``.state_dict()`` has exactly these names, so
  ``model.load_native(tensors)`` loads a native checkpoint 1:1 (after an FP8 load the names change, see below).
* ``DeepseekV4ForCausalLM(config, dtype, gemm="auto")``: the GEMM path / weight format (see "GEMM paths").
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

GEMM paths (``gemm``, chosen when the model is built, resolved when its weights are loaded; ``model.gemm`` is the
path in use):

* ``"fp8"`` -- DeepSeek's own inference recipe. Every ``dense_linear`` and ``expert_linear`` weight (see
  ``params.py``) is held as float8_e4m3fn ``[out, in]`` with float32 128x128 block scales (``<module>.scale``
  ``[ceil(out/128), ceil(in/128)]``): FP8 checkpoint weights with 128x128 blocks as stored (UE8M0 scales become
  float32, exactly), FP4 routed experts converted once by :func:`deepinfer_ops.fp4_to_fp8_blockscaled` (exact while
  a block's per-32 exponents lie within 14 binades, see ``deepinfer_ops/moe.py``), anything else (unquantised
  weights, other block sizes, FP4 with float32 scales) quantised at load to FP8 with ``amax / 448`` block scales. A
  linear runs :func:`fp8_linear`: ``per_token_group_quant_fp8(x, 128)`` (1x128 activation scales) then
  ``fp8_gemm_nt`` (float32 accumulation, output in the activation dtype: bf16 on CUDA). The routed experts of a MoE
  layer are stacked once at load into ``ffn.w13 [E, 2I', hidden]`` (gate rows ``[:I]``, up rows ``[I':I'+I]``) and
  ``ffn.w2 [E, hidden, I']`` with ``ffn.w13_scale`` / ``ffn.w2_scale`` (``I'`` = ``I`` rounded up to 128 with zero
  rows / columns, so the gate and up halves keep their own block scales; exact: the padded SwiGLU columns are 0)
  and run :func:`deepinfer_ops.fused_moe_fp8` (permute by expert, grouped gate/up GEMM, clamped SwiGLU fused with
  the FP8 re-quantisation, grouped down GEMM, weighted combine in slot order). The shared expert runs its three
  FP8 linears with the same fused SwiGLU + quantisation; ``wo_a``'s groups run as one masked grouped FP8 GEMM (it
  stays dequantised in a config whose groups straddle 128-row scale blocks). ``"other"`` weights (embedding, router ``gate``,
  compressor / indexer BF16 projections, LM head) stay in their dtype on torch GEMMs; the float32 mHC mixes run in
  :func:`deepinfer_ops.hc_mix`.
  Error vs ``"dequant"``: the activation quantisation (e4m3 has 3 mantissa bits) plus bf16 rounding of the expert
  GEMM outputs: on the tiny model, logits ``calc_diff`` <= 4.2e-3 (7e-4 .. 1.1e-3 over the rows routed alike;
  routing flips in <= 11 % of the rows), stated bounds in tests/engine/fp8_check.py.
* ``"dequant"`` -- every quantised weight dequantised exactly at load to ``dtype``; plain torch GEMMs
  (``F.linear``) and a per-expert loop. The transformers-parity path (CPU tests) and the reference for ``"fp8"``.
* ``"auto"`` (default) -- ``"fp8"`` when the weights are loaded onto a CUDA device, ``"dequant"`` elsewhere (the
  CPU FP8 ops are reference implementations: correct, row by row, slow). The CPU runs ``"fp8"`` when asked.

No dequantised copy is ever held next to an FP8 one: an FP8 load keeps only the FP8 bytes and scales (the stacked
expert tensors are filled expert by expert), a dequant load only the dequantised weights.

Batch-invariant mode (``ForwardBatch.batch_invariant``, set by ``LLM(batch_invariant=True)`` / ``--batch-invariant``;
an explicit per-step argument, no global state): every token's row is computed with a reduction order that depends
neither on the number of tokens in the step nor on the other sequences, nor on how its prompt was chunked:

* FP8 GEMMs (path ``"fp8"``: every dense linear, ``wo_a``'s groups, shared and routed experts) are batch-invariant
  by construction and run unpadded, as in the default mode: the activation quantisation is per row (one scale per
  1x128 group of that row), the CUDA dense GEMM is one CUTLASS kernel with one fixed 128x128x128 tile, no split-K
  (``split_k=1``) and data-parallel output tiles, each computed over all of K in one fixed order; the grouped GEMMs
  likewise (a row's tile depends on its expert's rows only through which rows share the tile, not its arithmetic);
  the fused SwiGLU quantises row by row; the MoE combine adds a token's ``top_k`` slots in slot order in float32;
  the CPU implementations compute every output element on its own in a fixed order.
* The remaining torch GEMMs (router ``gate``, compressor / indexer BF16 projections, LM head, and on path
  ``"dequant"`` every linear, ``wo_a``'s groups and the experts): every ``torch.mm`` has exactly
  :meth:`batch_invariant_rows` rows (path ``"fp8"`` on CUDA 512, path ``"dequant"`` on CUDA 128, the CPU 16; the
  LM head 128 on CUDA on either path; :func:`linear_rows`): cuBLAS picks tiles / split-K by M, MKL takes other code
  paths for small M, so a fixed shape is the only way to get one kernel for every row. Path ``"dequant"`` zero-pads
  the token dimension once per step to whole chunks (every GEMM then takes them without a copy; experts pad their
  gathered tokens the same way); path ``"fp8"`` does not pad the step (its FP8 GEMMs would only do the extra rows'
  work) and :func:`linear_rows` copies just the last partial chunk of each input.
* Attention: ``sparse_mqa_prefill`` computes every query row on its own from its own index lists (window by
  position, entries by id, -1 padding; the kernels are batch-invariant by construction); the indexer's
  ``mqa_logits`` and top-k are row-wise too (masked candidates score -inf, the tie rule fixes the selection) and the
  selected entries are passed in entry order. Padding rows get no entries (output 0).
* Compressor pooling: :func:`deepinfer_ops.compressor_pool` pools each window on its own over its slots in slot
  order (float32). mHC: the ops ``hc_mix`` / ``hc_weights`` / ``hc_collapse`` / ``hc_post`` compute each token on
  its own in a fixed order. Both are used in either mode.
  Router weights: the renormalisation sum is explicit adds in slot order.
* Norms: ``deepinfer_ops.rms_norm`` (one row per program); rotary: elementwise; router / indexer top-k: the tie
  rule; MoE combine: a token's experts added in ascending expert id (path ``"dequant"``, as in the default mode)
  or in slot order (path ``"fp8"``, ``fused_moe_fp8``, both modes).
* CPU only: transcendental elementwise ops go through :func:`pointwise` (torch's SIMD loops compute tails with
  scalar libm, so a value would depend on its position); the FP8 ops' CPU kernels use scalar libm everywhere.

Cost: path ``"fp8"``: one ``torch.mm`` launch per 512 tokens for each remaining torch GEMM (small N: router,
compressor / indexer projections; the LM head per 128 logits rows) and a copy of each input's last partial chunk;
the router's slot-order adds and the sampler's per-row filtered draws; the FP8 GEMMs, the MoE, attention, mHC and
the compressor pooling cost the same as with the mode off. Path ``"dequant"``: padded GEMM rows (free while a GEMM
is bandwidth-bound on its weight, i.e. a decode step of <= 128 tokens on the GPU) and one GEMM launch per 128 tokens
for every GEMM in prefill.

Source: transformers 5.23 ``modeling_deepseek_v4.py`` (the parity reference, read, not imported); DeepSeek-V4
paper.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import deepinfer_ops
from deepinfer.batch_invariant import pointwise
from deepinfer.forward_batch import ForwardBatch, index_tensors

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
    Cost: ``ceil(M / rows)`` GEMM launches instead of one and up to ``rows - 1`` padded rows (copied: a copy of the
    last partial chunk, or of all of ``x`` when it is not contiguous / aligned / 16-wide); with ``rows`` = 128 on
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
    # whole chunks are read in place when x is laid out like a fresh allocation (every chunk start then keeps the
    # base alignment, as rows * kp * itemsize is a multiple of 256 for rows >= 8, and of 64 for any rows); the last
    # partial chunk (or everything, for another layout) goes through a fresh zero-padded copy of the same shape
    in_place = kp == k and x2.is_contiguous() and x2.data_ptr() % align == 0
    full = m // rows if in_place else 0
    if not in_place:
        xp = x2.new_zeros(chunks * rows, kp)
        xp[:m, :k] = x2
        x2 = xp
        full = chunks
    out = x2.new_empty(chunks * rows, np_)
    wt = weight.t()
    for c in range(full):
        torch.mm(x2[c * rows:(c + 1) * rows], wt, out=out[c * rows:(c + 1) * rows])
    if full < chunks:  # padding rows: uninitialised on CUDA (a GEMM row depends on its own row only; dropped),
        #                zeros on the CPU (no slow denormal arithmetic), as in pad_rows_buffer
        tail = x2.new_empty(rows, kp) if x2.is_cuda else x2.new_zeros(rows, kp)
        tail[:m - full * rows] = x2[full * rows:]
        torch.mm(tail, wt, out=out[full * rows:])
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


FP8_BLOCK = 128  # block of the FP8 weight scales (128 x 128) and group of the activation scales (1 x 128)
GEMM_PATHS = ("auto", "fp8", "dequant")


def resolve_gemm(gemm: str, device: torch.device | str | None) -> str:
    """The GEMM path ``"fp8"`` or ``"dequant"`` for the requested ``gemm`` (``"auto"``: ``"fp8"`` on a CUDA
    ``device``, ``"dequant"`` elsewhere). Raises ValueError naming ``gemm`` for another value."""
    if gemm not in GEMM_PATHS:
        raise ValueError(f"gemm: expected one of {GEMM_PATHS}, got {gemm!r}")
    if gemm != "auto":
        return gemm
    return "fp8" if device is not None and torch.device(device).type == "cuda" else "dequant"


def _fp8_out_dtype(x: torch.Tensor) -> torch.dtype:
    return x.dtype if x.dtype in (torch.bfloat16, torch.float32) else torch.bfloat16


def quant_act_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (float8_e4m3fn ``[M, K]``, float32 ``[M, ceil(K/128)]`` 1x128 scales) in the layout the FP8
    GEMMs read on ``x``'s device (column-major scales on CUDA)."""
    return deepinfer_ops.per_token_group_quant_fp8(x.contiguous(), FP8_BLOCK, column_major_scales=x.is_cuda)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``y = x @ (weight * scale).T`` the DeepSeek-V3/V4 way: the activations quantised per 1x128 group
    (:func:`deepinfer_ops.per_token_group_quant_fp8`), then the FP8 block-scaled GEMM
    (:func:`deepinfer_ops.fp8_gemm_nt`, float32 accumulation, ``split_k=1``: batch-invariant).

    Args:
        x: ``[..., in]`` float32 / bfloat16 activations.
        weight: ``[out, in]`` float8_e4m3fn.
        scale: ``[ceil(out/128), ceil(in/128)]`` float32 block scales.
    Returns:
        ``[..., out]`` in ``x.dtype`` (bfloat16 for other input dtypes).
    Raises:
        RuntimeError from the ops naming the tensor at fault (dtype, shape, CUDA alignment: in % 16, out % 8).
    """
    k, n = x.shape[-1], weight.shape[0]
    lead = x.shape[:-1]
    xq, xs = quant_act_fp8(x.reshape(-1, k))
    return deepinfer_ops.fp8_gemm_nt(xq, xs, weight, scale, out_dtype=_fp8_out_dtype(x)).view(*lead, n)


def fp8_block_weight(t, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One linear weight as FP8 e4m3 with float32 128x128 block scales, on ``device`` (default: where it is).

    Args:
        t: a ``deepinfer.checkpoint.QuantizedWeight`` (``"fp8"`` with 128x128 blocks: kept as stored, UE8M0 scales
            converted to float32 exactly; ``"fp4"`` with UE8M0 scales: :func:`deepinfer_ops.fp4_to_fp8_blockscaled`;
            other block sizes / float32 FP4 scales: dequantised, then quantised as below) or a float ``[out, in]``
            tensor (quantised: scale ``amax / 448`` per block, round to nearest even, see
            ``deepinfer.quantization.quantize_fp8_block``).
    Returns:
        (``[out, in]`` float8_e4m3fn contiguous, ``[ceil(out/128), ceil(in/128)]`` float32 contiguous).
    Raises:
        ValueError for non-finite float weights.
    """
    from deepinfer import quantization as Q
    from deepinfer.checkpoint import QuantizedWeight

    if isinstance(t, QuantizedWeight):
        dev = device if device is not None else t.data.device
        if t.fmt == "fp8" and tuple(t.block) == (FP8_BLOCK, FP8_BLOCK):  # UE8M0 -> float32 where the scale is
            return t.data.to(dev).contiguous(), Q.scale_to_float(t.scale).to(dev).contiguous()
        if t.fmt == "fp4" and t.scale.dtype != torch.float32:
            return deepinfer_ops.fp4_to_fp8_blockscaled(t.data.to(dev).contiguous(),
                                                        t.scale.view(torch.uint8).to(dev).contiguous())
        t = t.dequantize()
    w = t.detach().to(device=device if device is not None else t.device)
    with torch.device(w.device):
        q, s = Q.quantize_fp8_block(w, (FP8_BLOCK, FP8_BLOCK), scale_fmt="float")
    return q.contiguous(), s.contiguous()


class Linear(nn.Module):
    """``y = x @ weight.T``. Two weight formats (chosen at load, see the module docstring's GEMM paths):

    * dequantised: ``weight [out, in]`` in the model dtype, ``scale`` None; ``forward(x, rows)`` =
      :func:`linear_rows` (``rows > 0``: fixed-shape, batch-invariant GEMM chunks);
    * FP8: ``weight [out, in]`` float8_e4m3fn and ``scale [ceil(out/128), ceil(in/128)]`` float32 block scales;
      ``forward`` = :func:`fp8_linear` (batch-invariant by construction: ``rows`` is ignored).
    """

    def __init__(self, out_features: int, in_features: int, dtype: torch.dtype):
        super().__init__()
        self.weight = _param(out_features, in_features, dtype=dtype)
        self.register_parameter("scale", None)

    @property
    def is_fp8(self) -> bool:
        return self.scale is not None

    def set_fp8(self, weight: torch.Tensor, scale: torch.Tensor) -> None:
        """Hold ``weight`` (float8_e4m3fn ``[out, in]``) and its float32 block ``scale`` (taken over, not copied)."""
        out, inp = self.weight.shape
        want = (-(-out // FP8_BLOCK), -(-inp // FP8_BLOCK))
        if weight.dtype != torch.float8_e4m3fn or tuple(weight.shape) != (out, inp):
            raise ValueError(f"Linear.set_fp8: weight must be float8_e4m3fn {[out, inp]}, got {weight.dtype} "
                             f"{list(weight.shape)}")
        if scale.dtype != torch.float32 or tuple(scale.shape) != want:
            raise ValueError(f"Linear.set_fp8: scale must be float32 {list(want)}, got {scale.dtype} "
                             f"{list(scale.shape)}")
        self._parameters["weight"] = nn.Parameter(weight, requires_grad=False)
        self._parameters["scale"] = nn.Parameter(scale, requires_grad=False)

    def fp8_rows(self, r0: int, r1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Output rows ``[r0, r1)`` of an FP8 weight as a block-scaled weight of its own: (``weight[r0:r1]``, its
        ``[ceil((r1-r0)/128), ceil(in/128)]`` scales). Needs ``r0 % 128 == 0`` or the rows inside one 128-row block
        (else ValueError: their blocks straddle the stored ones)."""
        b0 = r0 // FP8_BLOCK
        if r0 % FP8_BLOCK and b0 != (r1 - 1) // FP8_BLOCK:
            raise ValueError(f"Linear.fp8_rows: rows [{r0}, {r1}) straddle the 128-row scale blocks")
        return self.weight[r0:r1], self.scale[b0:b0 + -(-(r1 - r0) // FP8_BLOCK)]

    def fp8_groups(self, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
        """An FP8 weight as ``groups`` equal row blocks, the B operand of a grouped GEMM: (``[groups, out / groups,
        in]`` view of the weight, ``[groups, ceil(out / groups / 128), ceil(in/128)]`` scales: a view when a block
        is whole 128-row scale blocks, else each block's scale rows gathered, see :meth:`fp8_rows`)."""
        r = self.weight.shape[0] // groups
        w = self.weight.view(groups, r, -1)
        if r % FP8_BLOCK == 0:
            return w, self.scale.reshape(groups, r // FP8_BLOCK, -1)
        return w, torch.stack([self.fp8_rows(g * r, (g + 1) * r)[1] for g in range(groups)])

    def forward(self, x: torch.Tensor, rows: int = 0) -> torch.Tensor:
        if self.scale is not None:
            return fp8_linear(x, self.weight, self.scale)
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
        """``w2(silu(min(w1 x, limit)) * clamp(w3 x, -limit, limit))`` for ``x [M, dim]``. FP8 weights: ``x`` is
        quantised once, the gate / up GEMMs write one ``[M, 2 inter]`` tensor, the clamped SwiGLU is fused with the
        re-quantisation for ``w2`` (:func:`deepinfer_ops.swiglu_clamp_quant_fp8`, the routed experts' recipe)."""
        if self.w1.is_fp8:
            xq, xs = quant_act_fp8(x)
            dt = _fp8_out_dtype(x)
            inter = self.w1.weight.shape[0]
            gate_up = torch.empty(x.shape[0], 2 * inter, dtype=dt, device=x.device)  # each GEMM writes its half
            deepinfer_ops.fp8_gemm_nt(xq, xs, self.w1.weight, self.w1.scale, out=gate_up[:, :inter])
            deepinfer_ops.fp8_gemm_nt(xq, xs, self.w3.weight, self.w3.scale, out=gate_up[:, inter:])
            hq, hs = deepinfer_ops.swiglu_clamp_quant_fp8(gate_up, limit, column_major_scales=x.is_cuda)
            return deepinfer_ops.fp8_gemm_nt(hq, hs, self.w2.weight, self.w2.scale, out_dtype=dt)
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
    """Router ``gate``, routed ``experts`` (one :class:`Expert` each: path ``"dequant"``) or their stacked FP8 form
    ``w13 [E, 2I', hidden]``, ``w13_scale``, ``w2 [E, hidden, I']``, ``w2_scale`` (path ``"fp8"``, set by
    :meth:`set_fp8_experts`; ``experts`` is then empty), and the ``shared_experts``."""

    def __init__(self, cfg: DeepseekV4Config, mlp_type: str, dtype: torch.dtype):
        super().__init__()
        self.gate = Gate(cfg, mlp_type == HASH_MOE, dtype)
        self.experts = nn.ModuleList(
            Expert(cfg.hidden_size, cfg.moe_intermediate_size, dtype) for _ in range(cfg.n_routed_experts)
        )
        self.shared_experts = Expert(cfg.hidden_size, cfg.moe_intermediate_shared, dtype)
        for name in ("w13", "w13_scale", "w2", "w2_scale"):
            self.register_parameter(name, None)

    @property
    def is_fp8(self) -> bool:
        return self.w13 is not None

    def set_fp8_experts(self, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                        w2_scale: torch.Tensor) -> None:
        """Take over the stacked FP8 experts (layout of :func:`deepinfer_ops.fused_moe_fp8`) and drop the per-expert
        modules."""
        for name, t in (("w13", w13), ("w13_scale", w13_scale), ("w2", w2), ("w2_scale", w2_scale)):
            self._parameters[name] = nn.Parameter(t, requires_grad=False)
        self.experts = nn.ModuleList()


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
    """One sequence of a step: token rows ``[a, b)``, positions ``c0 .. L - 1``, its blocks (device tensor and the
    same ids as a Python list, for index arithmetic without device round trips)."""

    __slots__ = ("a", "b", "c0", "L", "blocks", "block_ids")

    def __init__(self, a: int, b: int, c0: int, L: int, blocks: torch.Tensor, block_ids: list[int]):
        self.a, self.b, self.c0, self.L, self.blocks, self.block_ids = a, b, c0, L, blocks, block_ids


class _Step:
    """The step's index tables, built once per forward (one host-to-device copy) and shared by every layer:
    ``tok_bt [rows, max_blocks]`` int64 (each token row's block table, -1 past its sequence's blocks and on padding
    rows), ``token_slots`` (the paged-cache slot of every real token's position), the sequences adding one token
    (``decode``) and their token rows (``decode_rows``)."""

    __slots__ = ("seqs", "tok_bt", "token_slots", "max_len", "decode", "decode_rows")

    def __init__(self, seqs: list[_Seq], positions: torch.Tensor, num_rows: int, block_size: int):
        self.seqs = seqs
        self.max_len = max(s.L for s in seqs)
        self.decode = [s for s in seqs if s.b - s.a == 1]
        dev = positions.device
        max_nb = max(len(s.block_ids) for s in seqs)
        seq_bt, starts, self.decode_rows = index_tensors(
            [[b for s in seqs for b in s.block_ids + [-1] * (max_nb - len(s.block_ids))], [s.a for s in seqs],
             [s.a for s in self.decode]], dev)
        seq_bt = seq_bt.view(len(seqs), max_nb)
        n = seqs[-1].b
        seq_of = torch.searchsorted(starts, torch.arange(n, device=dev), right=True) - 1  # each token's sequence
        self.tok_bt = torch.full((num_rows, max_nb), -1, dtype=torch.long, device=dev)
        self.tok_bt[:n] = seq_bt[seq_of]
        pos = positions[:n].long()
        self.token_slots = self.tok_bt[:n].gather(1, (pos // block_size).view(-1, 1)).view(-1) * block_size \
            + pos % block_size


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
    pos_cpu = pos.cpu()
    bt_cpu = bt.cpu().long()
    bt_dev = bt.to(device=cache.device, dtype=torch.long)
    # Faults are reported as a per-sequence loop would find them: the first faulty sequence, and for it its lengths,
    # then its positions, then its row width, then its block ids. The lengths are plain Python ints; positions and
    # block ids are checked for all the sequences before the first bad length at once.
    S, width = len(batch.query_lens), bt.shape[1]
    starts, c0s, nbs, a = [], [], [], 0
    bad_len = first_nb = S
    for i, (q, L) in enumerate(zip(batch.query_lens, batch.context_lens)):  # Python ints only
        if q < 1 or L < q:
            bad_len = i
            break
        nb = (L + B - 1) // B
        if nb > width and first_nb == S:
            first_nb = i
        starts.append(a)
        c0s.append(L - q)
        nbs.append(nb)
        a += q
    k = len(starts)  # sequences 0 .. k - 1 have valid lengths and own tokens 0 .. a - 1
    starts_t = torch.tensor(starts, dtype=torch.long)
    seq_of = torch.searchsorted(starts_t, torch.arange(a), right=True) - 1
    expect = torch.tensor(c0s, dtype=torch.long)[seq_of] + torch.arange(a) - starts_t[seq_of]
    bad_pos = (pos_cpu[:a] != expect).nonzero()  # exact: float positions are not truncated
    first_pos = int(seq_of[bad_pos[0, 0]]) if bad_pos.numel() else S
    used = torch.arange(width).view(1, -1) < torch.tensor(nbs, dtype=torch.long).view(-1, 1)
    bad_blk = (used & ((bt_cpu[:k] < 0) | (bt_cpu[:k] >= cache.num_blocks))).any(dim=1).nonzero()
    first_blk = int(bad_blk[0, 0]) if bad_blk.numel() else S
    i, kind = min((bad_len, 0), (first_pos, 1), (first_nb, 2), (first_blk, 3))
    if i < S:
        q, L = batch.query_lens[i], batch.context_lens[i]
        if kind == 0:
            raise ValueError(f"query_lens[{i}]={q} / context_lens[{i}]={L}: need 1 <= query_len <= context_len")
        if kind == 1:
            raise ValueError(f"positions: sequence {i} must hold {L - q}..{L - 1} "
                             "(context_len - query_len .. context_len - 1)")
        if kind == 2:
            raise ValueError(f"block_tables: sequence {i} needs {nbs[i]} blocks for {L} tokens, row has {width}")
        raise ValueError(f"block_tables: sequence {i} uses a block id outside [0, {cache.num_blocks}): "
                         f"{bt_cpu[i, :nbs[i]].tolist()}")
    rows = bt_cpu.tolist()
    seqs = [_Seq(starts[i], starts[i] + q, c0s[i], c0s[i] + q, bt_dev[i, :nbs[i]], rows[i][:nbs[i]])
            for i, q in enumerate(batch.query_lens)]
    li = batch.logits_indices
    if li.numel() and (int(li.min()) < 0 or int(li.max()) >= ids.shape[0]):
        raise ValueError(f"logits_indices: out of range [0, {ids.shape[0]})")
    return seqs


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
        gemm: ``"auto"`` (default), ``"fp8"`` or ``"dequant"``: the GEMM path / weight format the weights take when
            loaded (module docstring, "GEMM paths"); ``"auto"`` is resolved on the device the weights are loaded to.
            ``model.gemm`` is the path in use (``"dequant"`` until an FP8 load).
    Raises:
        ValueError naming ``gemm`` for an unknown value.
    """

    QUERY_CHUNK = 512  # queries per lightning-indexer score chunk (bounds the [queries, entries] scores)
    # Batch-invariant mode (``ForwardBatch.batch_invariant``): rows per fixed-shape torch GEMM call (see
    # ``linear_rows``; the FP8 GEMMs of path "fp8" need none), per device type. The costs: up to rows - 1 padded GEMM
    # rows per call (about free while a call is bandwidth-bound on its weight, as decode steps are on the GPU) and one
    # launch per ``rows`` tokens. Path "fp8" on CUDA runs only the few small torch GEMMs (router, compressor / indexer
    # projections) in chunks, so they take 512 rows: an 8192-token prefill step is 16 launches per GEMM instead of 64
    # (the engine is host-bound there). Path "dequant" pads every expert's tokens too, so it keeps 128. The LM head
    # takes BI_GEMM_ROWS on either path (``_head_rows``): it only sees the step's logits rows (one per sequence), and
    # a 64-sequence decode step padded to 512 rows spent 0.7 ms in it on the H200 instead of the weight read's 0.3.
    BI_GEMM_ROWS = {"cuda": 128, "cpu": 16}
    BI_GEMM_ROWS_FP8 = {"cuda": 512}
    BI_GEMM_ROWS_DEFAULT = 128

    def __init__(self, config: DeepseekV4Config, dtype: torch.dtype = torch.float32, gemm: str = "auto"):
        super().__init__()
        cfg = self.config = config
        self.dtype = dtype
        resolve_gemm(gemm, None)  # validates
        self.requested_gemm = gemm
        self.gemm = "dequant"  # the path of the weights held now; load_native sets it
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
        # id(attention module) -> its concatenated compressor / indexer input projections (see _x_projections)
        self._fused_weights: dict[int, torch.Tensor] = {}
        self._block_size = BLOCK_SIZE  # set from the cache at each forward
        # diagnostics of the last forward: number of indexer rows whose k-th and (k+1)-th best valid scores tie
        self.last_indexer_boundary_ties = 0

    # ---- construction helpers ---------------------------------------------------------------------------------
    @classmethod
    def from_parameters(cls, config: DeepseekV4Config, tensors: dict, dtype: torch.dtype = torch.float32,
                        gemm: str = "auto", device: torch.device | str | None = None) -> "DeepseekV4ForCausalLM":
        """Build and load ``tensors`` (native names; float tensors or ``deepinfer.checkpoint.QuantizedWeight``)
        strictly: every expected name, no extra. The model is built on the meta device and takes the tensors over
        (see :meth:`load_native`: cast / converted to its format where needed, on ``device`` or where they are), so
        no second copy of the weights is ever allocated."""
        with torch.device("meta"):
            model = cls(config, dtype, gemm)
        model.load_native(tensors, device=device)
        return model

    @classmethod
    def from_checkpoint(cls, path=None, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                        gemm: str = "auto") -> "DeepseekV4ForCausalLM":
        """Load a native checkpoint folder (``None`` = the built-in tiny one) with :mod:`deepinfer.checkpoint` onto
        ``device``. Path ``"dequant"``: quantised weights dequantised exactly, then cast to ``dtype``; path ``"fp8"``
        (``gemm="auto"`` on CUDA): read in their stored format and converted on ``device`` (module docstring).
        Raises CheckpointError naming the tensor/file."""
        from deepinfer.checkpoint import load_checkpoint

        if resolve_gemm(gemm, device) == "fp8":
            ckpt = load_checkpoint(path, dequantize=False, dtype=dtype, device="cpu")
            return cls.from_parameters(ckpt.config, ckpt.params, dtype, "fp8", device=device)
        ckpt = load_checkpoint(path, dtype=dtype, device=device)
        return cls.from_parameters(ckpt.config, ckpt.params, dtype, "dequant").to(device)

    def load_native(self, tensors: dict, device: torch.device | str | None = None) -> None:
        """Take over native tensors as the parameters of a freshly built model.

        Args:
            tensors: every name of ``expected_parameters(config)`` (strict: missing / unexpected names and shape
                mismatches raise ValueError naming the tensor); values are float tensors or, for quantised linears,
                ``deepinfer.checkpoint.QuantizedWeight`` (logical shape checked).
            device: where the parameters go (default: where each tensor is; ``"auto"`` resolves on the device of
                ``embed.weight``).
        Path ``"dequant"``: quantised weights are dequantised exactly, integer ``tid2eid`` becomes int64,
        float32-kind tensors stay float32, the rest is cast to the model dtype. Path ``"fp8"``: every
        ``dense_linear`` / ``expert_linear`` weight becomes FP8 with float32 128x128 block scales
        (:func:`fp8_block_weight`), the routed experts of each MoE stacked (:meth:`MoE.set_fp8_experts`), the other
        tensors as in path ``"dequant"``. ``wo_a`` stays dequantised when its groups straddle 128-row scale blocks.
        """
        from deepinfer.checkpoint import QuantizedWeight

        cfg = self.config
        spec = expected_parameters(cfg)
        missing = [k for k in spec if k not in tensors]
        extra = [k for k in tensors if k not in spec]
        if missing or extra:
            raise ValueError(f"load_native: missing tensors {missing[:8]}{'...' if len(missing) > 8 else ''}; "
                             f"unexpected tensors {extra[:8]}{'...' if len(extra) > 8 else ''}")
        for k, t in tensors.items():
            if tuple(t.shape) != tuple(spec[k][0]):
                raise ValueError(f"load_native: tensor {k} has shape {tuple(t.shape)}, expected {tuple(spec[k][0])}")
        if self.gemm == "fp8":
            raise ValueError("load_native: the model already holds FP8 weights; build a new model to load again")

        def where(t):
            return (t.data if isinstance(t, QuantizedWeight) else t).device

        dev = torch.device(device) if device is not None else None
        gemm = resolve_gemm(self.requested_gemm, dev if dev is not None else where(tensors["embed.weight"]))
        olr, G = cfg.o_lora_rank, cfg.o_groups
        wo_a_ok = all((g * olr) % FP8_BLOCK == 0 or (g * olr) // FP8_BLOCK == ((g + 1) * olr - 1) // FP8_BLOCK
                      for g in range(G))
        moes: dict[str, None] = {}  # MoE modules whose experts are stacked after the loop (insertion-ordered)
        for k, (_, kind) in spec.items():
            mod_name, _, leaf = k.rpartition(".")
            t = tensors[k]
            if gemm == "fp8" and kind == "expert_linear":
                moes[mod_name.split(".experts.")[0]] = None
                continue
            mod = self.get_submodule(mod_name) if mod_name else self
            if gemm == "fp8" and kind == "dense_linear" and (wo_a_ok or not k.endswith("attn.wo_a.weight")):
                mod.set_fp8(*fp8_block_weight(t, dev))
                continue
            if isinstance(t, QuantizedWeight):  # exact float32 where it is stored, then cast and moved
                t = t.dequantize()
            t = t.detach()
            if not t.is_floating_point():
                t = t.to(device=dev, dtype=torch.int64)
            else:
                t = t.to(device=dev, dtype=torch.float32 if kind == "fp32" else self.dtype)
            if leaf in mod._parameters:
                mod._parameters[leaf] = nn.Parameter(t, requires_grad=False)
            else:
                mod._buffers[leaf] = t
        for moe_name in moes:
            self._load_fp8_experts(self.get_submodule(moe_name), moe_name, tensors, dev)
        self.gemm = gemm

    def _load_fp8_experts(self, moe: MoE, prefix: str, tensors: dict, dev: torch.device | None) -> None:
        """Stack the routed experts ``{prefix}.experts.E.w{1,2,3}.weight`` into FP8 ``w13`` / ``w2`` (+ scales),
        filled expert by expert (no second copy of the experts). ``I`` is padded to ``I'`` = a multiple of 128 with
        zero rows (``w13``) / columns (``w2``) so that the gate and up halves keep their own scale blocks; padded
        gate / up outputs are 0, their SwiGLU is 0 and meets zero ``w2`` columns: the result is unchanged."""
        cfg = self.config
        E, I, D = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
        nb_i = -(-I // FP8_BLOCK)
        Ip, kb_d = nb_i * FP8_BLOCK, -(-D // FP8_BLOCK)
        from deepinfer.checkpoint import QuantizedWeight

        first = tensors[f"{prefix}.experts.0.w1.weight"]
        d = dev if dev is not None else (first.data if isinstance(first, QuantizedWeight) else first).device
        # FP8 bytes handled as uint8 (zero byte = +0.0 in e4m3): plain fills and copies on every backend
        w13 = torch.zeros(E, 2 * Ip, D, dtype=torch.uint8, device=d)
        w13_scale = torch.ones(E, 2 * nb_i, kb_d, dtype=torch.float32, device=d)
        w2 = torch.zeros(E, D, Ip, dtype=torch.uint8, device=d)
        w2_scale = torch.ones(E, kb_d, nb_i, dtype=torch.float32, device=d)
        for e in range(E):
            name = f"{prefix}.experts.{e}."
            q, s = fp8_block_weight(tensors[name + "w1.weight"], d)
            w13[e, :I], w13_scale[e, :nb_i] = q.view(torch.uint8), s
            q, s = fp8_block_weight(tensors[name + "w3.weight"], d)
            w13[e, Ip:Ip + I], w13_scale[e, nb_i:] = q.view(torch.uint8), s
            q, s = fp8_block_weight(tensors[name + "w2.weight"], d)
            w2[e, :, :I], w2_scale[e] = q.view(torch.uint8), s
        moe.set_fp8_experts(w13.view(torch.float8_e4m3fn), w13_scale, w2.view(torch.float8_e4m3fn), w2_scale)

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
        """Rows per fixed-shape GEMM call in batch-invariant mode on ``device`` for the model's GEMM path."""
        kind = torch.device(device).type
        if self.gemm == "fp8" and kind in self.BI_GEMM_ROWS_FP8:
            return self.BI_GEMM_ROWS_FP8[kind]
        return self.BI_GEMM_ROWS.get(kind, self.BI_GEMM_ROWS_DEFAULT)

    def _hc_pre(self, streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor):
        """streams ``[T, hc, D]`` -> (post ``[T, hc]``, comb ``[T, hc, hc]`` float32, collapsed ``[T, D]``): the mixing
        coefficients from :func:`deepinfer_ops.hc_mix` (RMS norm of the concatenated streams fused with the
        projection on ``fn``), the gates and the Sinkhorn-normalised mix from :func:`deepinfer_ops.hc_weights`, the
        sublayer input from :func:`deepinfer_ops.hc_collapse` (each per token in a fixed order, in either mode)."""
        cfg = self.config
        hc = cfg.hc_mult
        T = streams.shape[0]
        mix = deepinfer_ops.hc_mix(streams.view(T, hc * streams.shape[2]), fn.float().contiguous(), cfg.rms_norm_eps)
        pre, post, comb = deepinfer_ops.hc_weights(mix, base.float().contiguous(), scale.float().contiguous(), hc,
                                                   cfg.hc_eps, cfg.hc_sinkhorn_iters)
        return post, comb, deepinfer_ops.hc_collapse(streams, pre)

    @staticmethod
    def _hc_post(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """``new[:, j] = post[:, j] * out + sum_i comb[:, i, j] * streams[:, i]`` (:func:`deepinfer_ops.hc_post`:
        float32 in stream order per token, any mode)."""
        return deepinfer_ops.hc_post(streams, out.contiguous(), post, comb)

    def _hc_head(self, streams: torch.Tensor, fn, base, scale, rows: int = 0) -> torch.Tensor:
        """The final streams ``[T, hc, D]`` collapsed to ``[T, D]`` with the head's mHC parameters."""
        T = streams.shape[0]
        mixes = deepinfer_ops.hc_mix(streams.reshape(T, streams.shape[1] * streams.shape[2]), fn.float().contiguous(),
                                     self.config.rms_norm_eps)
        pre = pointwise(torch.sigmoid, mixes * scale.float() + base.float(), rows) + self.config.hc_eps
        return deepinfer_ops.hc_collapse(streams.contiguous(), pre.contiguous())

    # ---- compressor -------------------------------------------------------------------------------------------
    def _pool_windows(self, comp: Compressor, cur_kv: torch.Tensor, cur_gate: torch.Tensor,
                      prev_kv: torch.Tensor | None, prev_gate: torch.Tensor | None, prev_at) -> torch.Tensor:
        """Compressed entries ``[n, hd]`` of ``n`` windows closing in this step.

        ``cur_kv`` / ``cur_gate``: ``[n, m, coff * hd]`` projections of each window's own ``m`` positions (as stored:
        ``ape`` not added). CSA (``overlap``): a window's slots are the ``Ca`` half of window ``w - 1`` (``prev_kv`` /
        ``prev_gate [k, m, coff * hd]`` for the windows ``prev_at`` selects; window 0 and any window not selected keeps
        -inf gates there, i.e. weight 0) followed by the ``Cb`` half of its own. Pooling: the softmax over the slots
        of the float32 ``gate + ape`` and the gated sum (:func:`deepinfer_ops.compressor_pool`: each window on its
        own in slot order, float32, in either mode), then the compressor's RMS norm."""
        m, hd = comp.ratio, comp.head_dim
        ape = comp.ape.float()
        cur_gate = cur_gate.float() + ape
        if comp.overlap:
            n = cur_kv.shape[0]
            slot_kv = cur_kv.new_zeros(n, 2 * m, hd)
            slot_gate = cur_gate.new_full((n, 2 * m, hd), float("-inf"))
            slot_kv[:, m:] = cur_kv[..., hd:]
            slot_gate[:, m:] = cur_gate[..., hd:]
            if prev_kv is not None:
                slot_kv[prev_at, :m] = prev_kv[..., :hd]
                slot_gate[prev_at, :m] = (prev_gate.float() + ape)[..., :hd]
        else:
            slot_kv, slot_gate = cur_kv, cur_gate
        return comp.norm(deepinfer_ops.compressor_pool(slot_kv, slot_gate))

    def _compress_decode(self, comp: Compressor, kv_rows: torch.Tensor, gate_rows: torch.Tensor, seqs: list[_Seq],
                         pool_state_kv: torch.Tensor, pool_state_gate: torch.Tensor, pool_comp: torch.Tensor,
                         rope_table: torch.Tensor) -> None:
        """:meth:`_compress_seq` for sequences that add one token each (decode), batched over the sequences, with the
        same cache contents as a result. ``kv_rows`` / ``gate_rows``: ``[len(seqs), coff * hd]``, row i = sequence
        i's new token at position ``c0 = L - 1``.

        A sequence's ring (in the block of ``c0 - 1``) holds positions ``s0 .. c0 - 1`` of its open window(s). They
        are read only when a window closes (``L % m == 0``: pooled) or when the new token opens a new block (the
        state moves to that block's ring); otherwise the ring already holds them where the new state needs them and
        only the new token is written. All reads, the pooling of every closing window and all writes are a few
        batched ops, not ~20 per sequence."""
        m, overlap = comp.ratio, comp.overlap
        B = self._block_size
        R = pool_state_kv.shape[1]
        dev = kv_rows.device
        ring_src: list[int] = []  # ring slots read; `all` rows = [these, then the N new tokens]
        base: list[int] = []  # per sequence: the `all` row of position s0 (when its ring is read)
        s0s: list[int] = []
        moved: list[bool] = []
        for s in seqs:
            c0, L = s.c0, s.L
            s0 = max(0, (c0 // m) * m - m) if overlap else (c0 // m) * m
            mv = c0 > 0 and (c0 - 1) // B != c0 // B
            base.append(len(ring_src))
            if c0 > s0 and (L % m == 0 or mv):
                blk = s.block_ids[(c0 - 1) // B]
                ring_src.extend(blk * R + p_ % R for p_ in range(s0, c0))
            s0s.append(s0)
            moved.append(mv)
        n_ring = len(ring_src)

        def row(i: int, p_: int) -> int:  # the `all` row of sequence i's position p_ (s0 <= p_ <= c0)
            return n_ring + i if p_ == seqs[i].c0 else base[i] + p_ - s0s[i]

        # windows closing in this step: window w = L // m - 1 (positions w m .. c0; the last one is the new token)
        closing = [i for i, s in enumerate(seqs) if s.L % m == 0]
        ws = [seqs[i].L // m - 1 for i in closing]
        per_block = pool_comp.shape[1]
        prev = [(k, base[i] + (w - 1) * m - s0s[i]) for k, (i, w) in enumerate(zip(closing, ws)) if w >= 1] \
            if overlap else []
        # the state as of L (positions r0 .. L - 1) in the ring of the block holding L - 1: everything when the token
        # opened that block, else just the new token (the older positions are there already)
        src_rows, dst_slots = [], []
        for i, s in enumerate(seqs):
            c0, L = s.c0, s.L
            r0 = max(0, (L // m) * m - m) if overlap else (L // m) * m
            blk = s.block_ids[(L - 1) // B]
            for p_ in range(r0 if moved[i] else max(r0, c0), L):
                src_rows.append(row(i, p_))
                dst_slots.append(blk * R + p_ % R)
        # every index list of the call in one host-to-device copy
        (src, cur_first, cur_last, prev_at, prev_first, w_pos, dst, sr, ds) = index_tensors([
            ring_src, [base[i] + w * m - s0s[i] for i, w in zip(closing, ws)], [n_ring + i for i in closing],
            [k for k, _ in prev], [r for _, r in prev], [w * m for w in ws],
            [seqs[i].block_ids[w // per_block] * per_block + w % per_block for i, w in zip(closing, ws)],
            src_rows, dst_slots], dev)
        if n_ring:
            all_kv = torch.cat([pool_state_kv.view(-1, pool_state_kv.shape[-1])[src].to(kv_rows.dtype), kv_rows])
            all_gate = torch.cat([pool_state_gate.view(-1, pool_state_gate.shape[-1])[src].to(gate_rows.dtype),
                                  gate_rows])
        else:
            all_kv, all_gate = kv_rows, gate_rows
        if closing:
            ar = torch.arange(m, device=dev)
            cur = cur_first[:, None] + ar
            cur[:, -1] = cur_last
            prev_kv = prev_gate = None
            if prev:  # the Ca half of window w - 1 (all ring rows: positions below w m <= c0)
                pr = prev_first[:, None] + ar
                prev_kv, prev_gate = all_kv[pr], all_gate[pr]
            entries = self._pool_windows(comp, all_kv[cur], all_gate[cur], prev_kv, prev_gate,
                                         prev_at if prev else None)
            deepinfer_ops.rotary_embedding(entries, w_pos, rope_table)
            deepinfer_ops.kv_cache_write(pool_comp, entries.to(pool_comp.dtype), dst)
        if src_rows:
            deepinfer_ops.kv_cache_write(pool_state_kv, all_kv[sr].to(pool_state_kv.dtype), ds)
            deepinfer_ops.kv_cache_write(pool_state_gate, all_gate[sr].to(pool_state_gate.dtype), ds)

    def _compress_seq(self, comp: Compressor, kv_new: torch.Tensor, gate_new: torch.Tensor, s: _Seq,
                      pool_state_kv: torch.Tensor, pool_state_gate: torch.Tensor, pool_comp: torch.Tensor,
                      rope_table: torch.Tensor) -> None:
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
            cur_kv = all_kv[lo:hi].view(n_win, m, -1)
            cur_gate = all_gate[lo:hi].view(n_win, m, -1)
            prev_kv = prev_gate = prev_at = None
            w_from = max(first_w, 1)  # windows w >= 1 take the Ca half of window w - 1 (CSA)
            if overlap and end_w > w_from:
                plo, phi = (w_from - 1) * m - s0, (end_w - 1) * m - s0
                k = end_w - w_from
                prev_kv, prev_gate = all_kv[plo:phi].view(k, m, -1), all_gate[plo:phi].view(k, m, -1)
                prev_at = slice(n_win - k, n_win)
            entries = self._pool_windows(comp, cur_kv, cur_gate, prev_kv, prev_gate, prev_at)
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
    @staticmethod
    def _x_linears(attn: Attention) -> list[Linear]:
        """The compressor / indexer projections of the attention input, in output order: compressor ``wkv``,
        ``wgate``, then for CSA the indexer compressor's ``wkv``, ``wgate`` and the indexer ``weights_proj``."""
        lins = [attn.compressor.wkv, attn.compressor.wgate]
        if attn.layer_type == CSA:
            ic = attn.indexer.compressor
            lins += [ic.wkv, ic.wgate, attn.indexer.weights_proj]
        return lins

    def _x_projections(self, attn: Attention, x: torch.Tensor, rows: int) -> list[torch.Tensor]:
        """Outputs of :meth:`_x_linears` for ``x [T, D]``. Their dequantised weights run as ONE GEMM over the
        concatenated weight (the ``x`` reads and, in batch-invariant mode, the fixed-shape chunk launches are shared
        instead of repeated five times): the first call concatenates them into one tensor and makes every linear's
        weight a view of its rows (so in-place weight updates reach it; a linear whose weight was replaced since --
        another tensor, device or dtype -- is noticed through the views and the concatenation is rebuilt). FP8
        linears run on their own."""
        lins = self._x_linears(attn)
        dense = [lin for lin in lins if not lin.is_fp8]
        if len(dense) < 2:
            return [lin(x, rows) for lin in lins]
        fused = self._fused_weights.get(id(attn))
        if fused is None or not self._is_fused_view(fused, dense):
            fused = torch.cat([lin.weight.detach() for lin in dense])
            r = 0
            for lin in dense:
                n = lin.weight.shape[0]
                lin._parameters["weight"] = nn.Parameter(fused[r:r + n], requires_grad=False)
                r += n
            self._fused_weights[id(attn)] = fused
        y = linear_rows(x, fused, rows)
        outs, r = {}, 0
        for lin in dense:
            n = lin.weight.shape[0]
            outs[id(lin)] = y[:, r:r + n].contiguous()
            r += n
        return [outs[id(lin)] if id(lin) in outs else lin(x, rows) for lin in lins]

    @staticmethod
    def _is_fused_view(fused: torch.Tensor, dense: list[Linear]) -> bool:
        """Whether the weights of ``dense`` are still, in order, the row blocks of ``fused``."""
        r, row_bytes = 0, fused.shape[1] * fused.element_size()
        for lin in dense:
            w = lin.weight
            if (w.device != fused.device or w.dtype != fused.dtype or w.shape[1] != fused.shape[1]
                    or not w.is_contiguous() or w.data_ptr() != fused.data_ptr() + r * row_bytes):
                return False
            r += w.shape[0]
        return r == fused.shape[0]

    def _attention(self, attn: Attention, x: torch.Tensor, positions: torch.Tensor, step: _Step,
                   pools: dict[str, torch.Tensor], rows: int = 0) -> torch.Tensor:
        """One attention sublayer over the step's tokens ``x [T, D]``. ``rows > 0``: batch-invariant mode (fixed-shape
        GEMM chunks of ``rows`` rows; the sparse attention and indexer ops compute each query row on its own)."""
        cfg = self.config
        T = x.shape[0]
        H, hd = cfg.num_attention_heads, cfg.head_dim
        B = self._block_size
        W = cfg.sliding_window
        seqs = step.seqs
        table = self._rope(attn.rope_kind, step.max_len, x.device)

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
            idx = attn.indexer if lt == CSA else None
            proj = self._x_projections(attn, x, rows)
            ckv, cgate = proj[0], proj[1]
        if lt == CSA:
            ikv, igate = proj[2], proj[3]
            iq = idx.wq_b(qr, rows).view(T, idx.n_heads, idx.head_dim).contiguous()
            deepinfer_ops.rotary_embedding(iq, positions, table)
            iw = proj[4].float() * (idx.n_heads ** -0.5)

        # 1. the step's cache writes: raw K=V of every token, then every window closing in this step (compressed
        #    entries and indexer keys)
        kv_cache = pools["kv"]  # [num_blocks, B, hd]: a paged cache with block_size B
        slots = step.token_slots
        deepinfer_ops.kv_cache_write(kv_cache, kv[:slots.shape[0]].to(kv_cache.dtype), slots)  # not the padding rows
        if lt != SLIDING:
            comps = [(comp, ckv, cgate, "state_kv", "state_gate", "comp")]
            if lt == CSA:
                comps.append((idx.compressor, ikv, igate, "idx_state_kv", "idx_state_gate", "idx"))
            decode, at = step.decode, step.decode_rows
            for c, kv_p, gate_p, sk, sg, out in comps:
                if decode:  # one token each: batched over the sequences
                    self._compress_decode(c, kv_p[at], gate_p[at], decode, pools[sk], pools[sg], pools[out], table)
                for s in seqs:
                    if s.b - s.a > 1:
                        sl = slice(s.a, s.b)
                        self._compress_seq(c, kv_p[sl], gate_p[sl], s, pools[sk], pools[sg], pools[out], table)
        # 2. the index lists: window = the last W raw tokens (query included) in position order; compressed = every
        #    closed entry (HCA) or the indexer's top-k closed entries (CSA) in entry order; -1 = no entry. Per-token
        #    block tables; batch-invariant padding rows (past the sequences) get no block, hence no entry (out = 0).
        dev = x.device
        tok_bt = step.tok_bt
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
        G, olr = cfg.o_groups, cfg.o_lora_rank
        if attn.wo_a.is_fp8:  # the G groups as one masked grouped FP8 GEMM, every group all T rows (batch-invariant
            #                   by construction, any mode; bfloat16 out, which wo_b re-quantises to FP8 anyway)
            per_group = out.view(T, G, -1).transpose(0, 1).contiguous()  # [G, T, H * hd / G]
            xq, xs = quant_act_fp8(per_group.view(G * T, -1))
            w, ws = attn.wo_a.fp8_groups(G)
            o = deepinfer_ops.m_grouped_fp8_gemm_nt_masked(xq.view(G, T, -1), xs.view(G, T, -1), w, ws,
                                                           torch.full((G,), T, dtype=torch.int32, device=dev))
            return attn.wo_b(o.transpose(0, 1).reshape(T, G * olr).to(x.dtype), rows)
        wa = attn.wo_a.weight.view(G, olr, -1)
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
        if rows:  # batch-invariant mode: the sum as explicit adds in slot order (no reduction kernel chosen by T)
            total = weights[:, 0]
            for j in range(1, weights.shape[1]):
                total = total + weights[:, j]
            total = total.unsqueeze(1)
        else:
            total = weights.sum(dim=-1, keepdim=True)
        weights = weights / (total + 1e-20) * cfg.routed_scaling_factor
        return weights, indices

    def _moe(self, moe: MoE, x: torch.Tensor, input_ids: torch.Tensor, rows: int = 0,
             num_tokens: int | None = None) -> torch.Tensor:
        """Routed experts + shared expert. The combine is in a fixed order in both modes. FP8 experts
        (:func:`deepinfer_ops.fused_moe_fp8`): a token's ``top_k`` slots added in slot order in float32. Dequantised
        experts: a token's expert outputs added to it in ascending expert id (one ``index_add_`` per expert, each
        token at most once per call, so no atomics race); ``rows > 0``: every expert GEMM runs in fixed-shape
        chunks. Then the shared expert."""
        cfg = self.config
        weights, indices = self._route(moe, x, input_ids, rows)
        if num_tokens is not None:  # batch-invariant mode: rows past num_tokens are padding, never dispatched
            weights, indices = weights[:num_tokens], indices[:num_tokens]
        limit = cfg.swiglu_limit
        if moe.is_fp8:
            n = indices.shape[0]
            routed = deepinfer_ops.fused_moe_fp8(x[:n], indices, weights, moe.w13, moe.w13_scale, moe.w2,
                                                 moe.w2_scale, limit, out_dtype=x.dtype)
            if n < x.shape[0]:
                routed = torch.cat([routed, routed.new_zeros(x.shape[0] - n, x.shape[1])])
            return routed + moe.shared_experts(x, limit, rows)
        y = torch.zeros_like(x)
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
    def _head_rows(self, rows: int, device: torch.device) -> int:
        """Rows per LM-head GEMM call: 0 with the mode off, else ``BI_GEMM_ROWS`` for ``device`` on either GEMM path
        (see ``BI_GEMM_ROWS_FP8``)."""
        return self.BI_GEMM_ROWS.get(torch.device(device).type, self.BI_GEMM_ROWS_DEFAULT) if rows else 0

    def _step_pad(self, rows: int) -> int:
        """Rows the step's token dimension is padded to a multiple of: ``rows`` on path ``"dequant"`` in
        batch-invariant mode, else 0 (no padding)."""
        return 0 if self.gemm == "fp8" else rows

    def _block(self, blk: Block, streams: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor,
               step: _Step, pools: dict[str, torch.Tensor], rows: int = 0, pad: int = 0) -> torch.Tensor:
        post, comb, collapsed = self._hc_pre(streams, blk.hc_attn_fn, blk.hc_attn_base, blk.hc_attn_scale)
        a = self._attention(blk.attn, blk.attn_norm(collapsed), positions, step, pools, rows)
        streams = self._hc_post(streams, a, post, comb)
        post, comb, collapsed = self._hc_pre(streams, blk.hc_ffn_fn, blk.hc_ffn_base, blk.hc_ffn_scale)
        f = self._moe(blk.ffn, blk.ffn_norm(collapsed), input_ids, rows, step.seqs[-1].b if pad else None)
        return self._hc_post(streams, f, post, comb)

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
        # batch-invariant mode, path "dequant": the token dimension is zero-padded to whole GEMM chunks for the whole
        # step (token 0 at position 0); the padding rows are never attended to, routed, cached or returned. Path
        # "fp8" runs the step's rows as they are (the FP8 GEMMs need no padding; linear_rows pads its own inputs).
        pad = self._step_pad(rows)
        ids = pad_rows(batch.input_ids.long(), pad)
        positions = pad_rows(batch.positions.long(), pad)
        emb = self.embed(ids)
        streams = emb.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        step = _Step(seqs, positions, ids.shape[0], cache.block_size)
        for i, blk in enumerate(self.layers):
            streams = self._block(blk, streams, ids, positions, step, cache.layers[i], rows, pad)
        streams = streams[:T]
        li = batch.logits_indices.long()
        sel = streams[li]
        x = self.norm(self._hc_head(sel, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, rows))
        logits = self.head(x, self._head_rows(rows, x.device)).float()
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
        pad = self._step_pad(rows)  # batch-invariant mode: whole GEMM chunks (path "dequant"), see forward
        ids = pad_rows(batch.input_ids.long(), pad)
        positions = pad_rows(batch.positions.long(), pad)
        e = blk.e_proj(blk.enorm(self.embed(ids)), rows)
        h = blk.h_proj(blk.hnorm(pad_rows(hidden_streams.to(self.dtype).contiguous(), pad)), rows)
        streams = e.unsqueeze(1) + h
        streams = self._block(blk, streams, ids, positions, _Step(seqs, positions, ids.shape[0], cache.block_size),
                              cache.layers[self.config.num_hidden_layers + mtp_idx], rows, pad)[:T]
        sel = streams[batch.logits_indices.long()]
        x = blk.norm(self._hc_head(sel, blk.hc_head_fn, blk.hc_head_base, blk.hc_head_scale, rows))
        logits = self.head(x, self._head_rows(rows, x.device)).float()
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
