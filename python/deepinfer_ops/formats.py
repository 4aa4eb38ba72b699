"""Number formats of DeepSeek-V4 checkpoints and kernels: FP8 e4m3 with 128x128 block scales, FP4 e2m1 with per-32
UE8M0 scales, and UE8M0 itself. One pure-torch implementation of each, exact and deterministic, on any device.

Both the engine's checkpoint loader/writer (``deepinfer.quantization``) and the op references
(``deepinfer_ops.testing.refs``) use these functions; this module imports nothing from the engine.

Formats (sources: the DeepSeek-V4 checkpoint format -- ``config.json`` ``quantization_config`` with
``weight_block_size [128, 128]`` and ``scale_fmt "ue8m0"``, FP4 routed experts with per-32 scales -- as read through the
public inference ports and transformers 5.23 ``integrations/finegrained_fp8.py``; the OCP Microscaling Formats (MX)
v1.0 specification for the E8M0 scale and the E2M1 element encodings):

- **UE8M0** (OCP MX E8M0): one unsigned byte ``b``, value ``2 ** (b - 127)``; ``b = 255`` is NaN; no zero, no sign.
  Range ``2**-127 .. 2**127``. Stored as ``torch.float8_e8m0fnu`` (safetensors ``F8_E8M0``) or raw ``uint8``.
- **FP8 block** (dense linears, optionally experts): codes ``[..., N, K]`` ``torch.float8_e4m3fn`` (max 448), scales
  ``[..., ceil(N/bm), ceil(K/bn)]`` UE8M0 or fp32 with ``(bm, bn) = (128, 128)``; partial edge blocks use their own
  scale. ``w[i, j] = q[i, j] * scale[i // bm, j // bn]``. The scale is the *dequantisation* multiplier (transformers
  calls it ``weight_scale_inv``).
- **FP4 e2m1** (OCP MX E2M1; routed experts): ``[..., N, K/2]`` int8 (safetensors ``I8``) or uint8, two codes per
  byte, element ``2k`` in the LOW nibble and ``2k+1`` in the HIGH nibble. Code bits ``s e e m``: magnitudes
  ``(0, 0.5, 1, 1.5, 2, 3, 4, 6)`` for codes 0..7, bit 3 the sign (code 8 is -0). Scales ``[..., N, ceil(K/32)]``
  UE8M0, one per 32 consecutive elements along K: ``w[i, j] = e2m1(code[i, j]) * scale[i, j // 32]``.

Quantisation (checkpoint writer, tests): per block ``amax``; scale ``amax / qmax`` (qmax 448 for FP8, 6 for FP4)
rounded UP to a power of two for UE8M0 (DeepSeek's ``fast_round_scale``), or the exact fp32 quotient for fp32 scales;
an all-zero block gets scale 1. Values are divided by the scale and rounded to nearest, ties to even, saturating.

Errors: ``TypeError`` for a wrong dtype of a UE8M0 argument; ``ValueError`` naming the function and argument for a
wrong dtype of codes, a wrong rank, a scale shape that does not match the codes, odd K for FP4 packing, or non-finite
values to quantise.
"""

from __future__ import annotations

import torch

FP8_E4M3_DTYPE = torch.float8_e4m3fn
UE8M0_DTYPE = torch.float8_e8m0fnu
FP8_E4M3_MAX = 448.0
FP4_E2M1_MAX = 6.0
#: (bm, bn) of the FP8 weight block scales.
FP8_BLOCK = (128, 128)
#: elements along K sharing one FP4 UE8M0 scale.
FP4_GROUP = 32
UE8M0_BIAS = 127
UE8M0_NAN = 255

#: e2m1 values indexed by the 4-bit code (bit 3 = sign; code 8 is -0.0).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

# Rounding boundaries between consecutive e2m1 magnitudes (midpoints). A value exactly on boundary i ties to the code
# with the even mantissa: boundary i (between codes i and i+1) goes to code i when i is even and to i+1 when i is odd.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _block_pair(block: int | tuple[int, int]) -> tuple[int, int]:
    return (block, block) if isinstance(block, int) else (int(block[0]), int(block[1]))


def _check_rank(fn: str, name: str, t: torch.Tensor, what: str) -> None:
    if t.dim() < 2:
        raise ValueError(f"{fn}: {name} must be at least 2-D {what}, got shape {tuple(t.shape)}")


def expand_block_scales(scale: torch.Tensor, block: int | tuple[int, int], n: int, k: int) -> torch.Tensor:
    """Broadcast per-block values ``[..., ceil(n/bm), ceil(k/bn)]`` to ``[..., n, k]`` (partial edge blocks cut).

    Any dtype; returns the same dtype. No validation (callers check shapes).
    """
    bm, bn = _block_pair(block)
    return scale.repeat_interleave(bm, dim=-2)[..., :n, :].repeat_interleave(bn, dim=-1)[..., :k]


# ------------------------------------------------------------------------------------------------------------ UE8M0


def ue8m0_to_exponent(scale: torch.Tensor) -> torch.Tensor:
    """Biased exponents of UE8M0 scales: ``scale`` (``torch.float8_e8m0fnu`` or raw ``uint8``, any shape) -> int32
    ``b`` in ``[0, 255]`` (value ``2 ** (b - 127)``, 255 = NaN). Raises TypeError for any other dtype."""
    if scale.dtype not in (UE8M0_DTYPE, torch.uint8):
        raise TypeError(f"ue8m0_to_exponent: expected float8_e8m0fnu or uint8 scales, got {scale.dtype}")
    return scale.view(torch.uint8).to(torch.int32)


def ue8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Exact fp32 values of UE8M0 scales (``float8_e8m0fnu`` or raw ``uint8``, any shape): ``2 ** (b - 127)``, NaN
    for byte 255, the subnormal ``2**-127`` for byte 0. Built from the float bits, so identical on every device.
    Raises TypeError for any other dtype."""
    e = ue8m0_to_exponent(scale)
    bits = torch.where(e == 0, torch.full_like(e, 1 << 22), e << 23)  # byte 0: 2^-127 = 2^22 * 2^-149 (subnormal)
    bits = torch.where(e == UE8M0_NAN, torch.full_like(e, 0x7FC00000), bits)
    return bits.view(torch.float32)


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """A stored block scale as fp32: fp32 is returned as is, UE8M0 (``float8_e8m0fnu``/``uint8``) decoded exactly.
    Raises TypeError for other dtypes."""
    if scale.dtype == torch.float32:
        return scale
    return ue8m0_to_float(scale)


def ceil_pow2_exponent(x: torch.Tensor) -> torch.Tensor:
    """Smallest integer ``e`` with ``2**e >= x``, exactly (``frexp``, no ``log2`` rounding), as int32.

    ``x``: positive finite floats, any shape (computed in fp32, subnormals included). Results for ``x <= 0``, NaN or
    inf are unspecified (callers mask or validate them).
    """
    mant, exp = torch.frexp(x.to(torch.float32))  # x = mant * 2**exp, mant in [0.5, 1)
    return torch.where(mant == 0.5, exp - 1, exp).to(torch.int32)


def round_up_pow2(x: torch.Tensor) -> torch.Tensor:
    """Smallest power of two ``>= x`` as fp32, exactly (how UE8M0 scales are chosen). ``x`` any shape.

    Positive finite ``x`` (subnormals included) give a power of two (``inf`` above ``2**127``); NaN, ``x <= 0`` and
    ``-inf`` give NaN; ``+inf`` gives ``+inf``. Built from float bits, so identical on every device.
    """
    xf = x.to(torch.float32)
    e = ceil_pow2_exponent(torch.where(xf > 0, xf, torch.ones_like(xf)))
    normal = (e + 127).clamp(0, 255) << 23  # e = 128 -> inf bits
    sub = torch.ones_like(e) << (e + 149).clamp(0, 22)  # e in [-149, -127]
    out = torch.where(e >= -126, normal, sub).view(torch.float32)
    out = torch.where(torch.isposinf(xf), xf, out)
    return torch.where((xf > 0) | torch.isposinf(xf), out, torch.full_like(out, float("nan")))


def float_to_ue8m0_ceil(x: torch.Tensor) -> torch.Tensor:
    """Round positive values UP to a power of two and encode them as UE8M0 (``torch.float8_e8m0fnu``, same shape).

    Values are clamped to the UE8M0 range ``[2**-127, 2**127]``. Raises ValueError unless every value is finite and
    > 0 (callers replace a zero amax first).
    """
    x = x.to(torch.float32)
    if not bool(torch.isfinite(x).all()) or bool((x <= 0).any()):
        raise ValueError("float_to_ue8m0_ceil: scales must be finite and positive")
    e = ceil_pow2_exponent(x).clamp(-UE8M0_BIAS, UE8M0_BIAS)
    return (e + UE8M0_BIAS).to(torch.uint8).view(UE8M0_DTYPE)


# ---------------------------------------------------------------------------------------------------------- FP8 block


def dequant_fp8_block(
    q: torch.Tensor, scale: torch.Tensor, block: int | tuple[int, int] = FP8_BLOCK
) -> torch.Tensor:
    """fp32 dequantisation of block-scaled FP8: ``q[..., i, j] * scale[..., i // bm, j // bn]``.

    Args:
        q: ``[..., N, K]`` ``torch.float8_e4m3fn`` codes.
        scale: ``[..., ceil(N/bm), ceil(K/bn)]`` fp32 or UE8M0 (``float8_e8m0fnu``/``uint8``); partial edge blocks
            use their own scale.
        block: ``bm`` = ``bn`` as an int, or ``(bm, bn)``; default ``(128, 128)``.
    Returns: ``[..., N, K]`` fp32 (the exact product: e4m3 times a power of two, or one fp32 rounding).
    Raises: ValueError for a wrong dtype, a rank below 2 or a scale shape that does not match; TypeError for a scale
        dtype that is neither fp32 nor UE8M0.
    """
    if q.dtype != FP8_E4M3_DTYPE:
        raise ValueError(f"dequant_fp8_block: q dtype {q.dtype}, expected {FP8_E4M3_DTYPE}")
    _check_rank("dequant_fp8_block", "q", q, "[..., N, K]")
    n, k = q.shape[-2:]
    bm, bn = _block_pair(block)
    want = (*q.shape[:-2], _ceil_div(n, bm), _ceil_div(k, bn))
    if tuple(scale.shape) != want:
        raise ValueError(f"dequant_fp8_block: scale shape {tuple(scale.shape)}, expected {want} for q {tuple(q.shape)}")
    return q.to(torch.float32) * expand_block_scales(scale_to_float(scale), (bm, bn), n, k)


def quantize_fp8_block(
    w: torch.Tensor, block: int | tuple[int, int] = FP8_BLOCK, scale_fmt: str = "ue8m0"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``[..., N, K]`` values to FP8 e4m3 with one scale per ``block`` (edge blocks may be partial).

    Args:
        w: ``[..., N, K]`` float tensor (any float dtype; computed in fp32). Must be finite.
        block: ``bm`` = ``bn`` as an int, or ``(bm, bn)``; default ``(128, 128)``.
        scale_fmt: ``"ue8m0"`` (amax/448 rounded up to a power of two, stored ``float8_e8m0fnu``) or ``"float"``
            (fp32 ``amax / 448``). An all-zero block gets scale 1.
    Returns: ``(q [..., N, K] float8_e4m3fn, scale [..., ceil(N/bm), ceil(K/bn)])``; q is ``w / scale`` rounded to
        nearest even, saturating at 448.
    Raises: ValueError for non-finite input, a rank below 2 or an unknown scale_fmt.
    """
    _check_rank("quantize_fp8_block", "w", w, "[..., N, K]")
    if scale_fmt not in ("ue8m0", "float"):
        raise ValueError(f"quantize_fp8_block: scale_fmt must be 'ue8m0' or 'float', got {scale_fmt!r}")
    w = w.to(torch.float32)
    if not bool(torch.isfinite(w).all()):
        raise ValueError("quantize_fp8_block: w has NaN or inf values")
    lead, (n, k) = w.shape[:-2], w.shape[-2:]
    bm, bn = _block_pair(block)
    rb, cb = _ceil_div(n, bm), _ceil_div(k, bn)
    padded = torch.nn.functional.pad(w, (0, cb * bn - k, 0, rb * bm - n))
    amax = padded.reshape(*lead, rb, bm, cb, bn).abs().amax(dim=(-3, -1))
    raw = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    if scale_fmt == "ue8m0":
        stored = float_to_ue8m0_ceil(raw)
        s = ue8m0_to_float(stored)
    else:
        stored = s = raw
    q = (w / expand_block_scales(s, (bm, bn), n, k)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(FP8_E4M3_DTYPE)
    return q, stored


# ------------------------------------------------------------------------------------------------------------ FP4


def e2m1_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16 e2m1 values indexed by the 4-bit code (bit 3 = sign): ``[16]`` fp32 on ``device``."""
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


def unpack_fp4_codes(packed: torch.Tensor) -> torch.Tensor:
    """4-bit e2m1 codes of packed FP4: ``[..., K/2]`` int8/uint8 (or ``float4_e2m1fn_x2``) -> ``[..., K]`` int64,
    element ``2k`` from the low nibble and ``2k+1`` from the high nibble."""
    b = packed.contiguous().view(torch.uint8).to(torch.int64)
    return torch.stack([b & 0xF, b >> 4], dim=-1).flatten(-2)


def pack_fp4_codes(codes: torch.Tensor) -> torch.Tensor:
    """Pack ``[..., K]`` 4-bit codes (integer values 0..15, K even) into ``[..., K/2]`` int8, low nibble = even element.

    Raises: ValueError for odd K.
    """
    if codes.shape[-1] % 2:
        raise ValueError(f"pack_fp4_codes: last dim {codes.shape[-1]} must be even (two codes per byte)")
    codes = codes.to(torch.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).view(torch.int8)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """e2m1 values of packed FP4 without scales: ``[..., K/2]`` int8/uint8 (or ``float4_e2m1fn_x2``) -> ``[..., K]``
    fp32."""
    return e2m1_table(packed.device)[unpack_fp4_codes(packed)]


def round_e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 codes (uint8, same shape) of values already divided by their scale: round to nearest, ties to the
    even mantissa, saturating at 6; a value rounding to zero is stored as +0 (code 0). NaN gives code 0."""
    a = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for i, m in enumerate(_E2M1_MIDPOINTS):
        code += (a > m if i % 2 == 0 else a >= m).to(torch.uint8)
    sign = ((x < 0) & (code > 0)).to(torch.uint8) << 3
    return code | sign


def dequant_fp4(packed: torch.Tensor, scale: torch.Tensor, group: int = FP4_GROUP) -> torch.Tensor:
    """fp32 dequantisation of packed FP4 e2m1: ``e2m1(code[..., i, j]) * scale[..., i, j // group]``.

    Args:
        packed: ``[..., N, K/2]`` int8/uint8 (or ``float4_e2m1fn_x2``), two codes per byte, low nibble first.
        scale: ``[..., N, ceil(K/group)]`` UE8M0 (``float8_e8m0fnu``/``uint8``; byte 255 gives NaN) or fp32.
        group: elements along K per scale, default 32.
    Returns: ``[..., N, K]`` fp32 (exact: e2m1 times a power of two).
    Raises: ValueError for a wrong packed dtype, a rank below 2 or a scale shape that does not match; TypeError for a
        scale dtype that is neither fp32 nor UE8M0.
    """
    fp4x2 = getattr(torch, "float4_e2m1fn_x2", None)
    if packed.dtype not in (torch.int8, torch.uint8) and packed.dtype != fp4x2:
        raise ValueError(f"dequant_fp4: packed dtype {packed.dtype}, expected int8 or uint8")
    _check_rank("dequant_fp4", "packed", packed, "[..., N, K/2]")
    n, k = packed.shape[-2], 2 * packed.shape[-1]
    want = (*packed.shape[:-2], n, _ceil_div(k, group))
    if tuple(scale.shape) != want:
        raise ValueError(f"dequant_fp4: scale shape {tuple(scale.shape)}, expected {want} for packed "
                         f"{tuple(packed.shape)} (K = {k})")
    return unpack_fp4(packed) * expand_block_scales(scale_to_float(scale), (1, group), n, k)


def quantize_fp4(w: torch.Tensor, group: int = FP4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``[..., N, K]`` values (K even) to packed FP4 e2m1 with one UE8M0 scale per ``group`` elements of K.

    Scale = ``amax / 6`` rounded up to a power of two (1 for an all-zero group); codes by ``round_e2m1_codes``.
    Returns: ``(packed [..., N, K/2] int8, scale [..., N, ceil(K/group)] float8_e8m0fnu)``.
    Raises: ValueError for non-finite input, odd K or a rank below 2.
    """
    _check_rank("quantize_fp4", "w", w, "[..., N, K]")
    w = w.to(torch.float32)
    if not bool(torch.isfinite(w).all()):
        raise ValueError("quantize_fp4: w has NaN or inf values")
    lead, (n, k) = w.shape[:-2], w.shape[-2:]
    if k % 2:
        raise ValueError(f"quantize_fp4: K = {k} must be even (two codes per byte)")
    ng = _ceil_div(k, group)
    amax = torch.nn.functional.pad(w, (0, ng * group - k)).reshape(*lead, n, ng, group).abs().amax(dim=-1)
    stored = float_to_ue8m0_ceil(torch.where(amax > 0, amax / FP4_E2M1_MAX, torch.ones_like(amax)))
    codes = round_e2m1_codes(w / expand_block_scales(ue8m0_to_float(stored), (1, group), n, k))
    return pack_fp4_codes(codes), stored
