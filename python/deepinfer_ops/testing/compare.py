"""Comparison tiers for tests: exact, tolerance (abs + rel + cosine, NaN positions), quantized (calc_diff).

Tolerances live in one named table per dtype (TOLERANCES), never as inline literals in tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float
    min_cosine: float


# Per output dtype, for an op computed in fp32 and rounded once, compared with the fp32 reference
# rounded to the same dtype (one rounding step apart at most).
TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(atol=1e-5, rtol=1e-5, min_cosine=0.999999),
    torch.bfloat16: Tolerance(atol=1e-2, rtol=1.6e-2, min_cosine=0.9999),
    torch.float16: Tolerance(atol=1e-3, rtol=2e-3, min_cosine=0.99999),
}

# Attention lse against an fp32 reference, as FlashMLA's tests check it: exact to fp32 rounding (engines merging
# attention states by lse need it so).
LSE_TOLERANCE = Tolerance(atol=1e-6, rtol=2.0 ** -15, min_cosine=0.999999)

# calc_diff thresholds per recipe (DeepGEMM's metric).
CALC_DIFF_MAX = {"fp8": 1e-3}

# Attention kernels that round the softmax weights p_j to bf16 before P.V (as FlashMLA does) err by up to
# 2u * sum_j p_j |v_j| (u = 2^-8, bf16 unit roundoff; first order: u from the weights, u from renormalising with the
# rounded weights). With large |v| and cancellation this exceeds the plain bf16 atol, so such checks add
# BF16_WEIGHTS_REL * sum_j p_j |v_j| per element (see assert_close's extra_atol).
BF16_WEIGHTS_REL = 2.0 ** -7


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: Tolerance | None = None, name: str = "out",
                 extra_atol: torch.Tensor | None = None) -> None:
    """Assert shape equality, identical NaN/inf positions and |a-e| <= atol + rtol|e| (+ extra_atol, a non-negative
    per-element bound broadcastable to ``expected``, when given) everywhere, plus cosine similarity >= min_cosine.
    On failure the message names the worst element."""
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    tol = tol or TOLERANCES[expected.dtype if expected.dtype in TOLERANCES else torch.float32]
    a, e = actual.detach().float().cpu(), expected.detach().float().cpu()
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    assert torch.equal(nan_a, nan_e), f"{name}: NaN positions differ ({int(nan_a.sum())} vs {int(nan_e.sum())})"
    inf_a, inf_e = torch.isinf(a), torch.isinf(e)
    assert torch.equal(inf_a, inf_e) and torch.equal(a[inf_a], e[inf_e]), f"{name}: inf positions differ"
    ok = ~(nan_e | inf_e)
    extra = None
    if extra_atol is not None:
        extra = torch.broadcast_to(extra_atol.detach().float().cpu(), e.shape)[ok]
        assert bool((extra >= 0).all()), f"{name}: extra_atol must be non-negative"
    a, e = a[ok], e[ok]
    if a.numel() == 0:
        return
    err = (a - e).abs()
    bound = tol.atol + tol.rtol * e.abs()
    if extra is not None:
        bound = bound + extra
    bad = err > bound
    if bool(bad.any()):
        i = int(torch.argmax(err - bound))
        raise AssertionError(
            f"{name}: {int(bad.sum())}/{a.numel()} elements out of tolerance; worst at flat index {i}: "
            f"actual {a[i].item()!r} expected {e[i].item()!r} (atol {tol.atol}, rtol {tol.rtol}"
            + (f", extra_atol {extra[i].item()!r})" if extra is not None else ")"))
    a64, e64 = a.double(), e.double()
    denom = (a64.norm() * e64.norm()).item()
    if denom > 0:
        cos = float((a64 * e64).sum().item() / denom)
        assert cos >= tol.min_cosine, f"{name}: cosine similarity {cos} < {tol.min_cosine}"


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepGEMM's error metric ``1 - 2 sum(xy) / sum(x^2 + y^2)`` in float64 (0 when equal)."""
    x, y = x.double(), y.double()
    denom = (x * x + y * y).sum()
    if denom == 0:
        return 0.0
    return float(1 - 2 * (x * y).sum() / denom)


def poison_cuda_scratch_(device: torch.device | str = "cuda", block_bytes: tuple[int, ...] = (
        256 << 10, 256 << 10, 256 << 10, 256 << 10, 4 << 20, 32 << 20, 256 << 20)) -> None:
    """Poison the memory an op's next scratch buffers (``at::empty`` workspaces) will get: blocks of the given sizes
    are allocated from torch's CUDA caching allocator, filled with 0xFF bytes (NaN in every float format, -1 in
    every signed integer, huge pointers) and freed again, so the allocator hands those cached blocks out next.
    Anything an op reads from its workspace without having written it first then shows (NaN results, or a crash
    on a garbage pointer) instead of silently reading the zeros of fresh memory. Call it right before the op.
    """
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    blocks = [torch.full((n,), 0xFF, dtype=torch.uint8, device=device) for n in block_bytes]
    torch.cuda.synchronize(device)
    del blocks


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill ``t`` with NaN (floats, including fp8) or the max value (integers) so unwritten elements show."""
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        t.view(torch.uint8).fill_(0x7F)
    elif t.is_floating_point():
        t.fill_(float("nan"))
    else:
        t.fill_(torch.iinfo(t.dtype).max)
    return t
