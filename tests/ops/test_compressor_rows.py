"""compressor_pool_rows / compressor_state_write: the compressor's pooling and state persistence over index lists,
against the fp32 references and against compressor_pool on the gathered slots (bit for bit)."""

from __future__ import annotations

import pytest
import torch

import deepinfer_ops
from deepinfer_ops.testing import refs
from deepinfer_ops.testing.compare import TOLERANCES, assert_close


def _case(device, n, m, hd, overlap, dtype, seed, n_ring=None, new_rows=None, ring_slots=None):
    """Random rings, new rows (a strided slice of a wider projection, as the model passes), and valid index lists."""
    g = torch.Generator().manual_seed(seed)
    C = 2 * hd if overlap else hd
    ring_slots = ring_slots or 3 * m + 5
    n_ring = n_ring if n_ring is not None else 2 * m
    new_rows = new_rows if new_rows is not None else m + 3
    ring_kv = torch.randn(ring_slots, C, generator=g).to(dtype).to(device)
    ring_gate = (torch.randn(ring_slots, C, generator=g) * 2).to(dtype).to(device)
    wide = torch.randn(new_rows, 2 * C + 3, generator=g).to(dtype).to(device)
    new_kv, new_gate = wide[:, :C], wide[:, C + 3:]
    ape = torch.randn(m, C, generator=g).to(device)
    ring_src = torch.randint(0, ring_slots, (n_ring,), generator=g).to(device)
    rows = n_ring + new_rows
    cur = torch.randint(0, rows, (n, m), generator=g).to(device)
    prev = torch.randint(0, rows, (n, m), generator=g).to(device) if overlap else None
    prev_ok = (torch.arange(n) % 3 != 1).long().to(device) if overlap else None
    dst = torch.where(torch.arange(n) % 4 == 2, -1, torch.arange(n)).to(device)
    return ring_kv, ring_gate, new_kv, new_gate, ape, ring_src, cur, prev, prev_ok, dst


def _gathered(ring_kv, ring_gate, new_kv, new_gate, ape, ring_src, cur, prev, prev_ok):
    """The model's former path: gathered slot tensors for compressor_pool."""
    all_kv = torch.cat([ring_kv[ring_src], new_kv])
    all_gate = torch.cat([ring_gate[ring_src], new_gate])
    kv, gate = all_kv[cur], all_gate[cur].float() + ape
    if prev is not None:
        hd = ring_kv.shape[-1] // 2
        ok = (prev_ok != 0).view(-1, 1, 1)
        kv = torch.cat([torch.where(ok, all_kv[prev][..., :hd], 0), kv[..., hd:]], dim=1)
        gate = torch.cat([torch.where(ok, (all_gate[prev].float() + ape)[..., :hd], float("-inf")), gate[..., hd:]],
                         dim=1)
    return kv.contiguous(), gate.contiguous()


@pytest.mark.parametrize("n,m,hd,overlap", [(1, 4, 512, True), (13, 4, 512, True), (6, 128, 512, False),
                                            (5, 4, 128, True), (7, 3, 9, True), (4, 5, 7, False), (2, 1, 64, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pool_rows_matches_reference_and_gathered_pool(device, n, m, hd, overlap, dtype):
    args = _case(device, n, m, hd, overlap, dtype, seed=n * 7 + m + hd)
    out = deepinfer_ops.compressor_pool_rows(*args)
    assert_close(out, refs.compressor_pool_rows_ref(*args), TOLERANCES[dtype], name="compressor_pool_rows")
    # bit for bit the pooling of the gathered slots, on the windows that are written
    kv, gate = _gathered(*args[:-1])
    want = deepinfer_ops.compressor_pool(kv, gate)
    keep = args[-1] >= 0
    assert torch.equal(out[keep], want[keep])
    assert (out[~keep] == 0).all()


def test_pool_rows_no_ring_rows_and_batch_invariance(device):
    args = list(_case(device, 12, 4, 64, True, torch.bfloat16, seed=5, n_ring=0))
    full = deepinfer_ops.compressor_pool_rows(*args)
    for lo, hi in ((0, 1), (3, 7), (11, 12)):
        part = list(args)
        for k in (6, 7, 8, 9):  # cur, prev, prev_ok, dst
            part[k] = args[k][lo:hi].contiguous()
        assert torch.equal(deepinfer_ops.compressor_pool_rows(*part), full[lo:hi])


def test_pool_rows_out_of_range_rows_give_nan(device):
    ring_kv, ring_gate, new_kv, new_gate, ape, ring_src, cur, prev, prev_ok, dst = _case(
        device, 5, 4, 16, True, torch.float32, seed=2)
    n_ring, rows = ring_src.shape[0], ring_src.shape[0] + new_kv.shape[0]
    cur, prev = cur.clamp(min=n_ring), prev.clamp(min=n_ring)  # new rows only, then break two windows
    dst = torch.arange(5, device=device)
    cur[1, 2] = rows  # past the new rows
    ring_src = ring_src.clone()
    ring_src[0] = ring_kv.shape[0]  # a ring slot past the ring
    cur[3, 0] = 0
    out = deepinfer_ops.compressor_pool_rows(ring_kv, ring_gate, new_kv, new_gate, ape, ring_src, cur, prev, prev_ok,
                                             dst)
    assert torch.isnan(out[1]).all() and torch.isnan(out[3]).all()
    assert not torch.isnan(out[[0, 2, 4]]).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_write_matches_reference(device, dtype):
    ring_kv, ring_gate, new_kv, new_gate, _, ring_src, *_ = _case(device, 1, 8, 32, True, dtype, seed=9,
                                                                  n_ring=6, ring_slots=40)
    # written slots disjoint from the ring slots read (as the plan guarantees); some skipped, one past the ring
    read = set(ring_src.tolist())
    free = [s for s in range(ring_kv.shape[0]) if s not in read]
    st_dst = torch.tensor(free[:9] + [-1, ring_kv.shape[0]], device=device)
    st_src = torch.randint(0, ring_src.shape[0] + new_kv.shape[0], (st_dst.shape[0],)).to(device)
    want_kv, want_gate = refs.compressor_state_write_ref(ring_kv, ring_gate, new_kv, new_gate, ring_src, st_src,
                                                         st_dst)
    deepinfer_ops.compressor_state_write(ring_kv, ring_gate, new_kv, new_gate, ring_src, st_src, st_dst)
    assert torch.equal(ring_kv, want_kv) and torch.equal(ring_gate, want_gate)


def test_state_write_bad_source_row_writes_nan(device):
    ring_kv = torch.zeros(6, 4, device=device)
    ring_gate = torch.zeros(6, 4, device=device)
    new = torch.ones(2, 4, device=device)
    deepinfer_ops.compressor_state_write(ring_kv, ring_gate, new, new, torch.tensor([5], device=device),
                                         torch.tensor([1, 7], device=device), torch.tensor([0, 1], device=device))
    assert (ring_kv[0] == 1).all() and torch.isnan(ring_kv[1]).all() and (ring_kv[2:] == 0).all()


@pytest.mark.native_errors
def test_bad_inputs_name_the_tensor(device):
    args = list(_case(device, 3, 4, 16, True, torch.float32, seed=1))
    bad = list(args)
    bad[3] = args[3].bfloat16()
    with pytest.raises(RuntimeError, match="new_gate dtype"):
        deepinfer_ops.compressor_pool_rows(*bad)
    bad = list(args)
    bad[4] = args[4][:2]
    with pytest.raises(RuntimeError, match="ape must be"):
        deepinfer_ops.compressor_pool_rows(*bad)
    bad = list(args)
    bad[8] = None
    with pytest.raises(RuntimeError, match="prev and prev_ok"):
        deepinfer_ops.compressor_pool_rows(*bad)
    bad = list(args)
    bad[9] = args[9][:2]
    with pytest.raises(RuntimeError, match="dst must be"):
        deepinfer_ops.compressor_pool_rows(*bad)
    ring_kv, ring_gate, new_kv, new_gate, _, ring_src = args[:6]
    with pytest.raises(RuntimeError, match="st_dst must be"):
        deepinfer_ops.compressor_state_write(ring_kv, ring_gate, new_kv, new_gate, ring_src,
                                             torch.zeros(3, dtype=torch.long, device=device),
                                             torch.zeros(2, dtype=torch.long, device=device))
    with pytest.raises(RuntimeError, match="ring_gate must be"):
        deepinfer_ops.compressor_state_write(ring_kv, ring_gate[:, :8], new_kv, new_gate, ring_src,
                                             torch.zeros(1, dtype=torch.long, device=device),
                                             torch.zeros(1, dtype=torch.long, device=device))


def test_opcheck(device):
    args = _case(device, 3, 4, 16, True, torch.float32, seed=4)
    hd = args[0].shape[-1] // 2
    out = torch.empty(3, hd, device=device)
    torch.library.opcheck(torch.ops.deepinfer_ops.compressor_pool_rows.default, (out, *args))
    ring_kv, ring_gate, new_kv, new_gate, _, ring_src = args[:6]
    st = torch.tensor([ring_kv.shape[0] - 1], device=device)
    torch.library.opcheck(torch.ops.deepinfer_ops.compressor_state_write.default,
                          (ring_kv.clone(), ring_gate.clone(), new_kv, new_gate, ring_src,
                           torch.zeros(1, dtype=torch.long, device=device), st))
