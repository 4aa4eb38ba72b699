"""Paged incremental-decoding state of DeepSeek-V4, addressed through the engine's block tables.

Every cache kind of every layer is a pool with a leading ``num_blocks`` dim; block id ``b`` of a sequence's block table
(``ForwardBatch.block_tables[i]``) covers that sequence's token positions ``[j * 128, (j + 1) * 128)`` where ``j`` is the
block's index in the table. Per layer (main layers first, then the MTP layers), with ``hd = head_dim``,
``ihd = index_head_dim``, ``m`` the layer's compression ratio:

===================  ==================================  =====================================================
pool                 shape                               content
===================  ==================================  =====================================================
``kv``               ``[num_blocks, 128, hd]``           every token's shared K=V (after kv_norm and RoPE);
                                                         attention reads the last ``sliding_window`` of them
``comp``             ``[num_blocks, 128 // m, hd]``      CSA / HCA compressed entries (entry ``w`` covers
                                                         positions ``[w m, (w + 1) m)``; RoPE at ``w m``)
``state_kv``,        ``[num_blocks, R, coff * hd]``      partial-window compressor state: projected kv and
``state_gate``                                           gate (ape not added) of the open window, and for CSA
                                                         also of the previous window (its Ca half feeds
                                                         the next entry); ring of ``R`` slots (``R = 2m``
                                                         CSA, ``m`` HCA; ``coff = 2`` CSA, 1 HCA) keyed by
                                                         ``position % R``, held by the block of the
                                                         sequence's LAST token (and by every full block:
                                                         the state at its end)
``idx``              ``[num_blocks, 128 // m, ihd]``     CSA only: lightning-indexer compressed keys
``idx_state_kv``,    ``[num_blocks, 2m, 2 ihd]``         CSA only: the indexer compressor's partial-window state
``idx_state_gate``
===================  ==================================  =====================================================

``kv``, ``comp`` and ``idx`` are the paged caches the native ops read and write directly (``deepinfer_ops``
``sparse_mqa_prefill``, ``mqa_logits``, ``kv_cache_write``): ``[num_blocks, block_size, dim]`` with block_size 128
(``kv``) or ``128 // m`` (``comp``, ``idx``), slot ``block_id * block_size + offset``.

The partial-window state of a step's end lives in the block holding the sequence's last token (a step reads it from
the block of position ``context_len - query_len - 1``); in addition, whenever a step crosses a block end, the ring of
the block just completed receives the state as of that block end. A full block is therefore an immutable snapshot of
everything a continuation needs from it (raw KV, entries, indexer keys, state at its end), so full blocks can be
shared between sequences with the same prefix; the block holding a sequence's last token is private to it.

``CacheSpec.bytes_per_block`` is the exact size of one block over all pools and layers. For the tiny preset in fp32 it
is 286,976 B; for V4-Flash (43 layers + 1 MTP layer) in bf16 it is 12,750,848 B per block (~99.6 KB per token):
``kv`` of every token is ~45 KB/token (1 KiB per layer), the HCA state rings (2 x 128 x 512 per HCA layer and block)
about as much again, compressed entries and indexer keys ~4 KB/token. Two known reductions, left for the GPU cache
layout: online-softmax accumulators instead of raw per-token projections in the state rings (removes almost all of
the ring bytes), and recycling ``kv`` older than the window, which needs a second block-table group in the engine
contract (the entries of a block live forever, its raw KV only for ``sliding_window`` tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import CSA, HCA, SLIDING, DeepseekV4Config

BLOCK_SIZE = 128


@dataclass(frozen=True)
class LayerCacheSpec:
    """Pools of one layer: ``{pool name: per-block shape}``."""

    layer_type: str
    ratio: int
    pools: dict[str, tuple[int, ...]]


@dataclass(frozen=True)
class CacheSpec:
    """Shape of the paged cache for a config.

    Attributes:
        block_size: tokens per block (128; a multiple of every compression ratio).
        layers: one :class:`LayerCacheSpec` per main layer, then one per MTP layer.
        dtype: element type of every pool.
    """

    block_size: int
    layers: tuple[LayerCacheSpec, ...]
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block id occupies across all pools of all layers."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        total = 0
        for layer in self.layers:
            for shape in layer.pools.values():
                n = 1
                for s in shape:
                    n *= s
                total += n * elem
        return total

    def bytes_per_token(self) -> dict[str, float]:
        """Bytes one token of context occupies, per pool kind over all layers (a block's bytes / ``block_size``)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        out: dict[str, float] = {}
        for layer in self.layers:
            for name, shape in layer.pools.items():
                n = elem
                for d in shape:
                    n *= d
                out[name] = out.get(name, 0) + n / self.block_size
        return out

    @classmethod
    def from_config(cls, config: DeepseekV4Config, dtype: torch.dtype = torch.bfloat16,
                    block_size: int = BLOCK_SIZE) -> "CacheSpec":
        """Raises ValueError if ``block_size`` is not a multiple of the compression ratios."""
        for m in (config.compress_rate_csa, config.compress_rate_hca):
            if block_size % m:
                raise ValueError(f"block_size: {block_size} is not a multiple of the compression ratio {m}")
        hd, ihd = config.head_dim, config.index_head_dim
        layers = []
        for ratio in tuple(config.compress_ratios) + tuple(config.mtp_compress_ratios):
            lt = config.layer_type_of_ratio(ratio)
            pools: dict[str, tuple[int, ...]] = {"kv": (block_size, hd)}
            if lt != SLIDING:
                coff = 2 if lt == CSA else 1
                ring = 2 * ratio if lt == CSA else ratio
                pools["comp"] = (block_size // ratio, hd)
                pools["state_kv"] = (ring, coff * hd)
                pools["state_gate"] = (ring, coff * hd)
            if lt == CSA:
                pools["idx"] = (block_size // ratio, ihd)
                pools["idx_state_kv"] = (2 * ratio, 2 * ihd)
                pools["idx_state_gate"] = (2 * ratio, 2 * ihd)
            layers.append(LayerCacheSpec(lt, ratio, pools))
        return cls(block_size, tuple(layers), dtype)


class DeepseekV4Cache:
    """The allocated pools: ``layers[i][pool]`` is a ``[num_blocks, *per_block_shape]`` tensor (see module doc)."""

    def __init__(self, spec: CacheSpec, num_blocks: int, device: torch.device | str = "cpu"):
        if num_blocks < 0:
            raise ValueError(f"num_blocks: must be >= 0, got {num_blocks}")
        self.spec = spec
        self.num_blocks = int(num_blocks)
        self.block_size = spec.block_size
        self.device = torch.device(device)
        # zero-filled: unwritten slots are never read by a correct step; zeros keep bugs finite and visible in tests
        self.layers: list[dict[str, torch.Tensor]] = [
            {name: torch.zeros((num_blocks, *shape), dtype=spec.dtype, device=self.device) for name, shape in ls.pools.items()}
            for ls in spec.layers
        ]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.values())


def allocate_cache(config: DeepseekV4Config, num_blocks: int, device: torch.device | str = "cpu",
                   dtype: torch.dtype = torch.bfloat16) -> DeepseekV4Cache:
    """Allocate the paged cache for ``num_blocks`` blocks of 128 tokens (``CacheSpec.bytes_per_block`` each).

    Args:
        config: model config.
        num_blocks: pool capacity in blocks; block ids in block tables must be in ``[0, num_blocks)``.
        device: where the pools live.
        dtype: pool element type (the model's activation dtype: float32 for CPU tests, bfloat16 otherwise).
    Raises:
        ValueError for a negative ``num_blocks``.
    """
    return DeepseekV4Cache(CacheSpec.from_config(config, dtype), num_blocks, device)


__all__ = ["BLOCK_SIZE", "CacheSpec", "DeepseekV4Cache", "LayerCacheSpec", "allocate_cache", "HCA", "CSA", "SLIDING"]
