"""rotary_embedding (V4 interleaved partial RoPE) against its reference."""

import pytest
import torch

import deepinfer_ops
from deepinfer_ops.testing import refs
from deepinfer_ops.testing.compare import TOLERANCES, assert_close


def _cache(rope_dim=64, max_pos=4096, theta=10000.0, device="cpu"):
    inv_freq = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
    return deepinfer_ops.rope_cos_sin_cache(inv_freq, max_pos).to(device)


@pytest.mark.parametrize("num_tokens", [1, 7, 83, 769])
@pytest.mark.parametrize("heads", [None, 1, 8, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inverse", [False, True])
def test_rope_matches_reference(device, num_tokens, heads, dtype, inverse):
    shape = (num_tokens, 512) if heads is None else (num_tokens, heads, 512)
    x = torch.randn(*shape, dtype=dtype, device=device)
    pos = torch.randint(0, 4096, (num_tokens,), device=device)
    cs = _cache(device=device)
    expected = refs.rotary_embedding_ref(x, pos, cs, inverse)
    y = x.clone()
    deepinfer_ops.rotary_embedding(y, pos, cs, inverse)
    assert_close(y, expected)
    assert torch.equal(y[..., :448], x[..., :448]), "non-rope channels must be untouched"


def test_rope_inverse_undoes_rotation(device):
    x = torch.randn(37, 4, 512, device=device)
    pos = torch.arange(37, device=device, dtype=torch.int32) * 50
    cs = _cache(device=device)
    y = deepinfer_ops.rotary_embedding(x.clone(), pos, cs)
    deepinfer_ops.rotary_embedding(y, pos, cs, inverse=True)
    assert_close(y, x, TOLERANCES[torch.float32])


def test_rope_strided_heads_and_small_head_dim(device):
    base = torch.randn(19, 3, 576, device=device, dtype=torch.bfloat16)
    x = base[:, :, :128]  # head stride 576, token stride 1728
    pos = torch.randint(0, 100, (19,), device=device)
    cs = _cache(rope_dim=32, max_pos=100, device=device)
    expected = refs.rotary_embedding_ref(x, pos, cs)
    deepinfer_ops.rotary_embedding(x, pos, cs)
    assert_close(x, expected)
    assert torch.equal(base[:, :, 128:], base[:, :, 128:].clone())


def test_rope_out_of_range_positions_give_nan(device):
    x = torch.randn(3, 2, 512, device=device)
    pos = torch.tensor([0, 4096, -1], device=device)
    y = deepinfer_ops.rotary_embedding(x.clone(), pos, _cache(device=device))
    assert not torch.isnan(y[0]).any()
    assert torch.isnan(y[1:, :, 448:]).all() and not torch.isnan(y[1:, :, :448]).any()


def test_rope_empty(device):
    x = torch.empty(0, 8, 512, device=device)
    deepinfer_ops.rotary_embedding(x, torch.empty(0, dtype=torch.long, device=device), _cache(device=device))


@pytest.mark.native_errors
def test_rope_bad_inputs(device):
    x = torch.randn(4, 512, device=device)
    with pytest.raises(RuntimeError, match="positions must be"):
        deepinfer_ops.rotary_embedding(x, torch.zeros(3, dtype=torch.long, device=device), _cache(device=device))
    with pytest.raises(RuntimeError, match="cos_sin_cache must be torch.float32, got torch.float64"):
        deepinfer_ops.rotary_embedding(x, torch.zeros(4, dtype=torch.long, device=device),
                                       _cache(device=device).double())
    with pytest.raises(RuntimeError, match="x has elements that share memory"):
        deepinfer_ops.rotary_embedding(torch.randn(1, 1, 512, device=device).expand(3, 4, 512),
                                       torch.zeros(3, dtype=torch.long, device=device), _cache(device=device))
    with pytest.raises(RuntimeError, match="rope_dim"):
        deepinfer_ops.rotary_embedding(torch.randn(4, 32, device=device), torch.zeros(4, dtype=torch.long, device=device),
                                       _cache(device=device))


def test_rope_opcheck(device):
    x = torch.randn(7, 4, 512, device=device, dtype=torch.bfloat16)
    pos = torch.arange(7, device=device)
    torch.library.opcheck(torch.ops.deepinfer_ops.rotary_embedding.default, (x, pos, _cache(device=device), False))
