"""EP dispatch / combine (``deepinfer.parallel.dispatch``) over gloo: results equal the single-process MoE bit for
bit (affine expert functions, which compute every row on its own), in both layouts and both combine orders, with
replicas, padding slots, uneven and zero token counts, FP8 rows with scales; errors raise on every rank."""

from __future__ import annotations

import pytest
import torch

import deepinfer_ops
from deepinfer.parallel import ExpertPlacement, rebalance
from deepinfer.parallel.dispatch import DispatchError, combine, dispatch
from dist_util import run_distributed

FP8 = torch.float8_e4m3fn


def _expert_fn(x: torch.Tensor, experts: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """Expert ``e`` maps a row to ``x * (1 + e / 8) + e / 16`` (elementwise: each row on its own)."""
    e = experts.to(torch.float32).view(-1, 1)
    return (x.float() * (1 + e / 8) + e / 16).to(out_dtype)


def _dequant(xq: torch.Tensor, xs: torch.Tensor) -> torch.Tensor:
    return xq.float() * xs.repeat_interleave(128, dim=1)[:, : xq.shape[1]]


def _case_data(case: dict, rank: int):
    """This rank's tokens (every rank draws all ranks' data from one seed and keeps its own)."""
    g = torch.Generator().manual_seed(case["seed"])
    E, k, D = case["E"], case["k"], case["D"]
    mine = None
    for r, T in enumerate(case["tokens"]):
        x = torch.randn(T, D, generator=g).to(case["dtype"])
        idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else \
            torch.empty(0, k, dtype=torch.int64)
        drop = torch.rand(T, k, generator=g) < case.get("p_pad", 0.0)
        idx = torch.where(drop, -1, idx)
        w = torch.rand(T, k, generator=g)
        if r == rank:
            mine = (x, idx, w)
    return mine


def _reference(x, xs, idx, w, order, out_dtype):
    """The single-process MoE with the same expert functions: slot order (``fused_moe_fp8``'s combine) or
    ascending expert id (the ``dequant`` loop of ``MoE.forward``)."""
    xin = _dequant(x, xs) if xs is not None else x
    T, k = idx.shape
    if order == "slot":
        rows = torch.arange(T * k).view(T, k)
        y = _expert_fn(xin.repeat_interleave(k, dim=0), idx.reshape(-1).clamp(min=0), out_dtype)
        return deepinfer_ops.moe_combine(y, torch.where(idx >= 0, rows, -1), w.float().contiguous(), out_dtype)
    out = torch.zeros(T, x.shape[1], dtype=out_dtype)
    for e in torch.unique(idx[idx >= 0]).tolist():
        tok, slot = torch.where(idx == e)
        h = _expert_fn(xin[tok], torch.full((tok.shape[0],), e), out_dtype) * w[tok, slot, None].to(out_dtype)
        out.index_add_(0, tok, h)
    return out


def _run_case(rank: int, world: int, case: dict) -> None:
    x, idx, w = _case_data(case, rank)
    placement = case["placement"]
    xs = None
    if case.get("fp8"):
        x, xs = deepinfer_ops.per_token_group_quant_fp8(x.float(), 128)
    out_dtype = case["out_dtype"]
    d = dispatch(x, idx, placement, x_scale=xs, layout=case["layout"])
    local = torch.tensor(placement.local_experts(rank), dtype=torch.int64)
    assert sum(d.tokens_per_expert) == (d.x.shape[0] if case["layout"] == "contiguous" else int(d.masked_m.sum()))
    if case["layout"] == "contiguous":
        xin = _dequant(d.x, d.x_scale) if xs is not None else d.x
        y = _expert_fn(xin, local[d.m_indices.long()], out_dtype)
    else:
        S, max_m, D = d.x.shape
        flat = d.x.reshape(S * max_m, D)
        xin = _dequant(flat, d.x_scale.reshape(S * max_m, -1)) if xs is not None else flat
        y = _expert_fn(xin, local.repeat_interleave(max_m), out_dtype).view(S, max_m, D)
        live = torch.arange(max_m).view(1, -1) < d.masked_m.view(-1, 1).long()
        y[~live] = float("nan")  # rows past masked_m must never be read
    out = combine(y, d, w, order=case["order"], out_dtype=out_dtype)
    ref = _reference(x, xs, idx, w, case["order"], out_dtype)
    assert out.dtype == ref.dtype and out.shape == ref.shape, (case["name"], out.shape, ref.shape)
    assert torch.equal(out, ref), (case["name"], rank, (out.float() - ref.float()).abs().max())


def _cases(world: int) -> list[dict]:
    E = 8
    hot = torch.ones(4, E)
    hot[:, 3] = 20
    redundant = rebalance(hot, world, 2 if world == 2 else 4)
    plain = ExpertPlacement.contiguous(E, world)
    base = dict(E=E, k=2, D=64, dtype=torch.float32, out_dtype=torch.float32, seed=1)
    if world == 4:
        return [dict(base, name="w4-uneven", tokens=[3, 0, 6, 1], placement=redundant, layout="contiguous",
                     order="slot", k=3, p_pad=0.2),
                dict(base, name="w4-masked", tokens=[2, 5, 0, 4], placement=redundant, layout="masked",
                     order="expert", seed=2)]
    return [
        dict(base, name="contig-slot", tokens=[5, 3], placement=redundant, layout="contiguous", order="slot"),
        dict(base, name="contig-expert-pad", tokens=[6, 4], placement=plain, layout="contiguous", order="expert", k=3,
             p_pad=0.3, seed=4),
        dict(base, name="masked-bf16-zero-rank", tokens=[7, 0], placement=redundant, layout="masked",
             order="expert", dtype=torch.bfloat16, out_dtype=torch.bfloat16, seed=5),
        dict(base, name="masked-slot-zero-rank0", tokens=[0, 9], placement=plain, layout="masked", order="slot",
             dtype=torch.bfloat16, out_dtype=torch.bfloat16, seed=6),
        dict(base, name="all-empty", tokens=[0, 0], placement=redundant, layout="contiguous", order="slot"),
        dict(base, name="all-empty-masked", tokens=[0, 0], placement=plain, layout="masked", order="expert"),
        dict(base, name="all-padding", tokens=[3, 2], placement=plain, layout="contiguous", order="slot",
             p_pad=1.0),
        dict(base, name="fp8-contig", tokens=[1, 9], placement=redundant, layout="contiguous", order="slot", D=256,
             fp8=True, out_dtype=torch.bfloat16, seed=7),
        dict(base, name="fp8-masked", tokens=[4, 3], placement=redundant, layout="masked", order="slot", D=200,
             fp8=True, out_dtype=torch.bfloat16, seed=8),
    ]


def _body_exact(rank: int, world: int) -> None:
    for case in _cases(world):
        _run_case(rank, world, case)
    # the same step twice gives the same bits (no state kept between steps)
    _run_case(rank, world, _cases(world)[0])


def _body_errors(rank: int, world: int) -> None:
    placement = ExpertPlacement.contiguous(8, world)
    x = torch.randn(4, 64)
    idx = torch.tensor([[0, 1], [0, 2], [0, 3], [0, 5]])
    # capacity: slot 0 of rank 0 gets every rank's 4 tokens
    with pytest.raises(DispatchError, match="max_tokens_per_expert=3 is exceeded: local slot 0 of rank 0"):
        dispatch(x, idx, placement, layout="masked", max_tokens_per_expert=3)
    # a bad input on one rank: both raise, nobody waits
    xs = torch.ones(4, 1) if rank == 0 else torch.ones(3, 1)
    with pytest.raises(DispatchError, match="x_scale must be float32" if rank == 1 else r"rank\(s\) \[1\]"):
        dispatch(x, idx, placement, x_scale=xs)
    # the group still works afterwards
    d = dispatch(x, idx, placement, layout="masked", max_tokens_per_expert=8)
    out = combine(d.x, d, torch.ones(4, 2), order="slot")
    assert torch.equal(out, 2 * x)


def test_dispatch_combine_exact_2_ranks(tmp_path):
    run_distributed(_body_exact, 2, tmp_path)


def test_dispatch_errors_raise_on_every_rank(tmp_path):
    run_distributed(_body_errors, 2, tmp_path)


def test_dispatch_combine_exact_4_ranks(tmp_path):
    run_distributed(_body_exact, 4, tmp_path)


def test_single_process_without_group():
    """One rank needs no process group; the layouts match the single-process MoE."""
    for case in _cases(2)[:1]:
        case = dict(case, placement=ExpertPlacement.contiguous(8, 1), tokens=[5])
        for layout in ("contiguous", "masked"):
            for order in ("slot", "expert"):
                _run_case(0, 1, dict(case, layout=layout, order=order))


def test_bad_arguments_single_process():
    p = ExpertPlacement.contiguous(8, 1)
    x, idx = torch.randn(3, 16), torch.zeros(3, 2, dtype=torch.int64)
    for kwargs, match in [(dict(layout="ragged"), "layout must be"), (dict(x_scale=torch.ones(3, 2)), "x_scale"),
                          (dict(max_tokens_per_expert=4), "layout='masked'")]:
        with pytest.raises(DispatchError, match=match):
            dispatch(x, idx, p, **kwargs)
    with pytest.raises(DispatchError, match="topk_idx must be"):
        dispatch(x, idx[:2], p)
    with pytest.raises(DispatchError, match="num_ranks=2"):
        dispatch(x, idx, ExpertPlacement.contiguous(8, 2))
    d = dispatch(x, idx, p)
    with pytest.raises(ValueError, match="order must be"):
        combine(d.x, d, torch.ones(3, 2), order="random")
    with pytest.raises(ValueError, match="topk_weights must be"):
        combine(d.x, d, torch.ones(2, 2))
