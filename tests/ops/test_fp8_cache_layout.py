"""The MODEL1 FP8 KV cache against FlashMLA's quantiser recipe, byte for byte, both ways.

FlashMLA's quantiser (tests/quant.py in deepseek-ai/FlashMLA, MODEL1_FP8Sparse) is re-derived here from its
documented rule, not copied: per block of block_size tokens, first every token's 448 e4m3 codes and 64 bf16 RoPE
dims (576 bytes), then every token's 7 UE8M0 scale bytes and a pad byte; the block's bytes padded up to a multiple
of 576; per tile of 64 dims ``scale = 2 ** ceil(log2(max(amax / 448, 1e-4)))`` and codes ``e4m3(x / scale)``. Its
pad bytes are left unset, so they are not compared. Tiles: random, tiny-amax (the 1e-4 floor) and NaN (scale byte
0xFF, NaN codes). The recipe's NaNs take a sign bit that depends on the math library (the CPU's vectorised pow gives
negative NaNs): e4m3 NaN codes 0x7F and 0xFF compare equal; ours are always 0x7F. Tiles holding +-inf are checked
against our reference only (test_attention.py), for the same reason (inf / inf).
"""

from __future__ import annotations

import pytest
import torch

import deepinfer_ops
from deepinfer_ops.testing import refs

NOPE, ROW, ENTRY = 448, 576, 584


def flashmla_block_bytes(kv: torch.Tensor) -> torch.Tensor:
    """The recipe above over bf16 ``[num_blocks, block_size, 512]``: uint8 ``[num_blocks, padded block bytes]``."""
    nb, bs, _ = kv.shape
    padded = -(-bs * ENTRY // ROW) * ROW
    x = kv[..., :NOPE].float().reshape(nb, bs, 7, 64)
    inv = torch.pow(2.0, torch.clamp_min(x.abs().amax(-1) / 448.0, 1e-4).log2().ceil())
    codes = (x / inv.unsqueeze(-1)).to(torch.float8_e4m3fn).view(torch.uint8).reshape(nb, bs, NOPE)
    rows = torch.cat([codes, kv[..., NOPE:].contiguous().view(torch.uint8)], dim=-1)
    scales = torch.zeros(nb, bs, ENTRY - ROW, dtype=torch.uint8)
    scales[..., :7] = inv.to(torch.float8_e8m0fnu).view(torch.uint8)
    out = torch.zeros(nb, padded, dtype=torch.uint8)
    out[:, :bs * ROW] = rows.reshape(nb, bs * ROW)
    out[:, bs * ROW:bs * ENTRY] = scales.reshape(nb, -1)
    return out


def _nan_codes_positive(b: torch.Tensor, bs: int) -> torch.Tensor:
    """``b`` ([num_blocks, bytes]) with its e4m3 NaN codes 0xFF written as 0x7F (the row bytes' code part only)."""
    b = b.clone()
    codes = b[:, :bs * ROW].view(b.shape[0], bs, ROW)[..., :NOPE]
    codes[codes == 0xFF] = 0x7F
    return b


def _pad_mask(nb: int, bs: int, padded: int) -> torch.Tensor:
    """The bytes the recipe sets: all but each token's pad byte and the block's tail."""
    keep = torch.zeros(nb, padded, dtype=torch.bool)
    keep[:, :bs * ENTRY] = True
    keep[:, bs * ROW + 7:bs * ENTRY:8] = False
    return keep


def _rows(nb: int, bs: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    t = nb * bs
    kv = torch.randn(t, 512, generator=g) * torch.logspace(-4, 3, t).unsqueeze(1)
    kv[0, :64] = 0.0  # amax 0: the floor's scale 2^-13, zero codes
    kv[1, 64:128] *= 1e-6  # tiny amax: the floor again, codes in e4m3's subnormals
    kv[2, 128:192] = 3e-3 * torch.randn(64, generator=g)  # amax / 448 just below and above the floor
    kv[3, 192:256] = 0.0448
    kv[4, 300] = float("nan")  # a NaN tile
    kv[5, 0:64] = float("nan")
    return kv.bfloat16().view(nb, bs, 512)


@pytest.mark.parametrize("nb,bs", [(3, 64), (2, 128), (4, 7), (1, 32)])
def test_write_gives_flashmla_bytes(device, nb, bs):
    """Our kernel writes, into a cache allocated FlashMLA's way (blocks padded to a multiple of 576 bytes), the
    recipe's bytes."""
    kv = _rows(nb, bs, seed=nb * 100 + bs)
    want = flashmla_block_bytes(kv)
    padded = want.shape[1]
    base = torch.full((nb, padded), 0xA5, dtype=torch.uint8, device=device)
    cache = base[:, :bs * ENTRY].view(nb, bs, ENTRY)
    slots = torch.randperm(nb * bs, generator=torch.Generator().manual_seed(bs))
    deepinfer_ops.kv_cache_write_fp8(cache, kv.view(-1, 512)[slots].to(device), slots.to(device))
    keep = _pad_mask(nb, bs, padded)
    got = base.cpu()
    diff = (_nan_codes_positive(got, bs) != _nan_codes_positive(want, bs)) & keep
    assert not diff.any(), (f"{int(diff.sum())} bytes differ from FlashMLA's recipe, first at (block, byte) "
                            f"{tuple(diff.nonzero()[0].tolist())}")
    assert torch.all(got[:, bs * ROW + 7:bs * ENTRY:8] == 0), "pad bytes must be zero"
    assert torch.all(got[:, bs * ENTRY:] == 0xA5), "bytes past the block's entries must stay untouched"
    # the reference writes the same bytes
    ref = refs.kv_cache_write_fp8_ref(torch.zeros(nb, bs, ENTRY, dtype=torch.uint8), kv.view(-1, 512)[slots],
                                      slots)
    assert torch.equal(ref.view(nb, -1), got[:, :bs * ENTRY])


def test_flashmla_bytes_read_back(device):
    """A cache holding the recipe's bytes (pad bytes random, as FlashMLA leaves them) dequantises to codes x scale,
    and sparse MQA over it equals sparse MQA over those decoded rows as a bf16 cache."""
    nb, bs = 4, 64
    kv = _rows(nb, bs, seed=7)
    kv.view(-1, 512)[4:6] = 1.0  # no NaN rows here: attention over them would be NaN everywhere
    raw = flashmla_block_bytes(kv)
    keep = _pad_mask(nb, bs, raw.shape[1])
    raw = torch.where(keep, raw, torch.randint(0, 256, raw.shape, dtype=torch.uint8))
    cache = raw.to(device)[:, :bs * ENTRY].view(nb, bs, ENTRY)
    slots = torch.arange(nb * bs, device=device)
    deq = deepinfer_ops.kv_cache_dequant_fp8(cache, slots).cpu()
    x = raw[:, :bs * ROW].view(nb, bs, ROW)
    scale = raw[:, bs * ROW:bs * ENTRY].view(nb, bs, 8)[..., :7].view(torch.float8_e8m0fnu).float()
    nope = x[..., :NOPE].contiguous().view(torch.float8_e4m3fn).float().view(nb, bs, 7, 64) * scale.unsqueeze(-1)
    want = torch.cat([nope.view(nb, bs, NOPE), x[..., NOPE:].contiguous().view(torch.bfloat16).float()], -1)
    assert torch.equal(deq.float(), want.view(-1, 512))
    g = torch.Generator().manual_seed(8)
    q = torch.randn(2, 1, 64, 512, generator=g).bfloat16().to(device)
    idx = torch.randint(0, nb * bs, (2, 1, 100), generator=g, dtype=torch.int32).to(device)
    out8, lse8 = deepinfer_ops.sparse_mqa_decode(q, cache, idx, 512 ** -0.5)
    out16, lse16 = deepinfer_ops.sparse_mqa_decode(q, deq.view(nb, bs, 512).to(device), idx, 512 ** -0.5)
    assert torch.equal(out8.cpu(), out16.cpu()) and torch.equal(lse8.cpu(), lse16.cpu())


@pytest.mark.native_errors
def test_fp8_cache_strides_are_checked(device):
    """A MODEL1 cache whose blocks overlap, or whose token stride is not 584 bytes, is refused, naming the tensor."""
    base = torch.zeros(3, 4 * ENTRY, dtype=torch.uint8, device=device)
    overlapping = base.view(-1)[:2 * 4 * ENTRY].as_strided((3, 4, ENTRY), (ENTRY, ENTRY, 1))
    kv = torch.zeros(1, 512, dtype=torch.bfloat16, device=device)
    slots = torch.zeros(1, dtype=torch.int64, device=device)
    with pytest.raises(RuntimeError, match=r"kv_cache_write_fp8: kv_cache \(FP8 MODEL1\) must hold whole blocks"):
        torch.ops.deepinfer_ops.kv_cache_write_fp8(overlapping, kv, slots)
    q = torch.zeros(1, 1, 8, 512, dtype=torch.bfloat16, device=device)
    idx = torch.zeros(1, 1, 4, dtype=torch.int32, device=device)
    with pytest.raises(RuntimeError, match=r"sparse_mqa_decode: kv_cache \(FP8 MODEL1\) must hold whole blocks"):
        deepinfer_ops.sparse_mqa_decode(q, overlapping, idx, 0.1)


def test_one_token_blocks_take_any_token_stride(device):
    """A block of one token has no token stride to keep: a contiguous [n, 1, 584] cache whose stride(1) is not 584
    (``transpose``, ``empty_strided``) is accepted and equals the dense one."""
    kv = _rows(8, 1, seed=11).view(8, 512)[:4].to(device)
    slots = torch.arange(4, device=device)
    odd = torch.zeros(1, 4, ENTRY, dtype=torch.uint8, device=device).transpose(0, 1)  # strides (584, 2336, 1)
    dense = torch.zeros(4, 1, ENTRY, dtype=torch.uint8, device=device)
    deepinfer_ops.kv_cache_write_fp8(odd, kv, slots)
    deepinfer_ops.kv_cache_write_fp8(dense, kv, slots)
    assert torch.equal(odd.cpu(), dense.cpu())
    assert torch.equal(deepinfer_ops.kv_cache_dequant_fp8(odd, slots).cpu(),
                       deepinfer_ops.kv_cache_dequant_fp8(dense, slots).cpu())
