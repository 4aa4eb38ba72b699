"""The one top-k tie rule (higher score first, then lower index) in the lightning indexer and the MoE router."""

from __future__ import annotations

import pytest
import torch

from deepinfer.models import TINY_CONFIG, DeepseekV4Config, init_parameters
from deepinfer.models.deepseek_v4.config import HASH_MOE, MOE
from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM, indexer_select


def _reference_select(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    out = torch.zeros_like(visible)
    for r in range(scores.shape[0]):
        cand = [(-float(scores[r, j]), j) for j in range(scores.shape[1]) if visible[r, j]]
        for _, j in sorted(cand)[:k]:
            out[r, j] = True
    return out


def test_indexer_select_breaks_ties_by_lower_index():
    scores = torch.tensor([[0.5, 0.0, 0.0, 0.0, -0.2, 0.0]])
    sel, ties = indexer_select(scores, torch.ones(1, 6, dtype=torch.bool), 3)
    assert sel.tolist() == [[True, True, True, False, False, False]] and ties == 1
    vis = torch.tensor([[True, False, True, True, True, True]])
    sel, _ = indexer_select(scores, vis, 3)
    assert sel.tolist() == [[True, False, True, True, False, False]]
    # fewer visible entries than k: exactly the visible ones, never a future entry
    vis = torch.tensor([[True, True, False, False, False, False]])
    sel, ties = indexer_select(scores, vis, 3)
    assert sel.tolist() == [[True, True, False, False, False, False]] and ties == 0


@pytest.mark.parametrize("rows, n, k", [(7, 83, 16), (5, 17, 16), (3, 9, 9), (4, 1, 5)])
def test_indexer_select_matches_brute_force_with_many_ties(rows, n, k):
    g = torch.Generator().manual_seed(rows * 1000 + n)
    scores = torch.randint(-2, 3, (rows, n), generator=g).float()  # integer scores: ties everywhere
    vis = torch.rand(rows, n, generator=g) < 0.8
    sel, _ = indexer_select(scores, vis, k)
    assert torch.equal(sel, _reference_select(scores, vis, k))


@pytest.fixture(scope="module")
def model():
    c = DeepseekV4Config.from_dict(TINY_CONFIG)
    return DeepseekV4ForCausalLM.from_parameters(c, init_parameters(c, 0))


def test_router_ties_pick_lower_expert_ids(model):
    c = model.config
    layer = next(i for i, t in enumerate(c.mlp_layer_types) if t == MOE)
    moe = model.layers[layer].ffn
    x = torch.randn(5, c.hidden_size, generator=torch.Generator().manual_seed(0))
    saved_w, saved_b = moe.gate.weight.clone(), moe.gate.bias.clone()
    try:
        with torch.no_grad():
            moe.gate.weight.copy_(saved_w[:1].expand_as(saved_w))  # every expert scores the same
            moe.gate.bias.zero_()
            w, idx = moe.route(x, torch.zeros(5, dtype=torch.long))
            assert idx.tolist() == [list(range(c.num_experts_per_tok))] * 5
            assert torch.allclose(w.sum(-1), torch.full((5,), c.routed_scaling_factor))
            moe.gate.bias[[6, 3, 5]] = 1.0  # three tied winners: the two lowest ids, higher score first
            _, idx = moe.route(x, torch.zeros(5, dtype=torch.long))
            assert idx.tolist() == [[3, 5]] * 5
    finally:
        with torch.no_grad():
            moe.gate.weight.copy_(saved_w)
            moe.gate.bias.copy_(saved_b)


def test_router_selection_uses_bias_but_weights_do_not(model):
    c = model.config
    layer = next(i for i, t in enumerate(c.mlp_layer_types) if t == MOE)
    moe = model.layers[layer].ffn
    x = torch.randn(9, c.hidden_size, generator=torch.Generator().manual_seed(1))
    w, idx = moe.route(x, torch.zeros(9, dtype=torch.long))
    scores = torch.nn.functional.softplus(x @ moe.gate.weight.T).sqrt()
    biased = scores + moe.gate.bias
    ref_idx = torch.stack([torch.tensor(sorted(range(c.n_routed_experts), key=lambda e: (-float(biased[r, e]), e))[:c.num_experts_per_tok]) for r in range(9)])
    assert torch.equal(idx, ref_idx)
    ref_w = scores.gather(1, ref_idx)
    assert torch.allclose(w, ref_w / ref_w.sum(-1, keepdim=True) * c.routed_scaling_factor)


def test_hash_router_uses_tid2eid(model):
    c = model.config
    layer = next(i for i, t in enumerate(c.mlp_layer_types) if t == HASH_MOE)
    moe = model.layers[layer].ffn
    ids = torch.tensor([0, 5, 129279, 5])
    _, idx = moe.route(torch.randn(4, c.hidden_size), ids)
    assert torch.equal(idx, moe.gate.tid2eid[ids])


@pytest.mark.parametrize("rows,n,width", [(1, 1, 1), (7, 20, 32), (5, 33, 33), (3, 0, 4)])
def test_pack_selected_equals_the_sorted_ids(rows, n, width):
    from deepinfer.models.deepseek_v4.compressor import pack_selected

    g = torch.Generator().manual_seed(rows * n + width)
    keep = torch.rand(rows, n, generator=g) < 0.6
    if rows > 1 and n:
        keep[0] = True
        keep[1] = False
    got = pack_selected(keep, width)
    ids = torch.where(keep, torch.arange(n), n)
    want = torch.cat([ids, torch.full((rows, width - n), n)], dim=1).sort(dim=1).values
    assert torch.equal(got, want)
