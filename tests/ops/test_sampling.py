"""logsumexp_rows (the sampler's batch-invariant log-probability normaliser) against its float64 reference: vocab
sizes around the kernel's 4 x 512 element sweep, strided and misaligned rows, NaN / +inf / -inf rows, empty inputs,
poisoned outputs, batch invariance, bad inputs."""

import pytest
import torch

import deepinfer_ops
from deepinfer_ops.testing import refs
from deepinfer_ops.testing.compare import Tolerance, assert_close, poison_

# float32 sum of up to 129,280 terms in [0, 1]: relative error of the sum ~ V * 2^-24 at worst, log of it absolute
LSE_TOL = Tolerance(atol=2e-5, rtol=2e-6, min_cosine=0.999999)


@pytest.mark.parametrize("rows,V", [(1, 129280), (7, 2048), (33, 2051), (64, 129280), (3, 1), (5, 3), (2, 4097)])
def test_logsumexp_rows_matches_reference(device, rows, V):
    g = torch.Generator().manual_seed(rows * 31 + V)
    x = (torch.randn(rows, V, generator=g) * 4).to(device)
    out = poison_(torch.empty(rows, device=device))
    torch.ops.deepinfer_ops.logsumexp_rows(out, x)
    assert_close(out, refs.logsumexp_rows_ref(x), LSE_TOL, name="logsumexp_rows")


def test_logsumexp_rows_is_batch_invariant_and_layout_invariant(device):
    """A row's bits do not depend on the other rows, on its position, or on its address (a row stride that breaks
    16-byte alignment takes the scalar load path, which must add in the same order)."""
    g = torch.Generator().manual_seed(5)
    V = 129280
    x = (torch.randn(64, V, generator=g) * 3).to(device)
    full = deepinfer_ops.logsumexp_rows(x)
    for lo, hi in ((0, 1), (17, 18), (5, 38), (63, 64)):
        assert torch.equal(deepinfer_ops.logsumexp_rows(x[lo:hi].clone()), full[lo:hi]), (lo, hi)
    wide = torch.zeros(64, V + 3, device=device)
    wide[:, 1:V + 1] = x
    assert torch.equal(deepinfer_ops.logsumexp_rows(wide[:, 1:V + 1]), full)  # row stride V + 3, 4 bytes off


def test_logsumexp_rows_special_rows(device):
    inf, nan = float("inf"), float("nan")
    x = torch.randn(6, 1000, device=device)
    x[0, 7] = nan
    x[1, 3] = inf
    x[2] = -inf
    x[3, 5] = inf
    x[3, 9] = nan
    x[4, :999] = -inf  # one finite value: lse is that value
    out = deepinfer_ops.logsumexp_rows(x)
    assert torch.isnan(out[0]) and out[1] == inf and out[2] == -inf and torch.isnan(out[3])
    assert out[4] == x[4, 999]
    assert_close(out[5:], refs.logsumexp_rows_ref(x[5:]), LSE_TOL, name="logsumexp_rows")


def test_logsumexp_rows_empty(device):
    assert deepinfer_ops.logsumexp_rows(torch.empty(0, 50, device=device)).shape == (0,)
    assert torch.equal(deepinfer_ops.logsumexp_rows(torch.empty(3, 0, device=device)),
                       torch.full((3,), float("-inf"), device=device))


@pytest.mark.native_errors
def test_logsumexp_rows_bad_inputs(device):
    x = torch.randn(4, 10, device=device)
    with pytest.raises(RuntimeError, match="x must be torch.float32"):
        deepinfer_ops.logsumexp_rows(x.bfloat16())
    with pytest.raises(RuntimeError, match="x must be contiguous in its last dim"):
        deepinfer_ops.logsumexp_rows(x.t())
    with pytest.raises(RuntimeError, match=r"out must be \[4\]"):
        torch.ops.deepinfer_ops.logsumexp_rows(torch.empty(3, device=device), x)
    with pytest.raises(RuntimeError, match="out and x share memory"):
        torch.ops.deepinfer_ops.logsumexp_rows(x[0, :4], x)
    with pytest.raises(ValueError, match=r"x must be \[rows, V\]"):
        deepinfer_ops.logsumexp_rows(x[0])


def test_logsumexp_rows_opcheck(device):
    torch.library.opcheck(torch.ops.deepinfer_ops.logsumexp_rows.default,
                          (torch.empty(3, device=device), torch.randn(3, 77, device=device)))
