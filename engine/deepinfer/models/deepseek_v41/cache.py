"""Paged incremental-decoding state of DeepSeek-V4.1, in two cache groups addressed through their block tables.

The pools reuse DeepSeek-V4's containers (:class:`~deepinfer.models.deepseek_v4.cache.CacheSpec`,
:class:`~deepinfer.models.deepseek_v4.cache.DeepseekV4Cache`: one ``[group blocks, *per_block_shape]`` tensor per
pool and layer); what a block holds is V4.1's. Block ``j`` of a sequence's table covers positions
``[j * block_size, (j + 1) * block_size)``. Per backbone layer ``L`` (``hd = head_dim``, ``ihd =
index_head_dim``, ``r`` the layer's ratio; DSpark stages have no pools: the engine does not run them):

======================  =======  ===========================  ====================================================
pool                    group    shape                        content
======================  =======  ===========================  ====================================================
``kv``                  window   ``[blocks, bs, hd]`` bf16    every token's window K=V (RoPE'd, FP8 round trip)
``carry_kv``,           window   ``[blocks, bs, hd]`` f32     ratio-2 KV sources: the compressor's kv / gate
``carry_gate``                                                projections of the open group's positions (only the
                                                              last ``end % r`` positions are written and read)
``comp``                full     ``[blocks, bs // r, hd]``    KV sources only: compressed entry ``e`` covers
                                                              positions ``[e r, (e + 1) r)``; written by the
                                                              source, read by the source and every consumer
                                                              (``kv_source_of``): ONE pool per shared group
``idx``                 full     ``[blocks, bs // r, ihd]``   KV sources that run an indexer: their index keys,
                                                              read by every index source that uses them
``engram`` (layer 0)    full     ``[blocks, bs]`` int64       Engram's compressed token ids (the n-gram history)
======================  =======  ===========================  ====================================================

A step starting at ``c`` reads the window group from ``c - lookback`` on (``lookback = max(window_size - 1, 1)``:
the window of its first token, and a ratio-2 group left open at ``c - 1``). So the ``window`` group releases older
blocks as a request moves on, while consumers reading a source's compressed KV cost no memory of their own.
``kv_cache_dtype``: ``"auto"`` and ``"bf16"`` (the reference's bf16 caches); ``"fp8"`` is refused.
"""

from __future__ import annotations

import torch

from deepinfer.block_manager import FULL_GROUP, WINDOW_GROUP

from ..deepseek_v4.cache import CacheSpec, DeepseekV4Cache, LayerCacheSpec, PoolSpec
from .config import DeepseekV41Config
from .layers import BF16, gather_rows

BLOCK_SIZE = 128
KV_CACHE_DTYPES = ("auto", "bf16")


def window_lookback(cfg: DeepseekV41Config) -> int:
    """Positions before a step's first token that the step still reads from the window group."""
    return max(cfg.window_size - 1, 1)


def exact_replay_tokens(cfg: DeepseekV41Config) -> int:
    """Positions a prefix-cache hit at a block boundary ``H`` must recompute (with no window block before them) for
    every later output to equal a run without the hit: only the window attention carries a replay's inexact start
    forward (compressed entries, index keys and Engram ids before ``H`` are the shared blocks' own; no ratio-2 group
    straddles a block boundary), ``lookback`` positions per layer, so ``n_layers * lookback``."""
    return cfg.n_layers * window_lookback(cfg)


def cache_spec(cfg: DeepseekV41Config, dtype: torch.dtype = BF16, block_size: int = BLOCK_SIZE,
               kv_cache_dtype: str = "auto") -> CacheSpec:
    """The pools of every backbone layer (module doc). ``dtype`` (the engine's model dtype) is not used: the V4.1
    caches are bf16 (and float32 for the compressor carry) whatever it is.

    Raises ValueError naming the field: ``block_size`` not a multiple of 2 (the largest ratio), or a
    ``kv_cache_dtype`` other than ``"auto"`` / ``"bf16"``."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2 or block_size % 2:
        raise ValueError(f"block_size: {block_size!r} must be an even integer (a multiple of every compression "
                         "ratio of DeepSeek-V4.1)")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype: DeepSeek-V4.1 stores bf16 caches ({', '.join(KV_CACHE_DTYPES)}), got "
                         f"{kv_cache_dtype!r}")
    c, bs = cfg, block_size
    layers = []
    for L in range(c.n_layers):
        r = c.ratio(L)
        pools = {"kv": PoolSpec((bs, c.head_dim), BF16, WINDOW_GROUP)}
        if L in c.kv_source_layers:
            pools["comp"] = PoolSpec((bs // r, c.head_dim), BF16, FULL_GROUP)
            if L in c.index_source_layers:
                pools["idx"] = PoolSpec((bs // r, c.index_head_dim), BF16, FULL_GROUP)
            if r > 1:
                pools["carry_kv"] = PoolSpec((bs, c.head_dim), torch.float32, WINDOW_GROUP)
                pools["carry_gate"] = PoolSpec((bs, c.head_dim), torch.float32, WINDOW_GROUP)
        if L == 0 and c.engram_layer_ids:
            pools["engram"] = PoolSpec((bs,), torch.int64, FULL_GROUP)
        layers.append(LayerCacheSpec(c.block_type(L), r, pools))
    return CacheSpec(bs, tuple(layers), BF16, kv_cache_dtype, window_lookback(c), exact_replay_tokens(c))


def allocate_cache(cfg: DeepseekV41Config, num_blocks: int, window_blocks: int | None = None,
                   block_size: int = BLOCK_SIZE, kv_cache_dtype: str = "auto",
                   device: torch.device | str = "cpu") -> DeepseekV4Cache:
    """Zero-filled pools on ``device``: ``num_blocks`` blocks in the ``full`` group, ``window_blocks`` (default
    ``num_blocks``) in the ``window`` group. Raises ValueError naming the field."""
    return DeepseekV4Cache(cache_spec(cfg, BF16, block_size, kv_cache_dtype), num_blocks, device, window_blocks)


class PagedSeqView:
    """One sequence's view of the paged cache for one step: the cache interface the backbone calls
    (:class:`~.model.SeqState` has the same methods over dense tensors).

    Args:
        cfg, cache: the config and the pools.
        full_row, window_row: int64 ``[width]`` block ids of the sequence's ``full`` / ``window`` tables (``-1``
            for released or unheld blocks), at least the blocks of ``end``.
        start, end: the step's positions ``[start, end)``.
        shared_len: positions whose ``full`` blocks this step must not write (a prefix-cache hit's shared blocks).
        floor: the first position of its window table (a replayed hit holds nothing before it): reads below are
            masked.
    """

    def __init__(self, cfg: DeepseekV41Config, cache: DeepseekV4Cache, full_row: torch.Tensor,
                 window_row: torch.Tensor, start: int, end: int, shared_len: int = 0, floor: int = 0):
        self.cfg, self.cache = cfg, cache
        self.bs = cache.block_size
        dev = cache.layers[0]["kv"].device  # rows from a plan are there already (no copy)
        self.frow, self.wrow = full_row.to(dev), window_row.to(dev)
        self.start, self.end = start, end
        self.shared_len, self.floor = shared_len, floor

    # ---- slots ------------------------------------------------------------------------------------------------
    def _wslots(self, pos: torch.Tensor) -> torch.Tensor:
        """Window-group slots of positions ``pos`` (``-1`` in, below ``floor`` or in a released block: ``-1``)."""
        ok = pos >= max(self.floor, 0)
        p = pos.clamp_min(0)
        blk = self.wrow[torch.div(p, self.bs, rounding_mode="floor")]
        return torch.where(ok & (blk >= 0), blk * self.bs + p % self.bs, -1)

    def _eslots(self, r: int, ent: torch.Tensor) -> torch.Tensor:
        """Full-group slots of compressed entries ``ent`` (``-1`` in: ``-1``) of a ratio-``r`` pool."""
        per = self.bs // r
        e = ent.clamp_min(0)
        blk = self.frow[torch.div(e, per, rounding_mode="floor")]
        return torch.where((ent >= 0) & (blk >= 0), blk * per + e % per, -1)

    @staticmethod
    def _flat(pool: torch.Tensor) -> torch.Tensor:
        return pool.view(-1, *pool.shape[2:])

    def _pool(self, L: int, name: str) -> torch.Tensor:
        return self._flat(self.cache.layers[L][name])

    # ---- the backbone's cache interface -----------------------------------------------------------------------
    def write_kv(self, L: int, start: int, rows: torch.Tensor) -> None:
        self._pool(L, "kv")[self._wslots(torch.arange(start, start + rows.shape[0]))] = rows

    def window(self, L: int, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return gather_rows(self._pool(L, "kv"), self._wslots(idx))

    def _write_entries(self, L: int, name: str, first: int, rows: torch.Tensor) -> None:
        r = self.cfg.ratio(L)
        ent = torch.arange(first, first + rows.shape[0])
        keep = (ent + 1) * r > self.shared_len  # entries of shared blocks are never written
        self._pool(L, name)[self._eslots(r, ent[keep])] = rows[keep]

    def write_comp(self, L: int, first: int, rows: torch.Tensor) -> None:
        self._write_entries(L, "comp", first, rows)

    def comp_rows(self, src: int, sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return gather_rows(self._pool(src, "comp"), self._eslots(self.cfg.ratio(src), sel))

    def write_idx(self, L: int, first: int, rows: torch.Tensor) -> None:
        self._write_entries(L, "idx", first, rows)

    def idx_keys(self, src: int, n: int) -> torch.Tensor:
        return self._pool(src, "idx")[self._eslots(self.cfg.ratio(src), torch.arange(n))]

    def carry_rows(self, L: int, start: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        slots = self._wslots(torch.arange(start - start % r, start))
        return self._pool(L, "carry_kv")[slots], self._pool(L, "carry_gate")[slots]

    def put_carry(self, L: int, end: int, kv: torch.Tensor, gate: torch.Tensor) -> None:
        """``kv``, ``gate``: the rows of positions ``[end - len(kv), end)``; those at or after ``start`` are new."""
        pos = torch.arange(end - kv.shape[0], end)
        new = pos >= self.start
        slots = self._wslots(pos[new])
        self._pool(L, "carry_kv")[slots] = kv[new]
        self._pool(L, "carry_gate")[slots] = gate[new]

    def engram_history(self, start: int, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Store the chunk's compressed ids ``ids`` (positions ``start ..``) and return ``(history, base)``: the
        ids of positions ``[base, start + len(ids))``, ``base = max(0, start - max_ngram + 1)``."""
        pool = self.cache.layers[0]["engram"].view(-1)
        base = max(0, start - self.cfg.engram_max_ngram_size + 1)
        pos = torch.arange(start, start + ids.numel())
        keep = pos >= self.shared_len
        blk = self.frow[torch.div(pos[keep], self.bs, rounding_mode="floor")]
        pool[blk * self.bs + pos[keep] % self.bs] = ids[keep]
        old = torch.arange(base, start)
        blk = self.frow[torch.div(old, self.bs, rounding_mode="floor")]
        return torch.cat([pool[blk * self.bs + old % self.bs], ids]), base
