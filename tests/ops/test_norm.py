"""rms_norm against its fp32 reference: odd sizes, dtypes, strided/empty inputs, poisoned outputs, batch invariance."""

import pytest
import torch

import deepinfer_ops
from deepinfer_ops.testing import refs
from deepinfer_ops.testing.compare import assert_close, poison_

ROWS = [1, 7, 83, 769, 5125]
HIDDEN = [64, 200, 7168]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weighted", [True, False])
def test_rms_norm_matches_reference(device, rows, hidden, dtype, weighted):
    if rows * hidden > 5_000_000 and dtype != torch.bfloat16:
        pytest.skip("largest shape covered in bf16 only (keeps the CPU suite fast)")
    g = torch.Generator().manual_seed(rows * 131 + hidden)
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype).to(device)
    w = torch.randn(hidden, generator=g).to(dtype).to(device) if weighted else None
    out = poison_(torch.empty_like(x))
    deepinfer_ops.rms_norm(x, w, 1e-6, out=out)
    assert_close(out, refs.rms_norm_ref(x, w, 1e-6), name="rms_norm")


def test_rms_norm_fp32_weight_and_3d(device):
    x = torch.randn(3, 5, 512, dtype=torch.bfloat16, device=device)
    w = torch.randn(512, dtype=torch.float32, device=device)
    assert_close(deepinfer_ops.rms_norm(x, w, 1e-6), refs.rms_norm_ref(x, w, 1e-6))


def test_rms_norm_row_strided_input(device):
    base = torch.randn(83, 7168 + 64, dtype=torch.bfloat16, device=device)
    x = base[:, :7168]  # rows 7232 elements apart
    out = poison_(torch.empty(83, 7168 + 32, dtype=torch.bfloat16, device=device))[:, :7168]
    deepinfer_ops.rms_norm(x, None, 1e-6, out=out)
    assert_close(out, refs.rms_norm_ref(x, None, 1e-6))


def test_rms_norm_empty(device):
    x = torch.empty(0, 4096, dtype=torch.bfloat16, device=device)
    y = deepinfer_ops.rms_norm(x, torch.ones(4096, dtype=torch.bfloat16, device=device), 1e-6)
    assert y.shape == (0, 4096)


def test_rms_norm_batch_invariant(device):
    """A row's output is bitwise the same alone and inside batches of any size."""
    torch.manual_seed(0)
    big = torch.randn(4096, 7168, dtype=torch.bfloat16, device=device)
    w = torch.randn(7168, dtype=torch.bfloat16, device=device)
    full = deepinfer_ops.rms_norm(big, w, 1e-6)
    for n in (1, 7, 83):
        part = deepinfer_ops.rms_norm(big[:n].clone(), w, 1e-6)
        assert torch.equal(part, full[:n]), f"rows 0..{n} differ between batch {n} and batch 4096"
    alone = deepinfer_ops.rms_norm(big[4095:4096].clone(), w, 1e-6)
    assert torch.equal(alone, full[4095:4096])


@pytest.mark.native_errors
def test_rms_norm_bad_inputs(device):
    x = torch.randn(4, 64, device=device)
    with pytest.raises(RuntimeError, match="weight must be"):
        deepinfer_ops.rms_norm(x, torch.ones(32, device=device), 1e-6)
    with pytest.raises(RuntimeError, match="input must be float32"):
        deepinfer_ops.rms_norm(x.to(torch.int32), None, 1e-6)
    with pytest.raises(RuntimeError, match="out shape"):
        deepinfer_ops.rms_norm(x, None, 1e-6, out=torch.empty(4, 32, device=device))
    with pytest.raises(RuntimeError, match="out has elements that share memory"):
        deepinfer_ops.rms_norm(x, None, 1e-6, out=torch.empty(1, 64, device=device).expand(4, 64))
    with pytest.raises(RuntimeError, match="contiguous in its last dim"):
        deepinfer_ops.rms_norm(torch.randn(64, 4, device=device).t(), None, 1e-6)


def test_rms_norm_opcheck(device):
    x = torch.randn(7, 576, dtype=torch.bfloat16, device=device)
    w = torch.randn(576, dtype=torch.bfloat16, device=device)
    torch.library.opcheck(torch.ops.deepinfer_ops.rms_norm.default, (torch.empty_like(x), x, w, 1e-6))
    torch.library.opcheck(torch.ops.deepinfer_ops.rms_norm.default, (torch.empty_like(x), x, None, 1e-6))


@pytest.mark.native_errors
def test_rms_norm_partial_overlap_refused_in_place_allowed(device):
    """out sharing some (not all) elements with input would read rows already overwritten: refused by name; the
    exact same tensor (in place) is allowed and equals the out-of-place result."""
    buf = torch.randn(5, 64, device=device)
    w = torch.ones(64, device=device)
    with pytest.raises(RuntimeError, match="out and input share memory partially"):
        deepinfer_ops.rms_norm(buf[:4], w, 1e-6, out=buf[1:5])
    x = torch.randn(7, 64, device=device)
    ref = deepinfer_ops.rms_norm(x.clone(), w, 1e-6)
    deepinfer_ops.rms_norm(x, w, 1e-6, out=x)
    assert torch.equal(x, ref)
