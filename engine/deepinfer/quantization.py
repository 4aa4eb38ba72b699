"""Weight quantisation formats of native DeepSeek-V4 checkpoints: FP8 block scaling and FP4 (e2m1) with UE8M0 scales.

The engine's names for the one implementation in ``deepinfer_ops.formats`` (pure torch, exact, deterministic, batched
``[..., out, in]`` shapes); read that module for the byte layouts, the rounding rules and the errors raised. The names
here are the checkpoint loader's and writer's: ``dequantize_fp8_block`` = ``formats.dequant_fp8_block``,
``dequantize_fp4`` = ``formats.dequant_fp4``, ``FP8_BLOCK`` = ``(128, 128)``, ``FP4_BLOCK`` = 32 elements per scale.

Round-trip error bounds (tested in tests/engine/test_checkpoint.py), per element, ``s`` = the block's scale:
- FP8 e4m3 (UE8M0 or fp32 scale): ``|w - dq(q(w))| <= 2**-4 * |w| + 2**-10 * s``: half an ulp of a 3-bit mantissa is
  at most ``2**-4`` of the value, and below the smallest normal (``2**-6 * s``) the step is the subnormal ``2**-9 * s``.
  No saturation error: ``amax / s <= 448``. With UE8M0, ``s < 2 * amax / 448``.
- FP4 e2m1 (UE8M0 scale): ``|w - dq(q(w))| <= 0.25 * s`` where ``|w| / s < 2`` (grid step 0.5), ``<= 0.5 * s`` in
  [2, 4) and ``<= 1 * s`` in [4, 6]; since ``s < 2 * amax / 6``, the worst case is ``amax / 3``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer_ops import formats as F
from deepinfer_ops.formats import (  # noqa: F401  (re-exported: the checkpoint loader/writer and tests use these)
    FP8_BLOCK,
    UE8M0_DTYPE,
    e2m1_table,
    float_to_ue8m0_ceil,
    pack_fp4_codes,
    quantize_fp4,
    quantize_fp8_block,
    scale_to_float,
    ue8m0_to_float,
    unpack_fp4,
)

FP8_DTYPE = F.FP8_E4M3_DTYPE
FP8_MAX = F.FP8_E4M3_MAX
FP4_MAX = F.FP4_E2M1_MAX
FP4_BLOCK = F.FP4_GROUP

#: e2m1 magnitudes for codes 0..7; code | 8 negates (code 8 is -0.0).
E2M1_VALUES = F.E2M1_VALUES[:8]

dequantize_fp8_block = F.dequant_fp8_block
dequantize_fp4 = F.dequant_fp4
_round_e2m1_codes = F.round_e2m1_codes


@dataclass
class QuantizedWeight:
    """A linear weight kept in its stored format (``load_state_dict(..., dequantize=False)`` or writer input).

    ``fmt``: ``"fp8"`` (``data`` ``[out, in]`` float8_e4m3fn, ``scale`` ``[ceil(out/bm), ceil(in/bn)]``) or ``"fp4"``
    (``data`` ``[out, in/2]`` int8, two e2m1 codes per byte low nibble first, ``scale`` ``[out, ceil(in/32)]``);
    ``scale`` is UE8M0 (``float8_e8m0fnu``) or fp32. ``block``: ``(bm, bn)`` for fp8, ``(1, 32)`` for fp4.
    """

    fmt: str
    data: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    @property
    def shape(self) -> tuple[int, int]:
        out, n = self.data.shape
        return (out, 2 * n) if self.fmt == "fp4" else (out, n)

    def dequantize(self) -> torch.Tensor:
        """The exact fp32 weight ``[out, in]`` (plain ``value * scale`` per block)."""
        if self.fmt == "fp8":
            return dequantize_fp8_block(self.data, self.scale, self.block)
        return dequantize_fp4(self.data, self.scale, self.block[1])

    def to(self, device: torch.device | str) -> "QuantizedWeight":
        return QuantizedWeight(self.fmt, self.data.to(device), self.scale.to(device), self.block)
