"""Weight quantisation formats of native DeepSeek-V4 checkpoints: FP8 block scaling and FP4 (e2m1) with UE8M0 scales.

Pure torch, CPU friendly. Every function here is exact and deterministic: the dequantisation is the plain fp32 product
``value * scale`` per block, and the quantisation rounds to nearest (ties to even) after dividing by a power-of-two scale.

Formats (source: DeepSeek-V4 inference ``model.py``/``convert.py`` as read through public ports, transformers 5.23
``integrations/finegrained_fp8.py`` ``Fp8Dequantize`` / ``Fp8Quantize``):

- **FP8 block** (dense linears, optionally experts): weight ``[out, in]`` ``torch.float8_e4m3fn`` (safetensors ``F8_E4M3``,
  max 448), scale ``[ceil(out/bm), ceil(in/bn)]`` with ``(bm, bn) = (128, 128)``, stored as UE8M0
  (``torch.float8_e8m0fnu``, safetensors ``F8_E8M0``) or fp32. ``w[i, j] = q[i, j] * scale[i // bm, j // bn]``.
  The scale is the *dequantisation* multiplier (transformers calls it ``weight_scale_inv``).
- **FP4 e2m1** (routed experts): weight ``[out, in/2]`` int8 (safetensors ``I8``), two codes per byte: element ``2k`` in the
  LOW nibble, element ``2k+1`` in the HIGH nibble. Code bits ``s e e m``: magnitude table
  ``(0, 0.5, 1, 1.5, 2, 3, 4, 6)`` for codes 0..7, bit 3 is the sign (code 8 = -0). Scale ``[out, ceil(in/32)]`` UE8M0,
  one per 32 consecutive input elements: ``w[i, j] = e2m1(code[i, j]) * scale[i, j // 32]``.
- **UE8M0**: one byte ``b``, value ``2 ** (b - 127)``; ``b = 255`` is NaN. Range ``2**-127 .. 2**127``.

Quantisation (used by the checkpoint writer): per block ``amax``; the scale is ``amax / qmax`` (qmax 448 for FP8, 6 for FP4)
rounded UP to a power of two for UE8M0 (DeepSeek's ``fast_round_scale``; transformers does the same), or kept as the exact
fp32 quotient for fp32 scales; an all-zero block gets scale 1. Values are divided by the scale and rounded to nearest, ties
to even, saturating at qmax.

Round-trip error bounds (tested in tests/engine/test_checkpoint.py), per element, ``s`` = the block's scale:
- FP8 e4m3 (UE8M0 or fp32 scale): ``|w - dq(q(w))| <= 2**-4 * |w| + 2**-10 * s``: half an ulp of a 3-bit mantissa is
  at most ``2**-4`` of the value, and below the smallest normal (``2**-6 * s``) the step is the subnormal ``2**-9 * s``.
  No saturation error: ``amax / s <= 448``. With UE8M0, ``s < 2 * amax / 448``.
- FP4 e2m1 (UE8M0 scale): ``|w - dq(q(w))| <= 0.25 * s`` where ``|w| / s < 2`` (grid step 0.5), ``<= 0.5 * s`` in
  [2, 4) and ``<= 1 * s`` in [4, 6]; since ``s < 2 * amax / 6``, the worst case is ``amax / 3``.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
UE8M0_DTYPE = torch.float8_e8m0fnu
FP8_MAX = 448.0
FP4_MAX = 6.0
FP8_BLOCK = (128, 128)
FP4_BLOCK = 32

#: e2m1 magnitudes for codes 0..7; code | 8 negates (code 8 is -0.0).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# Rounding boundaries between consecutive e2m1 magnitudes (midpoints). A value exactly on boundary i ties to the code
# with an even mantissa: boundary i (between code i and i+1) goes to code i when i is even and to i+1 when i is odd.
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def e2m1_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16-entry fp32 e2m1 value table indexed by the 4-bit code (bit 3 = sign). ``[16]`` fp32."""
    mags = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])


def ue8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Exact fp32 value of UE8M0 scales (``torch.float8_e8m0fnu`` or raw ``uint8`` bytes): ``2 ** (b - 127)``, NaN at 255.

    Shape preserved; returns fp32. Raises TypeError for any other dtype.
    """
    if scale.dtype == torch.uint8:
        scale = scale.view(UE8M0_DTYPE)
    if scale.dtype != UE8M0_DTYPE:
        raise TypeError(f"ue8m0_to_float: expected float8_e8m0fnu or uint8, got {scale.dtype}")
    return scale.to(torch.float32)


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """A stored block scale (UE8M0 or fp32) as fp32. Raises TypeError for other dtypes."""
    if scale.dtype == torch.float32:
        return scale
    return ue8m0_to_float(scale)


def float_to_ue8m0_ceil(x: torch.Tensor) -> torch.Tensor:
    """Round positive fp32 values UP to a power of two and encode them as UE8M0 (``torch.float8_e8m0fnu``).

    Exact integer arithmetic (``frexp``), no ``log2`` rounding. Values are clamped to ``[2**-127, 2**127]``.
    ``x`` must be finite and > 0 (callers replace zero amax first); raises ValueError otherwise.
    """
    x = x.to(torch.float32)
    if not bool(torch.isfinite(x).all()) or bool((x <= 0).any()):
        raise ValueError("float_to_ue8m0_ceil: scales must be finite and positive")
    mant, exp = torch.frexp(x)  # x = mant * 2**exp, mant in [0.5, 1)
    e = torch.where(mant == 0.5, exp - 1, exp).to(torch.int32)  # smallest e with 2**e >= x
    e = e.clamp(-127, 127)
    return (e + 127).to(torch.uint8).view(UE8M0_DTYPE)


# --------------------------------------------------------------------------------------------------------------- FP8


def _check_2d(name: str, w: torch.Tensor) -> None:
    if w.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D weight [out, in], got shape {tuple(w.shape)}")


def dequantize_fp8_block(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = FP8_BLOCK) -> torch.Tensor:
    """Plain fp32 dequantisation of a block-scaled FP8 weight.

    Args:
        q: ``[out, in]`` ``torch.float8_e4m3fn``.
        scale: ``[ceil(out/bm), ceil(in/bn)]`` UE8M0 (``float8_e8m0fnu``/uint8) or fp32.
        block: ``(bm, bn)``, default ``(128, 128)``.
    Returns: ``[out, in]`` fp32, ``q.float() * scale.float()[i // bm, j // bn]`` (partial edge blocks allowed).
    Raises: ValueError on a dtype or scale-shape mismatch.
    """
    if q.dtype != FP8_DTYPE:
        raise ValueError(f"dequantize_fp8_block: weight dtype {q.dtype}, expected {FP8_DTYPE}")
    _check_2d("dequantize_fp8_block", q)
    out, inp = q.shape
    bm, bn = block
    want = (_ceil_div(out, bm), _ceil_div(inp, bn))
    if tuple(scale.shape) != want:
        raise ValueError(f"dequantize_fp8_block: scale shape {tuple(scale.shape)}, expected {want} for weight {tuple(q.shape)}")
    s = scale_to_float(scale)
    s = s.repeat_interleave(bm, 0)[:out].repeat_interleave(bn, 1)[:, :inp]
    return q.to(torch.float32) * s


def quantize_fp8_block(
    w: torch.Tensor, block: tuple[int, int] = FP8_BLOCK, scale_fmt: str = "ue8m0"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a ``[out, in]`` weight to FP8 e4m3 with one scale per ``block`` (edge blocks may be partial).

    Args:
        w: ``[out, in]`` float tensor (any float dtype; computed in fp32). Must be finite.
        scale_fmt: ``"ue8m0"`` (power-of-two scale rounded up, stored ``float8_e8m0fnu``) or ``"float"`` (fp32 ``amax/448``).
    Returns: ``(q [out, in] float8_e4m3fn, scale [ceil(out/bm), ceil(in/bn)])``.
    Raises: ValueError for non-finite input, a bad shape or an unknown scale_fmt.
    """
    _check_2d("quantize_fp8_block", w)
    if scale_fmt not in ("ue8m0", "float"):
        raise ValueError(f"quantize_fp8_block: scale_fmt must be 'ue8m0' or 'float', got {scale_fmt!r}")
    w = w.to(torch.float32)
    if not bool(torch.isfinite(w).all()):
        raise ValueError("quantize_fp8_block: weight has NaN or inf values")
    out, inp = w.shape
    bm, bn = block
    rb, cb = _ceil_div(out, bm), _ceil_div(inp, bn)
    padded = torch.zeros(rb * bm, cb * bn, dtype=torch.float32)
    padded[:out, :inp] = w
    amax = padded.view(rb, bm, cb, bn).abs().amax(dim=(1, 3))
    if scale_fmt == "ue8m0":
        raw = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        stored = float_to_ue8m0_ceil(raw)
        s = stored.to(torch.float32)
    else:
        s = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        stored = s
    s_full = s.repeat_interleave(bm, 0)[:out].repeat_interleave(bn, 1)[:, :inp]
    q = (w / s_full).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, stored


# --------------------------------------------------------------------------------------------------------------- FP4


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Unpack e2m1 codes to fp32 values (no scale).

    Args: ``packed`` ``[..., n/2]`` int8/uint8 (or ``torch.float4_e2m1fn_x2``), low nibble = even element.
    Returns: ``[..., n]`` fp32.
    """
    u8 = packed.contiguous().view(torch.uint8)
    table = e2m1_table(packed.device)
    lo = table[(u8 & 0xF).long()]
    hi = table[(u8 >> 4).long()]
    return torch.stack([lo, hi], dim=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, block: int = FP4_BLOCK) -> torch.Tensor:
    """Plain fp32 dequantisation of a packed FP4 e2m1 weight with per-``block`` scales along the input dim.

    Args:
        packed: ``[out, in/2]`` int8 (or uint8 / ``float4_e2m1fn_x2``), two codes per byte, low nibble first.
        scale: ``[out, ceil(in/block)]`` UE8M0 (or fp32).
    Returns: ``[out, in]`` fp32, ``e2m1(code[i, j]) * scale[i, j // block]``.
    Raises: ValueError on a dtype or scale-shape mismatch.
    """
    fp4x2 = getattr(torch, "float4_e2m1fn_x2", None)
    if packed.dtype not in (torch.int8, torch.uint8) and packed.dtype != fp4x2:
        raise ValueError(f"dequantize_fp4: packed weight dtype {packed.dtype}, expected int8")
    _check_2d("dequantize_fp4", packed)
    out, half = packed.shape
    inp = 2 * half
    want = (out, _ceil_div(inp, block))
    if tuple(scale.shape) != want:
        raise ValueError(f"dequantize_fp4: scale shape {tuple(scale.shape)}, expected {want} for weight [{out}, {inp}]")
    s = scale_to_float(scale).repeat_interleave(block, 1)[:, :inp]
    return unpack_fp4(packed) * s


def _round_e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 code (ties to even mantissa, saturating at 6) of fp32 values already divided by their scale."""
    a = x.abs()
    code = torch.zeros(x.shape, dtype=torch.uint8)
    for i, m in enumerate(_E2M1_MIDPOINTS):
        code += (a > m if i % 2 == 0 else a >= m).to(torch.uint8)
    sign = ((x < 0) & (code > 0)).to(torch.uint8) << 3  # a value rounding to zero is stored as +0
    return code | sign


def quantize_fp4(w: torch.Tensor, block: int = FP4_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a ``[out, in]`` weight (``in`` even) to packed FP4 e2m1 with UE8M0 scales per ``block`` input elements.

    Returns: ``(packed [out, in/2] int8, scale [out, ceil(in/block)] float8_e8m0fnu)``.
    Raises: ValueError for non-finite input, odd ``in`` or a non-2-D weight.
    """
    _check_2d("quantize_fp4", w)
    w = w.to(torch.float32)
    if not bool(torch.isfinite(w).all()):
        raise ValueError("quantize_fp4: weight has NaN or inf values")
    out, inp = w.shape
    if inp % 2:
        raise ValueError(f"quantize_fp4: input dim {inp} must be even (two codes per byte)")
    nb = _ceil_div(inp, block)
    padded = torch.zeros(out, nb * block, dtype=torch.float32)
    padded[:, :inp] = w
    amax = padded.view(out, nb, block).abs().amax(dim=2)
    raw = torch.where(amax > 0, amax / FP4_MAX, torch.ones_like(amax))
    stored = float_to_ue8m0_ceil(raw)
    s_full = stored.to(torch.float32).repeat_interleave(block, 1)[:, :inp]
    codes = _round_e2m1_codes(w / s_full)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.int8), stored


def pack_fp4_codes(codes: torch.Tensor) -> torch.Tensor:
    """Pack ``[..., n]`` 4-bit codes (uint8 values 0..15, n even) into ``[..., n/2]`` int8, low nibble = even element."""
    codes = codes.to(torch.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).view(torch.int8)
