"""Paged incremental-decoding state of DeepSeek-V4, in two cache groups addressed through their block tables.

Every cache kind of every layer is a pool with a leading ``num_blocks`` dim (its group's). Block ``j`` of a
sequence's table in a group covers that sequence's positions ``[j * 128, (j + 1) * 128)``. Per layer (main layers
first, then the MTP layers), with ``hd = head_dim``, ``ihd = index_head_dim``, ``m`` the layer's compression ratio:

===================  =========  ==================================  ================================================
pool                 group      shape                               content
===================  =========  ==================================  ================================================
``kv``               window     ``[num_blocks, 128, hd]``           every token's shared K=V (after kv_norm and
                                                                    RoPE); attention reads the last
                                                                    ``sliding_window`` of them
``state_kv``,        window     ``[num_blocks, R, coff * hd]``      partial-window compressor state: projected kv and
``state_gate``                                                      gate (ape not added) of the open window, and for
                                                                    CSA also of the previous window; ring of ``R``
                                                                    slots (``R = 2m`` CSA, ``m`` HCA; ``coff = 2``
                                                                    CSA, 1 HCA) keyed by ``position % R``, held by
                                                                    the block of the sequence's LAST token
``idx_state_kv``,    window     ``[num_blocks, 2m, 2 ihd]``         CSA only: the indexer compressor's state
``idx_state_gate``
``comp``             full       ``[num_blocks, 128 // m, hd]``      CSA / HCA compressed entries (entry ``w``
                                                                    covers positions ``[w m, (w + 1) m)``)
``idx``              full       ``[num_blocks, 128 // m, ihd]``     CSA only: lightning-indexer compressed keys
===================  =========  ==================================  ================================================

The ``full`` group's blocks live as long as the sequence. A step starting at position ``c`` reads the ``window``
group only from position ``c - lookback`` on (``lookback = max(sliding_window - 1, 1)``: the window of its first
token and the state ring of the block of ``c - 1``), so the engine releases older window blocks
(``deepinfer.block_manager``). A model built for one block table (``ForwardBatch``) passes the same ids for both.

``kv_cache_dtype``: ``"auto"`` stores every pool in the model dtype; ``"bf16"`` stores ``kv``, ``comp`` and
``idx`` in bfloat16; ``"fp8"`` stores ``kv`` and ``comp`` as MODEL1 FP8 entries (uint8 ``[.., 584]``, head_dim 512
with 64 RoPE dims; ``deepinfer_ops.kv_cache_write_fp8``) and ``idx`` as FP8 indexer keys (uint8 ``[.., ihd + 4]``;
``deepinfer_ops.indexer_k_cache_write_fp8``). The state rings always stay in the model dtype. The design and sizes:
``docs/deepseek_v4.md`` ("Cache groups").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import deepinfer_ops
from deepinfer.block_manager import FULL_GROUP, WINDOW_GROUP, CacheGroup

from .config import CSA, HCA, SLIDING, DeepseekV4Config

BLOCK_SIZE = 128
KV_CACHE_DTYPES = ("auto", "bf16", "fp8")
FP8_ENTRY_BYTES = 584  # MODEL1 bytes per token (FlashMLA's block layout: deepinfer_ops.attention)
FP8_HEAD_DIM, FP8_ROPE_DIM = 512, 64
FP8_INDEXER_HEAD_DIMS = (48, 64, 128)
WINDOW_POOLS = frozenset({"kv", "state_kv", "state_gate", "idx_state_kv", "idx_state_gate"})


def window_lookback(config: DeepseekV4Config) -> int:
    """Positions before a step's first token that the step still reads from the window group."""
    return max(config.sliding_window - 1, 1)


def exact_replay_tokens(config: DeepseekV4Config) -> int:
    """Positions a prefix-cache hit at a block boundary ``H`` must recompute, when the window group holds nothing
    before them, for every later output to equal a run without the hit: each main layer's window attention reads
    ``lookback`` earlier positions of its own input, so a replay from ``s`` gives exact layer-``l`` inputs from
    ``s + (l - 1) * lookback`` on, and the tokens after ``H`` read layer ``l``'s window KV and compressor state
    (a CSA ring holds the ``m`` positions before ``H``) from ``H - max(lookback, m)`` on. ``num_hidden_layers *
    max(lookback, m)`` (MTP layers are not run on a prompt)."""
    ring = config.compress_rate_csa if CSA in config.layer_types else 0
    return config.num_hidden_layers * max(window_lookback(config), ring)


@dataclass(frozen=True)
class PoolSpec:
    """One pool of one layer: per-block ``shape``, element ``dtype`` and cache ``group``."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    group: str

    @property
    def nbytes(self) -> int:
        n = torch.empty((), dtype=self.dtype).element_size()
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class LayerCacheSpec:
    """Pools of one layer: ``{pool name: PoolSpec}``."""

    layer_type: str
    ratio: int
    pools: dict[str, PoolSpec]


@dataclass(frozen=True)
class CacheSpec:
    """Shape of the paged cache for a config.

    Attributes:
        block_size: tokens per block (128; a multiple of every compression ratio).
        layers: one :class:`LayerCacheSpec` per main layer, then one per MTP layer.
        dtype: the model dtype (the compressor state rings; every pool with ``kv_cache_dtype="auto"``).
        kv_cache_dtype: ``"auto"``, ``"bf16"`` or ``"fp8"`` (module doc).
        lookback: :func:`window_lookback` of the config.
        replay_tokens: :func:`exact_replay_tokens` of the config (prefix caching).
    """

    block_size: int
    layers: tuple[LayerCacheSpec, ...]
    dtype: torch.dtype
    kv_cache_dtype: str = "auto"
    lookback: int = 127
    replay_tokens: int = 127

    def group_bytes_per_block(self) -> dict[str, int]:
        """Bytes one block id of each group occupies across that group's pools of all layers."""
        out = {FULL_GROUP: 0, WINDOW_GROUP: 0}
        for layer in self.layers:
            for p in layer.pools.values():
                out[p.group] += p.nbytes
        return out

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block id in every group (the one-table layout of a ``ForwardBatch``)."""
        return sum(self.group_bytes_per_block().values())

    def bytes_per_token(self) -> dict[str, float]:
        """Bytes one token of context occupies, per pool kind over all layers (a block's bytes / ``block_size``;
        the window group's pools are held for the last ``lookback`` positions only)."""
        out: dict[str, float] = {}
        for layer in self.layers:
            for name, p in layer.pools.items():
                out[name] = out.get(name, 0) + p.nbytes / self.block_size
        return out

    def cache_groups(self, num_blocks: int, window_blocks: int) -> list[CacheGroup]:
        """The engine's :class:`~deepinfer.block_manager.CacheGroup` list: ``full`` (``num_blocks``, kept) then
        ``window`` (``window_blocks``, released after ``lookback`` positions)."""
        return [CacheGroup(FULL_GROUP, num_blocks), CacheGroup(WINDOW_GROUP, window_blocks, self.lookback)]

    def report(self, num_blocks: int, window_blocks: int) -> dict:
        """The start-up view of a cache of these capacities: ``kv_cache_dtype``; per group its blocks, bytes per
        block, bytes per token (a block's bytes / ``block_size``) and pool kinds with their bytes per token; and
        ``tokens``: the context positions the ``full`` group holds (``num_blocks * block_size``; the ``window``
        group holds the last ``lookback`` positions of each running sequence)."""
        per_block = self.group_bytes_per_block()
        per_token = self.bytes_per_token()
        groups = {}
        for name, blocks in ((FULL_GROUP, num_blocks), (WINDOW_GROUP, window_blocks)):
            kinds = sorted({k for layer in self.layers for k, p in layer.pools.items() if p.group == name})
            groups[name] = {"blocks": blocks, "bytes_per_block": per_block[name],
                            "bytes_per_token": per_block[name] / self.block_size,
                            "pools_bytes_per_token": {k: per_token[k] for k in kinds}}
        return {"kv_cache_dtype": self.kv_cache_dtype, "groups": groups, "tokens": num_blocks * self.block_size,
                "window_lookback": self.lookback}

    @classmethod
    def from_config(cls, config: DeepseekV4Config, dtype: torch.dtype = torch.bfloat16,
                    block_size: int = BLOCK_SIZE, kv_cache_dtype: str = "auto") -> "CacheSpec":
        """Raises ValueError naming the field: ``block_size`` not a multiple of the compression ratios, an unknown
        ``kv_cache_dtype``, or ``"fp8"`` for a config whose head_dim / qk_rope_head_dim / index_head_dim the FP8
        entries do not hold."""
        for m in (config.compress_rate_csa, config.compress_rate_hca):
            if block_size % m:
                raise ValueError(f"block_size: {block_size} is not a multiple of the compression ratio {m}")
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype: must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")
        hd, ihd = config.head_dim, config.index_head_dim
        fp8 = kv_cache_dtype == "fp8"
        if fp8 and (hd != FP8_HEAD_DIM or config.qk_rope_head_dim != FP8_ROPE_DIM):
            raise ValueError(f"kv_cache_dtype: 'fp8' stores MODEL1 entries of head_dim {FP8_HEAD_DIM} with "
                             f"{FP8_ROPE_DIM} RoPE dims; this model has head_dim {hd}, qk_rope_head_dim "
                             f"{config.qk_rope_head_dim}")
        if fp8 and ihd not in FP8_INDEXER_HEAD_DIMS:
            raise ValueError(f"kv_cache_dtype: 'fp8' indexer keys need index_head_dim in {FP8_INDEXER_HEAD_DIMS}, "
                             f"this model has {ihd}")
        kv_dtype = {"auto": dtype, "bf16": torch.bfloat16, "fp8": torch.uint8}[kv_cache_dtype]
        kv_dim, idx_dim = (FP8_ENTRY_BYTES, ihd + 4) if fp8 else (hd, ihd)

        def pool(name: str, shape: tuple[int, ...], pool_dtype: torch.dtype) -> tuple[str, PoolSpec]:
            return name, PoolSpec(shape, pool_dtype, WINDOW_GROUP if name in WINDOW_POOLS else FULL_GROUP)

        layers = []
        for ratio in tuple(config.compress_ratios) + tuple(config.mtp_compress_ratios):
            lt = config.layer_type_of_ratio(ratio)
            pools = [pool("kv", (block_size, kv_dim), kv_dtype)]
            if lt != SLIDING:
                coff = 2 if lt == CSA else 1
                ring = 2 * ratio if lt == CSA else ratio
                pools += [pool("comp", (block_size // ratio, kv_dim), kv_dtype),
                          pool("state_kv", (ring, coff * hd), dtype), pool("state_gate", (ring, coff * hd), dtype)]
            if lt == CSA:
                pools += [pool("idx", (block_size // ratio, idx_dim), kv_dtype),
                          pool("idx_state_kv", (2 * ratio, 2 * ihd), dtype),
                          pool("idx_state_gate", (2 * ratio, 2 * ihd), dtype)]
            layers.append(LayerCacheSpec(lt, ratio, dict(pools)))
        return cls(block_size, tuple(layers), dtype, kv_cache_dtype, window_lookback(config),
                   exact_replay_tokens(config))


class DeepseekV4Cache:
    """The allocated pools: ``layers[i][pool]`` is a ``[group blocks, *per_block_shape]`` tensor (module doc);
    ``num_blocks`` / ``window_blocks`` the capacities of the ``full`` / ``window`` groups."""

    def __init__(self, spec: CacheSpec, num_blocks: int, device: torch.device | str = "cpu",
                 window_blocks: int | None = None):
        if window_blocks is None:
            window_blocks = num_blocks
        for name, n in (("num_blocks", num_blocks), ("window_blocks", window_blocks)):
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"{name}: must be an integer >= 0, got {n!r}")
        self.spec = spec
        self.num_blocks = int(num_blocks)
        self.window_blocks = int(window_blocks)
        self.block_size = spec.block_size
        self.device = torch.device(device)
        rows = {FULL_GROUP: self.num_blocks, WINDOW_GROUP: self.window_blocks}
        # zero-filled: unwritten slots are never read by a correct step; zeros keep bugs finite and visible in tests
        # (a zero FP8 entry decodes to zeros)
        self.layers: list[dict[str, torch.Tensor]] = [
            {name: torch.zeros((rows[p.group], *p.shape), dtype=p.dtype, device=self.device)
             for name, p in ls.pools.items()}
            for ls in spec.layers
        ]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.values())

    def group_tensors(self, group: str) -> list[torch.Tensor]:
        """Every pool of cache group ``group`` over all layers (first dim: the block id), in layer order."""
        return [t for layer, ls in zip(self.layers, self.spec.layers) for name, t in layer.items()
                if ls.pools[name].group == group]


def allocate_cache(config: DeepseekV4Config, num_blocks: int, device: torch.device | str = "cpu",
                   dtype: torch.dtype = torch.bfloat16, window_blocks: int | None = None,
                   kv_cache_dtype: str = "auto") -> DeepseekV4Cache:
    """Allocate the paged cache: ``num_blocks`` blocks of 128 tokens in the ``full`` group and ``window_blocks``
    (default ``num_blocks``: one block table serves both) in the ``window`` group.

    Args:
        config: model config.
        num_blocks / window_blocks: pool capacities; block ids of a group's table must be in ``[0, capacity)``.
        device: where the pools live.
        dtype: the model's activation dtype (float32 for CPU tests, bfloat16 otherwise).
        kv_cache_dtype: ``"auto"``, ``"bf16"`` or ``"fp8"`` (module doc).
    Raises:
        ValueError naming the field (a negative capacity, a bad ``kv_cache_dtype``).
    """
    return DeepseekV4Cache(CacheSpec.from_config(config, dtype, kv_cache_dtype=kv_cache_dtype), num_blocks, device,
                           window_blocks)




def query_dtype(pool: torch.Tensor) -> torch.dtype:
    """The query dtype attention / the indexer needs for ``pool``: bfloat16 for an FP8 (uint8) pool, else its own."""
    return torch.bfloat16 if pool.dtype == torch.uint8 else pool.dtype


def write_cache(pool: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
    """Write ``rows [n, dim]`` (any float dtype) into ``pool`` at ``slots [n]`` int64 (``-1``: skipped), in the pool's
    format: MODEL1 FP8 entries (uint8 ``[.., 584]``, dim 512), FP8 indexer keys (uint8 ``[.., dim + 4]``) or
    plain rows cast to the pool dtype. Raises RuntimeError naming the tensor (from the ops) on a mismatch."""
    if pool.dtype != torch.uint8:
        deepinfer_ops.kv_cache_write(pool, rows.to(pool.dtype), slots)
    elif pool.shape[-1] == FP8_ENTRY_BYTES and rows.shape[-1] == FP8_HEAD_DIM:
        deepinfer_ops.kv_cache_write_fp8(pool, rows.to(torch.bfloat16).contiguous(), slots)
    else:
        deepinfer_ops.indexer_k_cache_write_fp8(pool, rows.to(torch.bfloat16).contiguous(), slots)


__all__ = ["BLOCK_SIZE", "KV_CACHE_DTYPES", "CacheSpec", "DeepseekV4Cache", "LayerCacheSpec", "PoolSpec",
           "allocate_cache", "exact_replay_tokens", "query_dtype", "window_lookback", "write_cache", "HCA", "CSA",
           "SLIDING"]
