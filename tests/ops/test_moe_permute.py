"""``moe_permute`` (the MoE dispatch permutation) against ``refs.moe_permute_ref``: outputs fully written, empty
inputs, bad inputs, huge expert counts and memory that does not scale with them, CUDA limits. Split from
test_gemm.py."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import deepinfer_ops
from deepinfer_ops.testing import refs


@pytest.mark.parametrize("tokens,k,experts", [(1, 6, 256), (7, 2, 4), (64, 6, 256), (1000, 8, 300), (3, 1, 1),
                                              (5000, 6, 64), (9, 4, 0)])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64, torch.int16])
def test_moe_permute_matches_reference(device, tokens, k, experts, idx_dtype):
    """The stable sort by expert, exactly: padding slots (-1, ids >= E, int64 ids that would wrap to a valid int32
    expert) first, then each expert's slots in slot order; outputs poisoned first so unwritten entries show."""
    gen = torch.Generator().manual_seed(tokens * 31 + k + experts)
    idx = torch.randint(-1, max(experts, 1) + 2, (tokens, k), generator=gen)
    idx[0, 0] = -1
    if idx_dtype == torch.int64 and experts > 0:
        idx[-1, -1] = 2**32 + experts - 1  # padding in int64; would be expert E - 1 if wrapped to int32
    if idx_dtype == torch.int16:
        idx = idx.clamp(max=2**15 - 1)
    idx = idx.to(idx_dtype).to(device)
    m_indices, token_of_row, slot_rows = deepinfer_ops.moe_permute(idx, experts)
    want = refs.moe_permute_ref(idx.long(), experts)
    for got, ref, name in zip((m_indices, token_of_row, slot_rows), want, ("m_indices", "token_of_row", "slot_rows")):
        assert got.dtype == ref.dtype and got.shape == ref.shape, name
        assert torch.equal(got.cpu(), ref.cpu()), f"{name} differs from the stable sort"
    # the layout the grouped GEMMs and moe_combine read: each valid slot's row holds its expert and token
    valid = slot_rows >= 0
    rows = slot_rows[valid]
    assert torch.equal(m_indices[rows].long(), idx.long()[valid])
    token_of_slot = torch.arange(tokens, device=device).repeat_interleave(k).view(tokens, k)
    assert torch.equal(token_of_row[rows], token_of_slot[valid])


def test_moe_permute_outputs_fully_written(device):
    idx = torch.tensor([[2, 0, -1], [0, 2, 5]], device=device)
    m_indices = torch.full((6,), 12345, dtype=torch.int32, device=device)
    token_of_row = torch.full((6,), -777, dtype=torch.int64, device=device)
    slot_rows = torch.full((2, 3), -777, dtype=torch.int64, device=device)
    torch.ops.deepinfer_ops.moe_permute(m_indices, token_of_row, slot_rows, idx, 3)
    assert m_indices.tolist() == [-1, -1, 0, 0, 2, 2]
    assert token_of_row.tolist() == [0, 1, 0, 1, 0, 1]
    assert slot_rows.tolist() == [[4, 2, -1], [3, 5, -1]]


def test_moe_permute_empty_and_opcheck(device):
    m, t, s = deepinfer_ops.moe_permute(torch.empty(0, 6, dtype=torch.int64, device=device), 8)
    assert m.shape == (0,) and t.shape == (0,) and s.shape == (0, 6)
    idx = torch.tensor([[3, -1], [0, 3], [7, 0]], device=device)
    args = (torch.empty(6, dtype=torch.int32, device=device), torch.empty(6, dtype=torch.int64, device=device),
            torch.empty(3, 2, dtype=torch.int64, device=device), idx, 4)
    torch.library.opcheck(torch.ops.deepinfer_ops.moe_permute.default, args)


@pytest.mark.native_errors
def test_moe_permute_bad_inputs(device):
    idx = torch.zeros(3, 2, dtype=torch.int64, device=device)
    m, t, s = (torch.empty(6, dtype=torch.int32, device=device), torch.empty(6, dtype=torch.int64, device=device),
               torch.empty(3, 2, dtype=torch.int64, device=device))
    with pytest.raises(TypeError, match="topk_idx must be an integer tensor"):
        deepinfer_ops.moe_permute(idx.float(), 4)
    with pytest.raises(RuntimeError, match="num_experts must be in"):
        torch.ops.deepinfer_ops.moe_permute(m, t, s, idx, -1)
    with pytest.raises(RuntimeError, match="m_indices must be torch.int32"):
        torch.ops.deepinfer_ops.moe_permute(m.long(), t, s, idx, 4)
    with pytest.raises(RuntimeError, match="token_of_row must be \\[6\\]"):
        torch.ops.deepinfer_ops.moe_permute(m, t[:5], s, idx, 4)
    with pytest.raises(RuntimeError, match="slot_rows shape"):
        torch.ops.deepinfer_ops.moe_permute(m, t, s.view(2, 3), idx, 4)
    with pytest.raises(RuntimeError, match="topk_idx must be contiguous"):
        torch.ops.deepinfer_ops.moe_permute(m, t, s, torch.zeros(2, 3, dtype=torch.int64, device=device).t(), 4)
    with pytest.raises(RuntimeError, match="slot_rows and topk_idx share memory"):
        torch.ops.deepinfer_ops.moe_permute(m, t, idx, idx, 4)


@pytest.mark.cuda
def test_moe_permute_cuda_many_experts_and_rows():
    """Few parallel segments (E = 20000: counters for one segment only) and many rows (32 segments)."""
    for tokens, k, experts in ((300, 8, 20000), (40000, 6, 256)):
        idx = torch.randint(-1, experts + 1, (tokens, k), device="cuda")
        got = deepinfer_ops.moe_permute(idx, experts)
        want = refs.moe_permute_ref(idx, experts)
        for g, w in zip(got, want):
            assert torch.equal(g, w)


@pytest.mark.parametrize("tokens,k,experts", [(3, 4, 2**31 - 1), (5, 2, 70000), (20000, 1, 70000), (1, 1, 10**6)])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_moe_permute_cpu_huge_num_experts(tokens, k, experts, idx_dtype):
    """num_experts far above the rows (the CPU sort's O(rows) path) and at the counting sort's switch-over: the
    same stable sort, ids at the int32 / int64 limits included."""
    gen = torch.Generator().manual_seed(tokens + k)
    idx = torch.randint(-3, min(experts, 2**31 - 1), (tokens, k), generator=gen)
    hostile = [-1, experts - 1, experts, 2**31 - 1, -(2**31), experts // 2, experts - 1]
    if idx_dtype == torch.int64:
        hostile += [2**63 - 1, -(2**63), 2**32 + experts - 1]
    flat = idx.view(-1)
    flat[: min(len(hostile), flat.numel())] = torch.tensor(hostile[: flat.numel()])
    idx = idx.to(idx_dtype)
    got = deepinfer_ops.moe_permute(idx, experts)
    want = refs.moe_permute_ref(idx, experts)
    for g, w, name in zip(got, want, ("m_indices", "token_of_row", "slot_rows")):
        assert g.dtype == w.dtype and torch.equal(g, w), name


_PERMUTE_UNDER_MEMORY_LIMIT = """
import resource, sys, torch, deepinfer_ops
from deepinfer_ops.testing import refs
vm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize:")) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.getrlimit(resource.RLIMIT_AS)[1]))
idx = torch.tensor([[2**31 - 2, 5, -1], [0, 2**31 - 2, 7]])
got = deepinfer_ops.moe_permute(idx, 2**31 - 1)
assert all(torch.equal(g, w) for g, w in zip(got, refs.moe_permute_ref(idx, 2**31 - 1)))
print("ok")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc and RLIMIT_AS (Linux)")
def test_moe_permute_cpu_memory_does_not_scale_with_num_experts():
    """E = 2^31 - 1 is a valid num_experts: 6 slots must not need 8 bytes per expert (16 GiB). Run in a child
    process whose address space is capped at 1 GiB above what it has mapped after the imports."""
    proc = subprocess.run([sys.executable, "-c", _PERMUTE_UNDER_MEMORY_LIMIT], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]


_PERMUTE_BAD_CASES = ["3-D topk_idx", "int16 topk_idx", "float topk_idx", "num_experts 2^31", "num_experts -1",
                      "m_indices int64", "token_of_row int32", "slot_rows int32"]


def _permute_bad_args(case):
    shape = (2, 2, 2) if case == "3-D topk_idx" else (3, 2)
    n = 8 if case == "3-D topk_idx" else 6
    idx_dtype = {"int16 topk_idx": torch.int16, "float topk_idx": torch.float32}.get(case, torch.int64)
    experts = {"num_experts 2^31": 2**31, "num_experts -1": -1}.get(case, 4)
    args = [torch.zeros(n, dtype=torch.int64 if case == "m_indices int64" else torch.int32),
            torch.zeros(n, dtype=torch.int32 if case == "token_of_row int32" else torch.int64),
            torch.zeros(shape, dtype=torch.int32 if case == "slot_rows int32" else torch.int64),
            torch.zeros(shape, dtype=idx_dtype)]
    return args, experts


@pytest.mark.native_errors
@pytest.mark.parametrize("case", _PERMUTE_BAD_CASES)
def test_moe_permute_eager_refuses(case):
    """The arguments the meta test below feeds to the fake kernel are refused by the native op too."""
    args, experts = _permute_bad_args(case)
    with pytest.raises(RuntimeError, match="moe_permute"):
        torch.ops.deepinfer_ops.moe_permute(*args, experts)  # eager CPU


@pytest.mark.parametrize("case", _PERMUTE_BAD_CASES)
def test_moe_permute_meta_refuses_what_eager_refuses(case):
    """The fake (meta / trace) kernel checks the arguments as the native op does: a call eager refuses
    (test_moe_permute_eager_refuses) must not pass on meta (it did for a 3-D or float topk_idx, a wrong num_experts
    or wrong output dtypes)."""
    args, experts = _permute_bad_args(case)
    with pytest.raises(RuntimeError, match="moe_permute"):
        torch.ops.deepinfer_ops.moe_permute(*(t.to("meta") for t in args), experts)
    good = [torch.zeros(6, dtype=torch.int32), torch.zeros(6, dtype=torch.int64), torch.zeros(3, 2, dtype=torch.int64),
            torch.zeros(3, 2, dtype=torch.int64)]
    torch.ops.deepinfer_ops.moe_permute(*(t.to("meta") for t in good), 4)  # the valid meta call still passes


@pytest.mark.cuda
@pytest.mark.parametrize("experts", [0, 1, 31, 1550, 1551, 2000, 12799, 24999, 25000])
@pytest.mark.parametrize("tokens,k", [(1, 1), (5, 6), (31, 1), (33, 1), (1001, 7), (9000, 8)])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
def test_moe_permute_cuda_segment_counts_and_limits(experts, tokens, k, idx_dtype):
    """The CUDA kernel against the reference across its shared-memory layouts: segments = min(32, 51200 // (E + 1)
    - 1) takes 32 (E <= 1550), 31, 24, 3 and 1 (E = 25000, ~200 KB of counters); rows below, at and above the 32
    segments and not dividing them; runs of one expert across whole warps (__match_any_sync groups of 32), every
    slot padding, and ids at the int32 / int64 limits."""
    gen = torch.Generator().manual_seed(experts * 7 + tokens + k)
    idx = torch.randint(-2, experts + 2, (tokens, k), generator=gen)
    flat = idx.view(-1)
    flat[flat.numel() // 3: flat.numel() // 3 + 70] = max(experts - 1, 0)  # a long run of one id
    hostile = [2**31 - 1, -(2**31), -1, experts, experts - 1, 0]
    if idx_dtype == torch.int64:
        hostile += [2**63 - 1, -(2**63), 2**32 + max(experts - 1, 0)]
    flat[-len(hostile):] = torch.tensor(hostile)[-flat.numel():]
    idx = idx.to(idx_dtype)
    want = refs.moe_permute_ref(idx, experts)
    out = (torch.full((idx.numel(),), 12345, dtype=torch.int32, device="cuda"),
           torch.full((idx.numel(),), -777, dtype=torch.int64, device="cuda"),
           torch.full(idx.shape, -777, dtype=torch.int64, device="cuda"))
    torch.ops.deepinfer_ops.moe_permute(*out, idx.cuda(), experts)
    for g, w, name in zip(out, want, ("m_indices", "token_of_row", "slot_rows")):
        assert torch.equal(g.cpu(), w), name
    # every slot padding
    got = deepinfer_ops.moe_permute(torch.full((tokens, k), -1, dtype=idx_dtype, device="cuda"), experts)
    assert torch.equal(got[0].cpu(), torch.full((tokens * k,), -1, dtype=torch.int32))
    assert torch.equal(got[1].cpu(), torch.arange(tokens).repeat_interleave(k))
    assert torch.equal(got[2].cpu(), torch.full((tokens, k), -1))


@pytest.mark.cuda
def test_moe_permute_cuda_empty():
    for shape in ((0, 6), (4, 0), (0, 0)):
        m, t, s = deepinfer_ops.moe_permute(torch.zeros(shape, dtype=torch.int32, device="cuda"), 8)
        assert m.shape == (shape[0] * shape[1],) and t.shape == m.shape and s.shape == shape and s.is_cuda


@pytest.mark.cuda
@pytest.mark.native_errors
def test_moe_permute_cuda_limits():
    idx = torch.zeros(2, 3, dtype=torch.int64, device="cuda")
    with pytest.raises(RuntimeError, match="num_experts must be <= 25000 on CUDA, got 25001"):
        deepinfer_ops.moe_permute(idx, 25001)
    with pytest.raises(RuntimeError, match="num_experts must be in"):
        deepinfer_ops.moe_permute(idx, 2**31)
    x = torch.tensor([[1, 0]], device="cuda")
    with pytest.raises(RuntimeError, match="m_indices is on cpu but topk_idx is on cuda"):
        torch.ops.deepinfer_ops.moe_permute(torch.empty(2, dtype=torch.int32), torch.empty(2, dtype=torch.int64,
                                            device="cuda"), torch.empty(1, 2, dtype=torch.int64, device="cuda"), x, 2)
