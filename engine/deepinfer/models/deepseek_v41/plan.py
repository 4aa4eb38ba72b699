"""DeepSeek-V4.1 step plans: the runner's arrays, validated on the host, as the forward's per-sequence segments.

The forward runs attention per sequence (each reads its own block-table rows through
:class:`~.cache.PagedSeqView`) and every token-wise op on all of the step's rows at once, so the plan is the token
ids, the logits rows and one :class:`SeqPlan` per sequence. Everything the forward indexes with is checked here,
before the forward: a bad row fails the step with a ValueError naming the field and the sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .cache import window_lookback
from .config import DeepseekV41Config


@dataclass(frozen=True)
class SeqPlan:
    """One sequence of a step: ``n`` tokens at positions ``[start, start + n)``, its ``full`` / ``window`` block
    rows (int64 tensors, ``-1`` = none), the positions of shared ``full`` blocks it never writes and the first
    position its window table holds."""

    start: int
    n: int
    full_row: torch.Tensor
    window_row: torch.Tensor
    shared_len: int = 0
    floor: int = 0


@dataclass
class StepPlan:
    """One engine step.

    Attributes:
        num_tokens, num_logits: rows of the step and rows whose logits are returned.
        input_ids: int64 ``[num_tokens]`` (the runner writes tokens still in flight into it).
        logits_indices: int64 ``[num_logits]`` rows of ``input_ids``.
        seqs: one :class:`SeqPlan` per sequence, in row order.
        batch_invariant: the engine's mode (on the CPU every V4.1 op computes a row alike either way; LLM refuses
            the mode on CUDA).
        derived: unused (the runner's graph capture clears it; V4.1 captures no graphs).
    """

    num_tokens: int
    num_logits: int
    input_ids: torch.Tensor
    logits_indices: torch.Tensor
    seqs: list[SeqPlan]
    batch_invariant: bool = False
    derived: dict = field(default_factory=dict)


def _blocks(n: np.ndarray, bs: int) -> np.ndarray:
    return -(-n // bs)


class PlanBuilder:
    """Step plans over a cache of ``num_blocks`` ``full`` and ``window_blocks`` ``window`` blocks of
    ``block_size`` positions (the runner builds one per cache: ``model.plan_builder(cache)``)."""

    def __init__(self, config: DeepseekV41Config, block_size: int, num_blocks: int,
                 device: torch.device | str = "cpu", window_blocks: int | None = None):
        self.config = config
        self.block_size = int(block_size)
        self.num_blocks = int(num_blocks)
        self.window_blocks = int(num_blocks if window_blocks is None else window_blocks)
        self.device = torch.device(device)
        self.lookback = window_lookback(config)

    def build(self, seqs, input_ids, logits_indices, batch_invariant: bool = False,
              pad_multiple: int = 0) -> StepPlan:
        """The plan of ``seqs`` (a ``deepseek_v4.plan.StepSeqs``: ``c0``, ``q``, ``block_tables``,
        ``window_tables`` (None: ``block_tables`` serve both groups), ``shared_len``, ``window_floor``).

        Args:
            input_ids: ``[num_tokens]`` host ids (ints; 0 where the runner feeds a token in flight).
            logits_indices: rows whose logits are returned.
            pad_multiple: ignored (no padded rows on this path).
        Raises:
            ValueError naming the field at fault: lengths, positions beyond ``max_seq_len``, a block id outside its
            pool or missing where the step reads or writes, a block two sequences of the step both write, an id
            outside the vocabulary, a logits row outside the step.
        """
        c, bs = self.config, self.block_size
        c0 = np.asarray(seqs.c0, dtype=np.int64)
        q = np.asarray(seqs.q, dtype=np.int64)
        n = len(c0)
        full = np.asarray(seqs.block_tables, dtype=np.int64).reshape(n, -1)
        win = full if seqs.window_tables is None else np.asarray(seqs.window_tables, dtype=np.int64).reshape(n, -1)
        zeros = np.zeros(n, dtype=np.int64)
        shared = zeros if seqs.shared_len is None else np.asarray(seqs.shared_len, dtype=np.int64)
        floor = zeros if seqs.window_floor is None else np.asarray(seqs.window_floor, dtype=np.int64)
        ids = np.asarray(input_ids, dtype=np.int64).reshape(-1)
        rows = np.asarray(logits_indices, dtype=np.int64).reshape(-1)
        if len(q) != n or len(shared) != n or len(floor) != n:
            raise ValueError("StepSeqs: c0, q, shared_len and window_floor must have one entry per sequence")
        if (c0 < 0).any() or (q < 1).any():
            i = int(np.flatnonzero((c0 < 0) | (q < 1))[0])
            raise ValueError(f"StepSeqs: sequence {i} has start {c0[i]} and {q[i]} new tokens (start >= 0, >= 1 token)")
        end = c0 + q
        if n and int(end.max()) > c.max_seq_len:
            i = int(end.argmax())
            raise ValueError(f"StepSeqs: sequence {i} reaches position {end[i]}, beyond max_seq_len {c.max_seq_len}")
        if int(q.sum()) != len(ids):
            raise ValueError(f"input_ids: {len(ids)} ids for {int(q.sum())} scheduled tokens")
        if ids.size and (ids.min() < 0 or ids.max() >= c.vocab_size):
            raise ValueError(f"input_ids: ids must lie in [0, {c.vocab_size})")
        if rows.size and (rows.min() < 0 or rows.max() >= len(ids)):
            raise ValueError(f"logits_indices: rows must lie in [0, {len(ids)})")
        if (floor < 0).any() or (floor > c0).any() or (shared < 0).any():
            i = int(np.flatnonzero((floor < 0) | (floor > c0) | (shared < 0))[0])
            raise ValueError(f"StepSeqs: sequence {i}: window_floor {floor[i]} must lie in [0, start {c0[i]}], "
                             f"shared_len {shared[i]} >= 0")
        nb = _blocks(end, bs)
        for i in range(n):
            self._check_row("block_tables", i, full[i], 0, int(nb[i]), self.num_blocks)
            lo = max(int(c0[i]) - self.lookback, int(floor[i]), 0) // bs
            self._check_row("window_tables", i, win[i], lo, int(nb[i]), self.window_blocks)
        self._check_writes(full, win, c0, end, shared, seqs.window_tables is None)
        # one copy per table to the plan's device; each sequence's rows are views of it
        full_d = torch.from_numpy(full.copy()).to(self.device)
        win_d = full_d if win is full else torch.from_numpy(win.copy()).to(self.device)
        plans = [SeqPlan(int(c0[i]), int(q[i]), full_d[i, :max(int(nb[i]), 1)], win_d[i, :max(int(nb[i]), 1)],
                         int(shared[i]), int(floor[i]))
                 for i in range(n)]
        return StepPlan(len(ids), len(rows), torch.from_numpy(ids.copy()).to(self.device),
                        torch.from_numpy(rows.copy()).to(self.device), plans, bool(batch_invariant))

    @staticmethod
    def _check_row(name: str, i: int, row: np.ndarray, lo: int, hi: int, capacity: int) -> None:
        """Blocks ``[lo, hi)`` of table row ``row`` must be ids of a pool of ``capacity`` blocks."""
        if len(row) < hi:
            raise ValueError(f"{name}: sequence {i} has {len(row)} block columns, its context needs {hi}")
        seg = row[lo:hi]
        bad = (seg < 0) | (seg >= capacity)
        if bad.any():
            j = lo + int(np.flatnonzero(bad)[0])
            raise ValueError(f"{name}: sequence {i} block {j} is {row[j]}, not a block id in [0, {capacity})")

    def _check_writes(self, full, win, c0, end, shared, one_table: bool) -> None:
        """No block is written by two sequences of the step (window: blocks of ``[c0, end)``; full: blocks of
        ``[max(c0, shared_len), end)``)."""
        bs = self.block_size
        written: dict[tuple[str, int], int] = {}
        for i in range(len(c0)):
            groups = [("window", win[i], int(c0[i]))]
            if int(end[i]) > int(shared[i]):
                groups.append(("full", full[i], max(int(c0[i]), int(shared[i]))))
            for g, row, lo in groups:
                key_g = "full" if one_table else g
                for b in row[lo // bs:-(-int(end[i]) // bs)].tolist():
                    other = written.setdefault((key_g, b), i)
                    if other != i:
                        raise ValueError(f"block_tables: block {b} ({g} group) is written by sequences {other} and "
                                         f"{i} in one step")

    def from_forward_batch(self, batch, pad_multiple: int = 0) -> StepPlan:
        """The plan of a ``ForwardBatch`` (one block table serving both groups). Raises ValueError like
        :meth:`build`."""
        from ..deepseek_v4.plan import StepSeqs

        q = np.asarray(batch.query_lens, dtype=np.int64)
        ctx = np.asarray(batch.context_lens, dtype=np.int64)
        if len(q) != len(ctx):
            raise ValueError("ForwardBatch: query_lens and context_lens differ in length")
        seqs = StepSeqs(ctx - q, q, batch.block_tables.cpu().numpy().astype(np.int64))
        return self.build(seqs, batch.input_ids.cpu().tolist(), batch.logits_indices.cpu().tolist(),
                          batch.batch_invariant)
