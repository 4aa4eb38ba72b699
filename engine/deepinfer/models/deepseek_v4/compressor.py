"""The KV compressor (CSA / HCA entries) and the lightning indexer of a CSA layer.

Compressor: per channel softmax over a window's gate (``wgate x + ape[slot]``, float32) pooling ``wkv x``; CSA
overlaps windows (entry ``w`` pools window ``w-1``'s first half channels "Ca" and window ``w``'s second half "Cb",
``2m`` slots), then ``norm`` and RoPE at position ``w m``. An entry is visible to query ``t`` iff its window closed:
``w < (t + 1) // m``. The open windows' projections persist in the state rings of the cache (``cache.py``).
Source: transformers 5.23 ``modeling_deepseek_v4.py``; DeepSeek-V4 paper.
"""

from __future__ import annotations

import torch
from torch import nn

import deepinfer_ops

from .cache import write_cache
from .config import DeepseekV4Config
from .layers import Linear, RMSNorm, _param
from .plan import CompressorPlan


class Compressor(nn.Module):
    """Gated pooling compressor (``wkv``, ``wgate``, ``ape``, ``norm``); ``overlap`` = CSA's two-series windows."""

    def __init__(self, cfg: DeepseekV4Config, ratio: int, head_dim: int, overlap: bool, dtype: torch.dtype):
        super().__init__()
        self.ratio, self.head_dim, self.overlap = ratio, head_dim, overlap
        coff = 2 if overlap else 1
        self.wkv = Linear(coff * head_dim, cfg.hidden_size, dtype)
        self.wgate = Linear(coff * head_dim, cfg.hidden_size, dtype)
        self.ape = _param(ratio, coff * head_dim)  # float32 in checkpoints
        self.norm = RMSNorm(head_dim, cfg.rms_norm_eps, dtype)

    def forward(self, kv_new: torch.Tensor, gate_new: torch.Tensor, cp: CompressorPlan, state_kv: torch.Tensor,
                state_gate: torch.Tensor, pool: torch.Tensor, rope_table: torch.Tensor) -> None:
        """Write this step's closing windows' entries into ``pool`` and persist the open windows' state.

        Args:
            kv_new / gate_new: ``[num_rows, coff * hd]`` projections of the step's tokens (ring rows keep them as
                projected; ``ape`` is added in float32 when a window is pooled, as the reference does).
            cp: the step's lists for this ratio (:class:`~.plan.CompressorPlan`).
            state_kv / state_gate: ``[window_blocks, R, coff * hd]`` rings; pool: ``[num_blocks, 128 // m, hd]``
                (or its FP8 form, ``cache.py``).
        The rings are read (pooling) before they are written (state), and one state write never reads a slot it
        writes: the plan moves state to another block's ring or writes new rows only.
        """
        C = state_kv.shape[-1]
        ring_kv, ring_gate = state_kv.view(-1, C), state_gate.view(-1, C)
        kv_new, gate_new = kv_new.to(ring_kv.dtype), gate_new.to(ring_gate.dtype)
        if cp.n_close:
            entries = self.norm(deepinfer_ops.compressor_pool_rows(
                ring_kv, ring_gate, kv_new, gate_new, self.ape.float(), cp.ring_src, cp.cur, cp.prev, cp.prev_ok,
                cp.dst))
            deepinfer_ops.rotary_embedding(entries, cp.w_pos, rope_table)
            write_cache(pool, entries, cp.dst)
        if cp.deferred is not None:
            cp.deferred.append((ring_kv, ring_gate, kv_new, gate_new))
        elif cp.st_dst.shape[0]:
            deepinfer_ops.compressor_state_write(ring_kv, ring_gate, kv_new, gate_new, cp.ring_src, cp.st_src,
                                                 cp.st_dst)


def commit_deferred_state(comp: dict, *parts: dict) -> None:
    """Write the ring state a step deferred (``CompressorPlan.deferred`` of each plan in ``comp``, ``{ratio:
    CompressorPlan}``) with the lists of :meth:`~.plan.PlanBuilder.state_commit` (``{ratio: (ring_src, st_src,
    st_dst)}``): every compressor of every layer of that ratio, in the order they ran; several ``parts`` (a
    commit of consecutive position ranges) in order, each reading the ring state the one before wrote. Device work
    only."""
    deferred = {m: cp.deferred for m, cp in comp.items() if cp.deferred}
    for lists in parts:
        write_deferred_state(deferred, lists)
    for cp in comp.values():
        cp.deferred = []


def write_deferred_state(deferred: dict, lists: dict) -> None:
    """The writes of :func:`commit_deferred_state` from ``{ratio: [(ring_kv, ring_gate, kv_new, gate_new)]}``
    (a captured verification's own outputs: nothing is emptied). Device work only."""
    for m, entries in deferred.items():
        ring_src, st_src, st_dst = lists[m]
        if st_dst.shape[0]:
            for ring_kv, ring_gate, kv_new, gate_new in entries:
                deepinfer_ops.compressor_state_write(ring_kv, ring_gate, kv_new, gate_new, ring_src, st_src, st_dst)


class Indexer(nn.Module):
    """Lightning indexer of a CSA layer (``wq_b``, ``weights_proj``, its own overlapped ``compressor``).

    Score ``sum_h (weights_proj(x)_h / sqrt(n_h)) * ReLU(q_h . k / sqrt(index_head_dim))``, future entries masked:
    :func:`deepinfer_ops.mqa_logits` over the paged indexer keys (both scalings folded into its per-head weights,
    ``k_end = (t + 1) // m``), then the top-k by the tie rule (:func:`indexer_topk`)."""

    QUERY_CHUNK = 512  # queries per score chunk (bounds the [queries, entries] scores)

    def __init__(self, cfg: DeepseekV4Config, ratio: int, dtype: torch.dtype):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = Linear(cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank, dtype)
        self.weights_proj = Linear(cfg.index_n_heads, cfg.hidden_size, dtype)
        self.compressor = Compressor(cfg, ratio, cfg.index_head_dim, True, dtype)

    def select(self, iq: torch.Tensor, iw: torch.Tensor, ikeys: torch.Tensor, n_ent: int, bt32: torch.Tensor,
               n_vis: torch.Tensor, ties: list) -> torch.Tensor:
        """Entry ids ``[T, topk]`` int64 of each query's selected entries in entry order (``n_ent`` = none, last).

        Args:
            iq: ``[T, n_heads, head_dim]`` rotated index queries; iw: ``[T, n_heads]`` float32 head weights
                (``weights_proj / sqrt(n_heads)``); ikeys: the paged indexer-key pool; bt32: ``[T, max_blocks]``
                int32 per-token block tables; n_vis: ``[T]`` visible entries per query.
            ties: per chunk, a 0-d int64 device tensor is appended: the rows where the tie rule decided.
        """
        T, dev = iq.shape[0], iq.device
        chunks = [torch.full((0, self.topk), n_ent, dtype=torch.long, device=dev)] if T == 0 else []
        iw = iw * (self.head_dim ** -0.5)  # folds 1 / sqrt(index_head_dim) into the head weights
        k_end = n_vis.to(torch.int32)
        for r0 in range(0, T, self.QUERY_CHUNK):
            r1 = min(T, r0 + self.QUERY_CHUNK)
            sc = deepinfer_ops.mqa_logits(iq[r0:r1], iw[r0:r1].contiguous(), ikeys, n_ent,
                                          block_table=bt32[r0:r1].contiguous(), k_end=k_end[r0:r1].contiguous())
            w = torch.arange(n_ent, device=dev).view(1, -1)
            visible = w < n_vis[r0:r1].view(-1, 1)
            # each row in entry order (none last, width independent of the batch), so the keys are summed in the
            # same order for any chunking or batch
            if n_ent <= self.topk:
                chunks.append(pack_selected(visible & torch.isfinite(sc), self.topk))
                continue
            ids, t = indexer_topk(sc, visible, self.topk)
            ties.append(t)
            part = torch.full((r1 - r0, self.topk), n_ent, dtype=torch.long, device=dev)
            part[:, :ids.shape[1]] = torch.where(ids >= 0, ids, n_ent)
            chunks.append(part.sort(dim=1).values)
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks)


def pack_selected(keep: torch.Tensor, width: int) -> torch.Tensor:
    """The ids of the ``True`` entries of each row of ``keep [rows, n]`` (``n <= width``) in entry order, then ``n``:
    ``[rows, width]`` int64, without a sort (each kept entry goes to the column of its running count)."""
    rows, n = keep.shape
    col = torch.where(keep, keep.cumsum(dim=1) - 1, width)  # the rest go to a spare column
    packed = torch.full((rows, width + 1), n, dtype=torch.long, device=keep.device)
    ids = torch.arange(n, device=keep.device).expand(rows, -1)
    return packed.scatter_(1, col, ids)[:, :width]


def indexer_topk(scores: torch.Tensor, visible: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Lightning-indexer top-k for one block of queries, as entry ids.

    Args:
        scores: ``[num_queries, num_entries]`` float32 index scores (``num_entries >= 1``).
        visible: ``[num_queries, num_entries]`` bool, entry closed before the query (``w < (t + 1) // m``).
        topk: ``index_topk``.
    Returns:
        (``[num_queries, min(topk, num_entries)]`` int64: the ids of the top ``min(topk, #visible)`` visible entries
        of each row, ranked by the tie rule -- higher score first, then lower entry index -- and ``-1`` in the
        remaining columns (fewer visible entries, or a non-finite score); a 0-d int64 tensor on the scores' device:
        the rows whose k-th and (k+1)-th best visible scores are equal, i.e. where the tie rule decided).
    """
    n = scores.shape[-1]
    masked = scores.masked_fill(~visible, float("-inf"))
    k = min(topk, n)
    kk = min(k + 1, n)
    vals, inds = deepinfer_ops.topk(masked, kk)
    if kk > k:
        ties = ((vals[:, k - 1] == vals[:, k]) & torch.isfinite(vals[:, k])).sum()
    else:
        ties = torch.zeros((), dtype=torch.long, device=scores.device)
    vals, inds = vals[:, :k], inds[:, :k]
    ok = torch.isfinite(vals) & visible.gather(1, inds)
    return torch.where(ok, inds, torch.full_like(inds, -1)), ties


def indexer_select(scores: torch.Tensor, visible: torch.Tensor, topk: int) -> tuple[torch.Tensor, int]:
    """:func:`indexer_topk` as a mask: (``[num_queries, num_entries]`` bool, True for the selected entries; the
    number of tie-decided rows, a host int)."""
    n = scores.shape[-1]
    if n == 0:
        return torch.zeros_like(visible), 0
    ids, ties = indexer_topk(scores, visible, topk)
    sel = torch.zeros(scores.shape[0], n + 1, dtype=torch.bool, device=scores.device)
    sel.scatter_(1, torch.where(ids >= 0, ids, n), True)
    return sel[:, :n], int(ties)
