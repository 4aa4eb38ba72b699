"""per_token_group_quant_fp8: bit-exact against the reference (codes and scales), both scale layouts and recipes."""

import pytest
import torch

import deepinfer_ops
from deepinfer_ops.testing import refs
from deepinfer_ops.testing.compare import poison_

SHAPES = [(1, 64), (7, 200), (83, 576), (769, 7168), (5125, 1536)]


def _bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _assert_same_quant(q, s, qr, sr):
    assert q.shape == qr.shape and s.shape == sr.shape
    assert torch.equal(_bits(q).cpu(), _bits(qr).cpu()), "fp8 codes differ from the reference"
    assert torch.equal(s.cpu(), sr.cpu()), f"scales differ: max diff {(s.cpu() - sr.cpu()).abs().max()}"


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("ue8m0", [False, True])
@pytest.mark.parametrize("column_major", [False, True])
def test_quant_bit_exact(device, shape, dtype, ue8m0, column_major):
    g = torch.Generator().manual_seed(shape[0] + shape[1])
    x = (torch.randn(*shape, generator=g) * torch.rand(shape[0], 1, generator=g) * 50).to(dtype).to(device)
    q, s = deepinfer_ops.per_token_group_quant_fp8(x, 128, scale_ue8m0=ue8m0, column_major_scales=column_major)
    if column_major:  # M-major, leading dim padded to a multiple of 4 floats (TMA alignment)
        assert s.stride() == (1, -(-shape[0] // 4) * 4)
    qr, sr = refs.per_token_group_quant_fp8_ref(x, 128, ue8m0)
    _assert_same_quant(q, s, qr, sr)
    if ue8m0:  # powers of two only
        m, _ = torch.frexp(s.cpu())
        assert torch.all(m == 0.5)
    deq = refs.dequant_per_token_group_fp8_ref(q.cpu().view(-1, shape[1]), s.cpu(), 128)
    err = (deq - x.cpu().float()).abs().max() / x.cpu().float().abs().max()
    assert err < 0.07, f"dequantised error {err} too large for e4m3"


def test_quant_poisoned_outputs_fully_written(device):
    x = torch.randn(83, 200, dtype=torch.bfloat16, device=device)
    q = poison_(torch.empty(83, 200, dtype=torch.float8_e4m3fn, device=device))
    s = poison_(torch.empty(83, 2, dtype=torch.float32, device=device))
    torch.ops.deepinfer_ops.per_token_group_quant_fp8(q, s, x, 128, False)
    qr, sr = refs.per_token_group_quant_fp8_ref(x, 128, False)
    _assert_same_quant(q, s, qr, sr)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_quant_group_sizes_and_zeros(device, group_size):
    x = torch.randn(9, 320, dtype=torch.bfloat16, device=device)
    x[3] = 0  # all-zero row: finite scale, zero codes
    q, s = deepinfer_ops.per_token_group_quant_fp8(x, group_size)
    qr, sr = refs.per_token_group_quant_fp8_ref(x, group_size)
    _assert_same_quant(q, s, qr, sr)
    assert torch.all(q[3].float() == 0) and torch.all(torch.isfinite(s[3]))


def test_quant_nan_propagates(device):
    x = torch.randn(2, 256, device=device)
    x[1, 130] = float("nan")
    q, s = deepinfer_ops.per_token_group_quant_fp8(x, 128)
    qr, sr = refs.per_token_group_quant_fp8_ref(x, 128)
    assert torch.isnan(s[1, 1]) and not torch.isnan(s[1, 0]) and not torch.isnan(s[0]).any()
    assert torch.equal(torch.isnan(s.cpu()), torch.isnan(sr.cpu()))
    assert torch.equal(_bits(q).cpu(), _bits(qr).cpu())


def test_quant_strided_and_3d(device):
    base = torch.randn(83, 700, dtype=torch.bfloat16, device=device)
    x = base[:, :576]
    q, s = deepinfer_ops.per_token_group_quant_fp8(x, 128)
    _assert_same_quant(q, s, *refs.per_token_group_quant_fp8_ref(x, 128))
    x3 = torch.randn(2, 5, 576, dtype=torch.bfloat16, device=device)
    q3, s3 = deepinfer_ops.per_token_group_quant_fp8(x3, 128)
    assert q3.shape == (2, 5, 576) and s3.shape == (10, 5)
    _assert_same_quant(q3, s3, *refs.per_token_group_quant_fp8_ref(x3, 128))


def test_quant_empty(device):
    x = torch.empty(0, 7168, dtype=torch.bfloat16, device=device)
    for column_major in (False, True):
        q, s = deepinfer_ops.per_token_group_quant_fp8(x, 128, column_major_scales=column_major)
        assert q.shape == (0, 7168) and q.dtype == torch.float8_e4m3fn
        assert s.shape == (0, 56) and s.dtype == torch.float32


@pytest.mark.native_errors
def test_quant_bad_inputs(device):
    x = torch.randn(4, 256, device=device)
    with pytest.raises(RuntimeError, match="out_scale must be"):
        torch.ops.deepinfer_ops.per_token_group_quant_fp8(
            torch.empty(4, 256, dtype=torch.float8_e4m3fn, device=device), torch.empty(4, 3, device=device), x, 128, False)
    with pytest.raises(RuntimeError, match="out_q must be"):
        torch.ops.deepinfer_ops.per_token_group_quant_fp8(
            torch.empty(4, 256, device=device), torch.empty(4, 2, device=device), x, 128, False)
    with pytest.raises(ValueError, match="group_size"):
        deepinfer_ops.per_token_group_quant_fp8(x, 0)


def test_quant_opcheck(device):
    x = torch.randn(7, 576, dtype=torch.bfloat16, device=device)
    q = torch.empty(7, 576, dtype=torch.float8_e4m3fn, device=device)
    s = torch.empty(5, 7, dtype=torch.float32, device=device).t()
    # test_schema is left out: its checker multiplies the outputs, which torch does not implement for float8.
    torch.library.opcheck(torch.ops.deepinfer_ops.per_token_group_quant_fp8.default, (q, s, x, 128, True),
                          test_utils=("test_faketensor", "test_autograd_registration", "test_aot_dispatch_dynamic"))


def test_group_size_must_be_an_int():
    with pytest.raises(TypeError, match="group_size must be an int"):
        deepinfer_ops.per_token_group_quant_fp8(torch.randn(2, 128), 2.5)
