"""Engine host work in C++: the step-plan lists of a graph-mode decode step."""

from __future__ import annotations

import torch


def decode_plan_fill(out: torch.Tensor, c0: torch.Tensor, block_tables: torch.Tensor, window_tables: torch.Tensor,
                     shared_len: torch.Tensor, input_ids: torch.Tensor, logits_indices: torch.Tensor, num_rows: int,
                     max_blocks: int, block_size: int, lookback: int, ratios: list[int], overlaps: list[bool]) -> None:
    """Write a DeepSeek-V4 decode step's plan lists into ``out``, in the order and with the values of
    ``PlanBuilder._chunks`` at a graph capacity (``engine/deepinfer/models/deepseek_v4/plan.py``, the reference).

    Host data only (CPU int64 tensors). S decode sequences, one new token each at position ``c0[i]``.

    Args:
        out: ``[total]`` int64, contiguous (mutated): positions, token_slots, tok_bt ``[num_rows, max_blocks]``,
            tok_wbt ``[num_rows, ceil(lookback / block_size) + 1]``, win_base, logits_indices, input_ids,
            row_valid (``num_rows`` each otherwise), then per ratio ``m`` (ring ``R = 2m`` with overlap, else
            ``m``): ring_src ``[num_rows * (R - 1)]``, cur ``[num_rows, m]``, w_pos, dst, st_src ``[num_rows * R]``,
            st_dst ``[num_rows * R]``, and with overlap prev ``[num_rows, m]`` and prev_ok.
        c0: ``[S]`` positions.
        block_tables / window_tables: ``[S, width]`` ``full`` / ``window``-group block ids (``-1`` past a row; the
            window table may hold ``-1`` before the step's window).
        shared_len: ``[S]`` prefix-cache positions whose compressed entries are not written, or ``[0]``.
        input_ids: ``[S]`` token ids, or ``[0]`` (ids copied to the device later; zeros here).
        logits_indices: ``[<= num_rows]`` rows whose logits are returned.
        num_rows, max_blocks: the graph capacity (sequences, block-table width).
        block_size, lookback: cache block size and the window lookback in positions.
        ratios / overlaps: the compression ratios present, in plan order, and whether each overlaps (CSA).
    Raises:
        RuntimeError naming the argument: wrong dtype, device, shape, or a table read outside its shape.
    """
    torch.ops.deepinfer_ops.decode_plan_fill(out, c0, block_tables, window_tables, shared_len, input_ids,
                                             logits_indices, num_rows, max_blocks, block_size, lookback,
                                             list(ratios), [int(o) for o in overlaps])
