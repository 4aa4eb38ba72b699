"""DeepSeek-V4.1 quantisation recipe: the reference's numerics, written anew (CPU and GPU).

Formats (golden README, "Conventions"):

* FP8 e4m3 (OCP e4m3fn, max 448) weights ``[out, in]`` with UE8M0 scales ``[ceil(out/32), ceil(in/32)]``
  (one per 32x32 tile);
* FP4 e2m1 routed-expert weights, two codes per byte, low nibble = even column, logical ``[out, in]``, stored
  ``[out, in/2]``, with UE8M0 scales ``[out, in/32]``;
* activations entering an FP8/FP4 GEMM: FP8 per 32 contiguous values with a power-of-two scale
  ``2^ceil(log2(amax / 448))``, ``amax`` floored at 1e-4 (:func:`act_quant_fp8`).

GEMMs (:func:`block_scaled_gemm`) multiply the quantised values block by block along K (32 wide), scale each
block's float32 partial product by its two scales and add the partials in K order in float32, then round to bf16.
On the GPU (:class:`DequantWeight`) the weight is dequantised once to bf16 (exact) and the per-32 quantised
activations go through one bf16 GEMM: the same products, summed in another order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

FP8_MAX = 448.0
FP4_MAX = 6.0
BLOCK = 32
_INV_FP8 = torch.tensor(1.0 / FP8_MAX, dtype=torch.float32)
_INV_FP4 = torch.tensor(1.0 / FP4_MAX, dtype=torch.float32)
#: e2m1 magnitude of each 3-bit code.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1 = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)
# Midpoints between neighbouring magnitudes; at an exact midpoint round-half-even goes to the even code, i.e. up
# at 0.75, 1.75 and 3.5 (codes 2, 4, 6), down at 0.25, 1.25, 2.5 and 5.
_MIDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=torch.float32)
_HALF_UP = torch.tensor([False, True, False, True, False, True, False])
_ON_DEVICE: dict = {}


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A module constant on ``device`` (copied once per device)."""
    if t.device == device:
        return t
    key = (id(t), device)
    c = _ON_DEVICE.get(key)
    if c is None:
        c = _ON_DEVICE[key] = t.to(device)
    return c


def e8m0_to_float(s: torch.Tensor) -> torch.Tensor:
    """UE8M0 scales (``float8_e8m0fnu`` or raw ``uint8``) -> float32 ``2^(b - 127)``."""
    b = s.view(torch.uint8).to(torch.int32)
    return torch.where(b == 0, 2.0 ** -127, (b << 23).view(torch.float32))


def pow2_ceil_scale(amax: torch.Tensor, inv_max: torch.Tensor) -> torch.Tensor:
    """``2^ceil(log2(amax * inv_max))`` in float32, from the exponent and mantissa bits (normal inputs)."""
    v = (amax.float() * inv_max).contiguous()
    bits = v.view(torch.int32)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (e << 23).view(torch.float32)


def _e4m3(x: torch.Tensor) -> torch.Tensor:
    """float32 -> float8_e4m3fn, round to nearest even, saturating at +-448."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def act_quant_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-32 FP8 quantisation of bf16 activations ``[..., K]`` (K % 32 == 0).

    Returns the e4m3 values as float32 ``[..., K]`` and the float32 power-of-two scales ``[..., K/32]``.
    """
    xg = x.float().unflatten(-1, (-1, BLOCK))
    s = pow2_ceil_scale(xg.abs().amax(-1).clamp_min(1e-4), _INV_FP8)
    q = _e4m3(xg / s.unsqueeze(-1)).float()
    return q.flatten(-2), s


def fp8_qdq_(x: torch.Tensor) -> torch.Tensor:
    """In-place FP8 round trip of a bf16 tensor in groups of 32 (window KV): the cached values."""
    q, s = act_quant_fp8(x)
    x.copy_((q.unflatten(-1, (-1, BLOCK)) * s.unsqueeze(-1)).flatten(-2))
    return x


def e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """float32 in [-6, 6] -> 4-bit e2m1 codes (bit 3 = sign), round to nearest even."""
    mag = v.abs().unsqueeze(-1)
    mids = _on(_MIDS, v.device)
    code = (mag > mids).sum(-1) + ((mag == mids) & _on(_HALF_UP, v.device)).sum(-1)
    return code.to(torch.uint8) | (torch.signbit(v).to(torch.uint8) << 3)


def fp4_qdq_(x: torch.Tensor, group: int, e4m3_scale: bool) -> torch.Tensor:
    """In-place FP4 round trip of a bf16 tensor over groups of ``group`` values.

    ``e4m3_scale`` False: power-of-two scale ``2^ceil(log2(amax / 6))`` (indexer q and k, groups of 32);
    True: the scale is ``amax / 6`` rounded to e4m3 (compressed KV, groups of 16), ``amax`` floored at 6 * 2^-9.
    """
    xg = x.float().unflatten(-1, (-1, group))
    amax = xg.abs().amax(-1)
    if e4m3_scale:
        s = _e4m3(amax.clamp_min(6 * 2.0 ** -9) / FP4_MAX).float()
    else:
        s = pow2_ceil_scale(amax.clamp_min(6 * 2.0 ** -126), _INV_FP4)
    v = (xg / s.unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX)
    x.copy_((_on(_E2M1, x.device)[e2m1_codes(v).long()] * s.unsqueeze(-1)).flatten(-2))
    return x


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """FP4 bytes ``[out, in/2]`` (``float4_e2m1fn_x2``, ``int8`` or ``uint8``) -> float32 values ``[out, in]``."""
    b = packed.view(torch.uint8)
    lut = _on(_E2M1, b.device)
    return torch.stack([lut[(b & 0xF).long()], lut[(b >> 4).long()]], -1).flatten(-2)


class QWeight:
    """A quantised linear weight held as its float32 values plus float32 scales.

    ``values [N, K]``: the e4m3 / e2m1 values exactly; ``scales [N, K/32]``: one power-of-two scale per row and
    32-column block (a 32x32 tile's scale repeated over its rows). ``kind`` is ``"fp8"`` or ``"fp4"``.
    """

    def __init__(self, values: torch.Tensor, scales: torch.Tensor, kind: str):
        self.values, self.scales, self.kind = values.contiguous(), scales.contiguous(), kind

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)

    @classmethod
    def from_fp8(cls, w: torch.Tensor, s: torch.Tensor) -> "QWeight":
        n, k = w.shape
        rows = e8m0_to_float(s).repeat_interleave(BLOCK, 0)[:n]
        return cls(w.float(), rows, "fp8")

    @classmethod
    def from_fp4(cls, w: torch.Tensor, s: torch.Tensor) -> "QWeight":
        return cls(unpack_fp4(w), e8m0_to_float(s), "fp4")

    def dequant(self) -> torch.Tensor:
        """float32 ``[N, K]``: values x scales (exact)."""
        return (self.values.unflatten(1, (-1, BLOCK)) * self.scales.unsqueeze(-1)).flatten(1)


class DequantWeight:
    """A :class:`QWeight` dequantised once to bf16 ``weight [N, K]`` on ``device`` (the GPU path). Exact for UE8M0
    scale bytes 3..246: an e4m3 or e2m1 value times such a power of two is a normal bf16 (bytes 247..254 overflow
    and are refused at load; bytes 0..2 give bf16 subnormals, which round). ``kind`` is the source format."""

    def __init__(self, w: QWeight, device: torch.device | str):
        values, scales = w.values.to(device), w.scales.to(device)
        self.weight = QWeight(values, scales, w.kind).dequant().to(torch.bfloat16)
        self.kind = w.kind

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)


def _block_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float32 ``x @ w^T`` of one K block; on the CPU in float64 rounded once, so that a row does not depend on
    the row count or the CPU's BLAS kernel (``layers.exact_linear``)."""
    if x.device.type == "cpu":
        return (x.double() @ w.double().T).float()
    return x @ w.T


def block_scaled_gemm(xq: torch.Tensor, xs: torch.Tensor, w: QWeight) -> torch.Tensor:
    """``[M, K] x [N, K]^T`` over quantised values: per 32-wide K block a float32 product, scaled by the
    activation scale (per row) and the weight scale (per output row), added in K order. Returns float32."""
    acc = torch.zeros(xq.shape[0], w.values.shape[0], dtype=torch.float32, device=xq.device)
    ws, wv = w.scales, w.values
    for k in range(wv.shape[1] // BLOCK):
        sl = slice(k * BLOCK, (k + 1) * BLOCK)
        acc += _block_product(xq[:, sl], wv[:, sl]) * xs[:, k:k + 1] * ws[:, k].unsqueeze(0)
    return acc


def qlinear(x: torch.Tensor, w: QWeight) -> torch.Tensor:
    """The reference's quantised linear: bf16 ``x [..., K]`` -> bf16 ``[..., N]``."""
    shape = x.shape[:-1]
    xq, xs = act_quant_fp8(x.reshape(-1, x.shape[-1]))
    return block_scaled_gemm(xq, xs, w).to(torch.bfloat16).view(*shape, -1)


def dq_linear(x: torch.Tensor, w: DequantWeight) -> torch.Tensor:
    """:func:`qlinear` on the GPU path: bf16 ``x [..., K]`` through the per-32 FP8 round trip (exact in bf16), then
    one bf16 GEMM against the dequantised weight (``F.linear``: cuBLAS accumulates in float32; torch's default lets
    it reduce split-K partials in bf16). Returns bf16 ``[..., N]``."""
    shape = x.shape[:-1]
    xq, xs = act_quant_fp8(x.reshape(-1, x.shape[-1]))
    xd = (xq.unflatten(-1, (-1, BLOCK)) * xs.unsqueeze(-1)).flatten(-2).to(torch.bfloat16)
    return F.linear(xd, w.weight).view(*shape, -1)


def requant_128(w: QWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """Load-time conversion of a 32x32-scaled FP8 weight to V4's 128x128 FP8 blocks (the measured alternative,
    ``docs/deepseek_v41.md``): dequantise, then one ``amax / 448`` float32 scale per 128x128 tile.

    Returns ``(float8_e4m3fn [N, K], float32 [ceil(N/128), ceil(K/128)])``. Lossy wherever a tile's 32x32 scales
    differ: the smaller-scaled sub-tiles lose mantissa bits.
    """
    d = w.dequant()
    n, k = d.shape
    pn, pk = -n % 128, -k % 128
    t = torch.nn.functional.pad(d, (0, pk, 0, pn)).unflatten(0, (-1, 128)).unflatten(2, (-1, 128))
    s = (t.abs().amax((1, 3)) / FP8_MAX).clamp_min(1e-12)
    q = _e4m3(t / s[:, None, :, None]).flatten(2).flatten(0, 1)[:n, :k]
    return q, s
