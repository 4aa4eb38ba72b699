"""Engine host work in C++: the step-plan lists of a graph-mode decode step."""

from __future__ import annotations

import torch


def decode_plan_fill(out: torch.Tensor, c0: torch.Tensor, query_lens: torch.Tensor, row_starts: torch.Tensor,
                     block_tables: torch.Tensor, window_tables: torch.Tensor, shared_len: torch.Tensor,
                     input_ids: torch.Tensor, logits_indices: torch.Tensor, num_seqs: int, tokens_per_seq: int,
                     max_blocks: int, block_size: int, lookback: int, ratios: list[int], overlaps: list[bool]) -> None:
    """Write a DeepSeek-V4 decode step's plan lists into ``out``, in the order and with the values of
    ``PlanBuilder._chunks`` at a graph capacity (``engine/deepinfer/models/deepseek_v4/plan.py``, the reference).

    Host data only (CPU int64 tensors). ``S`` sequences; sequence ``i`` adds ``query_lens[i]`` tokens (1 for a plain
    decode, up to ``tokens_per_seq``: a speculative verification, the MTP pass over kept positions) from position
    ``c0[i]``; ``T`` tokens in all, packed in sequence order. ``rows = num_seqs * tokens_per_seq``.

    Args:
        out: ``[total]`` int64, contiguous (mutated): positions, token_slots, tok_bt ``[rows, max_blocks]``, tok_wbt
            ``[rows, ceil((lookback + tokens_per_seq - 1) / block_size) + 1]``, win_base, logits_indices,
            input_ids, row_valid (``rows`` each otherwise), then per ratio ``m`` (ring ``R = 2m`` with overlap, else
            ``m``; ``C = num_seqs * ceil(tokens_per_seq / m)`` closing windows, ``W = num_seqs * R * (1 +
            ceil((tokens_per_seq - 1) / block_size))`` state writes): ring_src ``[num_seqs * (R - 1)]``, cur
            ``[C, m]``, w_pos ``[C]``, dst ``[C]``, st_src ``[W]``, st_dst ``[W]``, and with overlap prev ``[C, m]``
            and prev_ok ``[C]``.
        c0: ``[S]`` first new position per sequence.
        query_lens: ``[S]`` new tokens per sequence, or ``[0]`` (one each).
        row_starts: ``[S]`` the token row of each sequence's first new token in the compressor lists, or ``[0]``
            (packed rows). Other rows: the ring-state commit of a deferred verification, whose kept tokens sit at
            the verification's rows.
        block_tables / window_tables: ``[S, width]`` ``full`` / ``window``-group block ids (``-1`` past a row; the
            window table may hold ``-1`` before the step's window).
        shared_len: ``[S]`` prefix-cache positions whose compressed entries are not written, or ``[0]``.
        input_ids: ``[T]`` token ids, or ``[0]`` (ids copied to the device later; zeros here).
        logits_indices: ``[<= rows]`` rows whose logits are returned.
        num_seqs, tokens_per_seq, max_blocks: the graph capacity (sequences, tokens each, block-table width).
        block_size, lookback: cache block size and the window lookback in positions.
        ratios / overlaps: the compression ratios present, in plan order, and whether each overlaps (CSA).
    Raises:
        RuntimeError naming the argument: wrong dtype, device, shape or size of ``out``, a query length outside
        ``[1, tokens_per_seq]``, or a table read outside its shape.
    """
    torch.ops.deepinfer_ops.decode_plan_fill(out, c0, query_lens, row_starts, block_tables, window_tables, shared_len,
                                             input_ids, logits_indices, num_seqs, tokens_per_seq, max_blocks,
                                             block_size, lookback, list(ratios), [int(o) for o in overlaps])


def step_tables_check(c0: torch.Tensor, query_lens: torch.Tensor, block_tables: torch.Tensor,
                      window_tables: torch.Tensor, shared_len: torch.Tensor, window_floor: torch.Tensor,
                      block_size: int, lookback: int, num_blocks: int, window_blocks: int, max_positions: int) -> bool:
    """Whether a step's block tables pass ``PlanBuilder.check_arrays`` (``engine/deepinfer/models/deepseek_v4/plan.py``
    holds the rules and the error messages; the engine reruns its per-sequence checks to name a fault).

    Host data only (CPU int64 tensors). ``S`` sequences; sequence ``i`` adds ``query_lens[i]`` tokens from position
    ``c0[i]``.

    Args:
        c0, query_lens: ``[S]``.
        block_tables: ``[S, width]`` ``full``-group block ids (``-1`` past a row).
        window_tables: ``[S, width_w]`` ``window``-group block ids, or ``[0, 0]``: ``block_tables`` serve both groups.
        shared_len, window_floor: ``[S]`` prefix-cache positions and the window group's first held position (whole
            blocks), or ``[0]``: all 0.
        block_size, lookback: cache block size and the window lookback in positions.
        num_blocks, window_blocks: each group's block count (ids must lie below it).
        max_positions: the model's ``max_position_embeddings``.
    Returns:
        True when valid: each sequence adds >= 1 token at a position >= 0; its context fits the tables and
        ``max_positions``; ``shared_len`` / ``window_floor`` are whole blocks with ``window_floor <= c0`` (and 0
        without a window table); per group the blocks read lie in ``[0, limit)``, no row lists a block twice, and a
        block a row writes is read by no other row.
    Raises:
        RuntimeError naming the argument: wrong dtype, device or shape.
    """
    out = torch.zeros(1, dtype=torch.int64)
    torch.ops.deepinfer_ops.step_tables_check(out, c0, query_lens, block_tables, window_tables, shared_len,
                                              window_floor, block_size, lookback, num_blocks, window_blocks,
                                              max_positions)
    return bool(out[0])
