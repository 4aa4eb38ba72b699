"""The FP8 GEMM path (``gemm="fp8"``) against the dequantised path: stated tolerances and the comparison.

What differs. Path ``"fp8"`` holds the same weight values as path ``"dequant"`` (FP8 checkpoint weights as stored,
FP4 experts converted exactly for the tiny checkpoint; tested bitwise) but quantises every activation entering a
dense / expert linear to e4m3 per 1x128 group (3 mantissa bits: up to 2^-4 relative rounding per element) and
rounds the expert GEMM outputs to bf16. Each such GEMM's output then carries a relative error of order 1 %, i.e. a
``calc_diff`` (DeepGEMM's ``1 - 2 sum(xy) / sum(x^2 + y^2)``, about half the squared relative error) of order 1e-4,
and about 20 of them compound through the tiny model's 4 blocks + MTP-free head. Routing flips: where two experts'
``score + bias`` are closer than that error the router picks another expert and the row's logits move by tens of per
cent (as in test_deepseek_v4_cuda.py for bf16); those rows are counted and bounded, the others held to the tight
bounds.

Measured on the tiny checkpoint, CPU, prompts of 1 / 37 / 300 / 600 tokens, two seeds each (fp8 in float32 | fp8
in bfloat16, the proxy of the CUDA run; both against dequant in float32):
  * rows routed differently in some layer: 0 .. 10.8 %  |  0 .. 10.7 %;
  * calc_diff of all logits: 9.0e-4 .. 4.5e-3  |  1.1e-3 .. 3.8e-3;
  * calc_diff of the rows routed alike, together: 7.2e-4 .. 9.1e-4  |  7.6e-4 .. 1.1e-3; per row at most
    3.1e-3  |  3.2e-3.
(fp8 in bfloat16 vs fp8 in float32: flips up to 9 %, rows routed alike 1.0e-3 .. 1.3e-3, per row up to 5.3e-3: a
bf16 rounding before the quantisation moves some values across an e4m3 rounding boundary.)
Stated bounds (margins of 2-3x for other seeds / the GPU's roundings): below.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from deepinfer_ops.testing.compare import calc_diff

FP8_MAX_FLIP_SHARE = 0.2  # rows whose expert set differs in some layer
FP8_MAX_CALC_DIFF = 1e-2  # all rows together
FP8_MAX_KEPT_CALC_DIFF = 2.5e-3  # the rows routed alike, together
FP8_MAX_ROW_CALC_DIFF = 1e-2  # each row routed alike


@contextmanager
def record_routes(model):
    """Record the expert choice of every router call: yields a list that receives ``[T, top_k]`` sorted ids."""
    from deepinfer.models.deepseek_v4.moe import MoE

    calls: list[torch.Tensor] = []
    moes = [m for m in model.modules() if isinstance(m, MoE)]

    def wrap(orig):
        def route(*args, **kwargs):
            w, idx = orig(*args, **kwargs)
            calls.append(idx.sort(dim=-1).values.cpu())
            return w, idx
        return route

    for m in moes:
        m.route = wrap(m.route)
    try:
        yield calls
    finally:
        for m in moes:
            del m.route


def per_position(calls: list[torch.Tensor], num_layers: int) -> list[torch.Tensor]:
    """Router calls of one sequence's steps (layer order within each step) -> per layer ``[positions, top_k]``."""
    return [torch.cat(calls[layer::num_layers]) for layer in range(num_layers)]


def check_fp8_close(got: torch.Tensor, ref: torch.Tensor, got_routes, ref_routes, what: str,
                    loose_rows: torch.Tensor | None = None, loose_row_max: float = FP8_MAX_ROW_CALC_DIFF) -> dict:
    """Hold FP8-path logits ``got [T, vocab]`` to the dequant-path ``ref`` with the bounds above; returns the
    measured values. ``loose_rows`` (bool ``[T]``): rows held to ``loose_row_max`` instead of the per-row bound
    (a caller's other discrete choice differs there); they stay in every other bound."""
    got, ref = got.float().cpu(), ref.float().cpu()
    assert got.shape == ref.shape and torch.isfinite(got).all(), what
    flip = torch.zeros(ref.shape[0], dtype=torch.bool)
    for g, r in zip(got_routes, ref_routes, strict=True):
        assert g.shape == r.shape, what
        flip |= (g != r).any(dim=-1)
    keep = ~flip
    # calc_diff's terms per row (float32 products summed in float64: [T, vocab] float64 copies are slow on the CPU)
    xy = (got * ref).sum(-1, dtype=torch.float64)
    sq = (got * got).sum(-1, dtype=torch.float64) + (ref * ref).sum(-1, dtype=torch.float64)
    loose = torch.zeros_like(flip) if loose_rows is None else loose_rows.cpu().bool()
    row_diff = 1 - 2 * xy / sq.clamp(min=1e-300)
    rows, lrows = row_diff[keep & ~loose], row_diff[keep & loose]
    m = {"flip_share": float(flip.float().mean()), "calc_diff": calc_diff(got, ref),
         "kept_calc_diff": float(1 - 2 * xy[keep].sum() / sq[keep].sum()) if bool(keep.any()) else 0.0,
         "kept_row_max": float(rows.max()) if rows.numel() else 0.0}
    if loose_rows is not None:
        m["loose_share"] = float((keep & loose).float().mean())
        m["loose_row_max"] = float(lrows.max()) if lrows.numel() else 0.0
        assert m["loose_row_max"] <= loose_row_max, f"{what}: {m}"
    assert m["flip_share"] <= FP8_MAX_FLIP_SHARE, f"{what}: {m}"
    assert m["calc_diff"] <= FP8_MAX_CALC_DIFF, f"{what}: {m}"
    assert m["kept_calc_diff"] <= FP8_MAX_KEPT_CALC_DIFF, f"{what}: {m}"
    assert m["kept_row_max"] <= FP8_MAX_ROW_CALC_DIFF, f"{what}: {m}"
    # the argmax cannot move on a row routed alike whose top-2 margin exceeds twice the largest absolute error there
    g, r = got[keep], ref[keep]
    if g.shape[0]:
        err = (g - r).abs().amax()
        top2 = r.topk(2, dim=-1).values
        sure = (top2[:, 0] - top2[:, 1]) > 2 * err
        assert bool((g.argmax(-1) == r.argmax(-1))[sure].all()), f"{what}: argmax differs on a sure row"
    return m
