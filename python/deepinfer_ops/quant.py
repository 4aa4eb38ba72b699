"""Quantisation ops: FP8 e4m3 with per-token-group scales (the DeepSeek-V3/V4 activation recipe)."""

from __future__ import annotations

import math

import torch

FP8_E4M3_MAX = 448.0


def scale_buffer(rows: int, groups: int, device, column_major: bool) -> torch.Tensor:
    """An uninitialised float32 ``[rows, groups]`` scale tensor for the quantising ops.

    ``column_major``: strides ``(1, ld)`` with ``ld = rows`` rounded up to a multiple of 4 (a transposed
    ``[groups, ld]`` buffer whose rows are 16-byte aligned: DeepGEMM's "TMA-aligned" activation-scale layout). The
    CUDA FP8 GEMMs load it with TMA as it is; without the padding they copy it first when ``rows % 4 != 0``.
    Otherwise row-major ``[rows, groups]``.

    Raises:
        TypeError naming ``rows`` / ``groups`` when not an int (a ``torch.SymInt`` under tracing is accepted);
        ValueError naming it when negative (the padded view would otherwise turn ``rows = -1`` into an empty
        ``[0, groups]`` tensor).
    Source: DeepGEMM's sm90 activation-scale layout (M-major, M padded to 16 bytes for the TMA loads).
    """
    for name, v in (("rows", rows), ("groups", groups)):
        if isinstance(v, bool) or not isinstance(v, (int, torch.SymInt)):
            raise TypeError(f"scale_buffer: {name} must be an int, got {type(v).__name__}")
        if isinstance(v, int) and v < 0:
            raise ValueError(f"scale_buffer: {name} must be >= 0, got {v}")
    if column_major:
        ld = -(-rows // 4) * 4
        return torch.empty((groups, ld), dtype=torch.float32, device=device)[:, :rows].t()
    return torch.empty((rows, groups), dtype=torch.float32, device=device)


def per_token_group_quant_fp8(
    x: torch.Tensor,
    group_size: int = 128,
    scale_ue8m0: bool = False,
    column_major_scales: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise ``x`` to float8_e4m3fn with one scale per ``group_size`` consecutive elements of a row.

    For each row r and group g (elements ``[g*group_size, min(K, (g+1)*group_size))``; the last group may be
    partial): ``amax = max|x|``, ``scale = max(amax, 1e-10) / 448`` (with ``scale_ue8m0``, rounded up to the next
    power of two: UE8M0-representable), ``q = e4m3(clamp(x * (1 / scale), -448, 448))`` (the reciprocal rounded once per group) with round-to-nearest-even.
    NaN inputs propagate (NaN scale and NaN codes). CPU, CUDA and ``testing.refs`` agree bit for bit.

    Args:
        x: ``[..., K]`` float32/bfloat16/float16, last dim contiguous.
        group_size: elements per scale, default 128.
        scale_ue8m0: round scales up to powers of two (stored as float32).
        column_major_scales: return scales M-major, strides ``(1, ld)``, ``ld = rows`` rounded up to a multiple of
            4 (:func:`scale_buffer`): the layout the CUDA FP8 GEMMs and DeepGEMM read directly.
    Returns:
        ``(q, scale)``: q ``[..., K]`` float8_e4m3fn; scale float32 ``[rows, ceil(K / group_size)]`` where rows is
        the product of the leading dims (0 rows give empty tensors of these shapes).
    Raises:
        RuntimeError naming the argument at fault.
    Source: DeepSeek-V3 technical report (fine-grained FP8 quantisation), DeepGEMM's activation layout.
    """
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"per_token_group_quant_fp8: group_size must be an int, got {type(group_size).__name__}")
    if group_size <= 0:
        raise ValueError(f"group_size must be > 0, got {group_size}")
    if x.dim() == 0:
        raise ValueError("x must have at least 1 dim")
    k = x.shape[-1]
    rows = math.prod(x.shape[:-1])
    groups = -(-k // group_size)
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = scale_buffer(rows, groups, x.device, column_major_scales)
    torch.ops.deepinfer_ops.per_token_group_quant_fp8(q, scale, x, group_size, scale_ue8m0)
    return q, scale
