"""The DeepSeek-V4 step plan: every per-step index the forward needs, built on the host, copied once.

``PlanBuilder.build`` reads the step's sequences as plain host data (first position, query length, block ids),
validates them there, and packs every index list into one host buffer: token slots, per-token block tables,
logits rows, and per compression ratio the compressor's ring reads, closing windows and state writes. One
host-to-device copy moves it; :meth:`StepPlan.finalize` derives the window and compressed-entry index lists on the
device, once per step for all layers. The forward then does device work only.

Graph mode (``capacity``): every list has a fixed length that depends on the capacity only (padded with
harmless entries: ``-1`` slots are skipped by the cache writes, padding rows read a valid slot and are never
written), so a CUDA graph captured for one plan replays for any other plan of the same bucket built into the
captured plan's buffer (``build(..., out=...)``). See ``docs/engine.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

import deepinfer_ops

from deepinfer.forward_batch import ForwardBatch, HostStager

from .cache import window_lookback
from .config import CSA, HCA, DeepseekV4Config


@dataclass(frozen=True)
class SeqStep:
    """One sequence of a step (host data): tokens at positions ``[c0, c0 + q)``, ``full``-group blocks
    ``block_ids`` and ``window``-group blocks ``window_ids`` (block j of either covers positions
    ``[j * block_size, (j + 1) * block_size)``; ``window_ids`` entries before the step's window, the blocks that end
    at or before ``c0 - lookback``, are not read and may be -1; ``None``: ``block_ids`` serve both groups).

    Prefix cache: ``shared_len`` positions of the ``full`` group are shared blocks this step never writes (the
    entries of windows that close at or before it are not written; a multiple of the block size or 0);
    ``window_floor`` (a multiple of the block size, ``<= c0``): ``window_ids`` before it may be -1 and the
    step's window reads stop there (a replay that starts without the window before it)."""

    c0: int
    q: int
    block_ids: tuple[int, ...]
    window_ids: tuple[int, ...] | None = None
    shared_len: int = 0
    window_floor: int = 0

    @property
    def L(self) -> int:
        return self.c0 + self.q


@dataclass(frozen=True)
class StepSeqs:
    """A step's sequences as arrays (host data, the runner's form): sequence i has tokens at positions
    ``[c0[i], c0[i] + q[i])``, its ``full``-group block ids in ``block_tables[i]`` and its ``window``-group ones in
    ``window_tables[i]`` (both in table order: column ``j`` covers positions ``[j * block_size, (j + 1) *
    block_size)``, ``-1`` after the table; a window row also reads ``-1`` for the blocks its group released, those
    before the step's window).

    Attributes:
        c0, q: ``[num_seqs]`` int64.
        block_tables: ``[num_seqs, width]`` int64, ``width`` at least the blocks of the longest context.
        window_tables: ``[num_seqs, width_w]`` int64 (same rule), or ``None``: ``block_tables`` serve both groups.
        shared_len, window_floor: ``[num_seqs]`` int64 (:class:`SeqStep`), or ``None``: all 0.
    """

    c0: np.ndarray
    q: np.ndarray
    block_tables: np.ndarray
    window_tables: np.ndarray | None = None
    shared_len: np.ndarray | None = None
    window_floor: np.ndarray | None = None

    @classmethod
    def from_list(cls, seqs: list[SeqStep], block_size: int) -> "StepSeqs":
        """Arrays of validated :class:`SeqStep` s (each row keeps the blocks its context needs; a window table
        when any sequence has ``window_ids``, where a sequence without takes its ``block_ids``)."""
        c0 = np.fromiter((s.c0 for s in seqs), np.int64, len(seqs))
        q = np.fromiter((s.q for s in seqs), np.int64, len(seqs))
        nbs = [_blocks_for(s.L, block_size) for s in seqs]
        width = max(nbs, default=0) or 1
        bt = np.full((len(seqs), width), -1, dtype=np.int64)
        for i, (s, k) in enumerate(zip(seqs, nbs)):
            bt[i, :k] = s.block_ids[:k]
        wt = None
        if any(s.window_ids is not None for s in seqs):
            wt = np.full((len(seqs), width), -1, dtype=np.int64)
            for i, (s, k) in enumerate(zip(seqs, nbs)):
                wt[i, :k] = (s.block_ids if s.window_ids is None else s.window_ids)[:k]
        shared = floor = None
        if any(s.shared_len or s.window_floor for s in seqs):
            shared = np.fromiter((s.shared_len for s in seqs), np.int64, len(seqs))
            floor = np.fromiter((s.window_floor for s in seqs), np.int64, len(seqs))
        return cls(c0, q, bt, wt, shared, floor)

    def at(self, c0: np.ndarray, q: np.ndarray, rows: list[int] | None = None) -> "StepSeqs":
        """The same sequences (``rows`` of them, in that order; all when None) computing positions
        ``[c0[i], c0[i] + q[i])`` instead: the tables are shared, not copied."""
        def pick(a):
            return a if rows is None or a is None else a[rows]

        return StepSeqs(c0, q, pick(self.block_tables), pick(self.window_tables), pick(self.shared_len),
                        pick(self.window_floor))

    def to_list(self) -> list[SeqStep]:
        """:class:`SeqStep` s of the rows (a row ends before its trailing ``-1`` s)."""
        def trim(row: list[int]) -> tuple[int, ...]:
            k = len(row)
            while k and row[k - 1] == -1:
                k -= 1
            return tuple(row[:k])

        n = len(self.c0)
        wrows = self.window_tables.tolist() if self.window_tables is not None else [None] * n
        shared = self.shared_len.tolist() if self.shared_len is not None else [0] * n
        floor = self.window_floor.tolist() if self.window_floor is not None else [0] * n
        return [SeqStep(c0, q, trim(row), None if wrow is None else trim(wrow), sh, fl)
                for c0, q, row, wrow, sh, fl in zip(self.c0.tolist(), self.q.tolist(), self.block_tables.tolist(),
                                                    wrows, shared, floor)]


@dataclass(frozen=True)
class Capacity:
    """Fixed list lengths of a graph-mode plan: ``num_seqs`` sequences of up to ``tokens_per_seq`` new tokens each
    (1: decode; more: a speculative verification's last token and drafts, at most ``block_size``), block tables of
    ``max_blocks`` ids, contexts up to ``max_len`` tokens. Rows are packed in sequence order, padding after the
    last sequence's rows."""

    num_seqs: int
    max_blocks: int
    max_len: int
    tokens_per_seq: int = 1

    @property
    def num_rows(self) -> int:
        return self.num_seqs * self.tokens_per_seq


@dataclass
class CompressorPlan:
    """Index lists of one compression ratio ``m`` for one step, shared by every layer (and both compressors of a
    CSA layer) of that ratio. Rows of ``all`` = ``cat(state[ring_src], new token rows)``.

    Attributes:
        ring_src: ``[n_ring]`` int64 flat slots ``block * R + p % R`` of the state rings read this step.
        cur: ``[n_close, m]`` int64 rows of ``all``: each closing window's own positions.
        prev: ``[n_close, m]`` int64 rows of ``all``: the previous window's positions (overlap only; row 0 where
            there is none). ``prev_ok [n_close]`` bool: whether it exists.
        w_pos: ``[n_close]`` int64 RoPE position ``w * m`` of each entry.
        dst: ``[n_close]`` int64 compressed-pool slots (``-1``: not written).
        st_src / st_dst: ``[n_st]`` int64 rows of ``all`` and the ring slots they are persisted to (``-1``: skipped).
        n_close: number of closing windows (host int; graph mode: the capacity).
        deferred: ``None`` (the state is written in the step), or a list: the step writes no ring state and each
            compressor appends ``(ring_kv, ring_gate, kv_new, gate_new)`` to it instead, for
            :func:`~.compressor.commit_deferred_state` once the step's kept length is known (speculative
            verification: a rejected position must not overwrite a ring row still needed).
    """

    ratio: int
    overlap: bool
    ring: int
    ring_src: torch.Tensor
    cur: torch.Tensor
    prev: torch.Tensor | None
    prev_ok: torch.Tensor | None
    w_pos: torch.Tensor
    dst: torch.Tensor
    st_src: torch.Tensor
    st_dst: torch.Tensor
    n_close: int
    deferred: list | None = None


@dataclass
class StepPlan:
    """The device-side plan of one step. Host ints describe shapes; every tensor lives on the model's device.

    Attributes:
        num_tokens: real token rows (the rest of the ``num_rows`` rows are padding).
        num_rows: rows of every per-token tensor.
        num_logits: real logits rows (the first ``num_logits`` of ``logits_indices``).
        max_len: longest context of the step (or the capacity): the RoPE table covers it.
        block_size: tokens per cache block.
        input_ids, positions: ``[num_rows]`` int64 (padding rows: token 0 at position 0).
        token_slots: ``[num_rows]`` int64 window-group slot of each token (``-1`` on padding rows).
        tok_bt: ``[num_rows, max_blocks]`` int64 ``full``-group block table of each token's sequence (``-1`` pads).
        tok_wbt: ``[num_rows, window_blocks]`` int64 ``window``-group blocks of each token's sequence from block
            index ``win_base`` on (``-1`` pads); win_base: ``[num_rows]`` int64.
        logits_indices: ``[num_logit_rows]`` int64.
        row_valid: ``[num_rows]`` int64, 1 for real rows (graph mode) or None (every row up to ``num_tokens`` is real).
        comp: ``{ratio: CompressorPlan}``.
        n_ent: ``{ratio: entries}`` the width of the compressed-entry lists (``max_len // ratio``).
        Derived once per step by :meth:`finalize` (device work): ``win_idx [num_rows, W]`` int32 (the last ``W``
        positions of each token, ``-1`` before 0), ``n_vis [num_rows]`` int64 (``(pos + 1) // m`` per ratio),
        ``hca_idx [num_rows, n_ent]`` int32 (every visible HCA entry), ``tok_bt32``.
    """

    num_tokens: int
    num_rows: int
    num_logits: int
    max_len: int
    block_size: int
    batch_invariant: bool
    input_ids: torch.Tensor
    positions: torch.Tensor
    token_slots: torch.Tensor
    tok_bt: torch.Tensor
    logits_indices: torch.Tensor
    row_valid: torch.Tensor | None
    comp: dict[int, CompressorPlan]
    n_ent: dict[int, int]
    graph: bool = False
    derived: dict = field(default_factory=dict)
    tok_wbt: torch.Tensor | None = None
    win_base: torch.Tensor | None = None

    def finalize(self, config: DeepseekV4Config) -> "StepPlan":
        """Derive the window / entry index lists (device ops only, once per step)."""
        B, W = self.block_size, config.sliding_window
        dev = self.positions.device
        pos = self.positions
        p = pos.view(-1, 1) + torch.arange(-W + 1, 1, device=dev)
        pc = p.clamp(min=0)
        col = (pc // B - self.win_base.view(-1, 1)).clamp(0, self.tok_wbt.shape[1] - 1)
        blk = self.tok_wbt.gather(1, col)
        self.derived["win_idx"] = torch.where((p >= 0) & (blk >= 0), blk * B + pc % B, -1).to(torch.int32)
        self.derived["tok_bt32"] = self.tok_bt.to(torch.int32)
        for m, n in self.n_ent.items():
            n_vis = (pos + 1) // m
            self.derived[f"n_vis{m}"] = n_vis
            if m == config.compress_rate_hca and n > 0:
                per_block = B // m
                w = torch.arange(n, device=dev).view(1, -1)
                blk = self.tok_bt.gather(1, (w // per_block).expand(self.num_rows, -1))
                self.derived["hca_idx"] = torch.where((w < n_vis.view(-1, 1)) & (blk >= 0),
                                                      blk * per_block + w % per_block, -1).to(torch.int32)
        return self


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def _blocks_for(n: int, block_size: int) -> int:
    return -(-n // block_size)


def _i64(a: np.ndarray | None, dim: int = 1) -> torch.Tensor:
    """A host array as a CPU int64 tensor sharing its memory where it can (``[0]`` / ``[0, 0]`` for None)."""
    if a is None:
        return torch.empty((0,) * dim, dtype=torch.int64)
    a = np.ascontiguousarray(a, dtype=np.int64)
    # torch warns on read-only arrays and refuses negative strides (kept on a length-1 axis of a reversed view)
    return torch.from_numpy(a if a.flags.writeable and min(a.strides, default=0) >= 0 else a.copy())


class PlanBuilder:
    """Builds :class:`StepPlan` s for one config and cache geometry.

    Args:
        config: the model config (ratios, sliding window).
        block_size: cache block size (a multiple of every compression ratio).
        num_blocks: ``full``-group capacity; its block ids must lie in ``[0, num_blocks)``.
        device: where the plan's tensors go.
        window_blocks: ``window``-group capacity (default ``num_blocks``).
    """

    def __init__(self, config: DeepseekV4Config, block_size: int, num_blocks: int, device: torch.device | str,
                 window_blocks: int | None = None):
        self.config = config
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.window_blocks = num_blocks if window_blocks is None else window_blocks
        self.lookback = window_lookback(config)
        self.device = torch.device(device)
        self._stager = HostStager()
        kinds = {config.layer_type_of_ratio(r) for r in tuple(config.compress_ratios) + tuple(config.mtp_compress_ratios)}
        self.ratios: list[tuple[int, bool]] = []  # (m, overlap) per compressed layer kind present
        if CSA in kinds:
            self.ratios.append((config.compress_rate_csa, True))
        if HCA in kinds:
            self.ratios.append((config.compress_rate_hca, False))

    # ---------------------------------------------------------------------------------------------------- host
    def check_seq(self, i: int, s: SeqStep) -> None:
        """Validate sequence ``i`` against the cache (host data): raises ValueError naming the field."""
        if not isinstance(s, SeqStep):
            raise ValueError(f"seqs[{i}]: expected a SeqStep, got {type(s).__name__}")
        if not (_is_int(s.c0) and _is_int(s.q)) or s.q < 1 or s.c0 < 0:
            raise ValueError(f"query_lens[{i}]={s.q!r} / context_lens[{i}]: need integers, "
                             "1 <= query_len <= context_len")
        nb = _blocks_for(s.L, self.block_size)
        if nb > len(s.block_ids):
            raise ValueError(f"block_tables: sequence {i} needs {nb} blocks for {s.L} tokens, row has "
                             f"{len(s.block_ids)}")
        ids = s.block_ids[:nb]
        if any(not _is_int(b) or b < 0 or b >= self.num_blocks for b in ids):
            raise ValueError(f"block_tables: sequence {i} uses a block id outside [0, {self.num_blocks}) (or not an "
                             f"integer): {list(ids)}")
        if len(set(ids)) != nb:
            raise ValueError(f"block_tables: sequence {i} lists a block twice: {list(ids)}")
        B = self.block_size
        if not (_is_int(s.shared_len) and s.shared_len >= 0 and s.shared_len % B == 0):
            raise ValueError(f"shared_len[{i}]: a multiple of the block size {B} >= 0 expected, got {s.shared_len!r}")
        if not (_is_int(s.window_floor) and 0 <= s.window_floor <= s.c0 and s.window_floor % B == 0):
            raise ValueError(f"window_floor[{i}]: a multiple of the block size {B} in [0, context_len - query_len = "
                             f"{s.c0}] expected, got {s.window_floor!r}")
        if s.window_ids is not None:
            w0 = max(self.first_window_block(s.c0), s.window_floor // B)
            if nb > len(s.window_ids):
                raise ValueError(f"window_block_tables: sequence {i} needs {nb} blocks for {s.L} tokens, row has "
                                 f"{len(s.window_ids)}")
            wids = s.window_ids[w0:nb]
            if any(not _is_int(b) or b < 0 or b >= self.window_blocks for b in wids):
                raise ValueError(f"window_block_tables: sequence {i} uses a block id outside [0, "
                                 f"{self.window_blocks}) (or not an integer) in blocks {w0}..{nb - 1}: {list(wids)}")
            if len(set(wids)) != nb - w0:
                raise ValueError(f"window_block_tables: sequence {i} lists a block twice: {list(wids)}")
        elif s.window_floor:
            raise ValueError(f"window_floor[{i}]: needs a window table (one table serves both groups)")
        elif nb and max(ids) >= self.window_blocks:
            raise ValueError(f"block_tables: sequence {i} uses a block id outside the window group's [0, "
                             f"{self.window_blocks}): {list(ids)}")
        if s.L > self.config.max_position_embeddings:
            raise ValueError(f"context_lens: {s.L} exceeds max_position_embeddings="
                             f"{self.config.max_position_embeddings}")

    def first_window_block(self, c0: int) -> int:
        """Index of the first ``window``-group block a step starting at ``c0`` reads."""
        return max(0, c0 - self.lookback) // self.block_size

    def check_step(self, seqs: list[SeqStep]) -> None:
        """Validate the whole step: every sequence (:meth:`check_seq`), and in each cache group no block a sequence
        writes this step (those holding positions ``c0 .. L - 1``) is used by another sequence of the step (full
        blocks read by several sequences, a shared prefix, are fine). Raises ValueError naming the field."""
        B = self.block_size
        for i, s in enumerate(seqs):
            self.check_seq(i, s)
        for name, ids_of, first_of, written_of in (
                ("block_tables", lambda s: s.block_ids, lambda s: 0, lambda s: max(s.c0, s.shared_len)),
                ("window_block_tables", lambda s: s.block_ids if s.window_ids is None else s.window_ids,
                 lambda s: max(self.first_window_block(s.c0), s.window_floor // B), lambda s: s.c0)):
            owner: dict[int, int] = {}
            for i, s in enumerate(seqs):
                for b in ids_of(s)[written_of(s) // B:_blocks_for(s.L, B)]:
                    owner[b] = i
            for i, s in enumerate(seqs):
                for b in ids_of(s)[first_of(s):_blocks_for(s.L, B)]:
                    if owner.get(b, i) != i:
                        raise ValueError(f"{name}: block {b} is written by sequence {owner[b]} in this step and "
                                         f"also used by sequence {i}")

    def check_arrays(self, seqs: StepSeqs) -> None:
        """:meth:`check_step` for the array form, in one C++ call (both cache groups,
        :func:`deepinfer_ops.step_tables_check`); on a fault the per-sequence checks name it (the same messages).
        Raises ValueError naming the field."""
        c0, q, bt, wt = seqs.c0, seqs.q, seqs.block_tables, seqs.window_tables
        arrays = (c0, q, bt) + tuple(a for a in (wt, seqs.shared_len, seqs.window_floor) if a is not None)
        try:  # the rules of check_step in one C++ loop; it also refuses wrong shapes
            ints = all(a.dtype.kind in "iu" for a in arrays) and c0.ndim == q.ndim == 1
            ok = ints and deepinfer_ops.step_tables_check(
                _i64(c0), _i64(q), _i64(bt), _i64(wt, 2), _i64(seqs.shared_len), _i64(seqs.window_floor),
                self.block_size, self.lookback, self.num_blocks, self.window_blocks,
                self.config.max_position_embeddings)
        except (AttributeError, RuntimeError, TypeError, ValueError):
            ints = ok = False
        if ok:
            return
        S = len(c0) if isinstance(c0, np.ndarray) and c0.ndim == 1 else -1
        if not (S >= 0 and all(isinstance(a, np.ndarray) for a in arrays) and q.shape == (S,)
                and all(t.ndim == 2 and t.shape[0] == S for t in (bt, wt) if t is not None)
                and all(a.shape == (S,) for a in (seqs.shared_len, seqs.window_floor) if a is not None)):
            raise ValueError("seqs: StepSeqs needs c0 [num_seqs], q [num_seqs], block_tables [num_seqs, width] "
                             "and window_tables (None or [num_seqs, width_w]) integer arrays")
        self.check_step(seqs.to_list())
        if ints and any(a.dtype.kind == "u" and a.size and int(a.max()) > np.iinfo(np.int64).max for a in arrays):
            raise ValueError("seqs: StepSeqs values must fit int64 (a uint64 entry is 2**63 or more)")
        if ints:
            raise RuntimeError("PlanBuilder.check_arrays: step_tables_check refused a step that check_step "
                               "accepts (the two sets of rules disagree: a bug)")
        raise ValueError("seqs: StepSeqs arrays must be int64 / int32 / uint arrays")

    def build(self, seqs: list[SeqStep], input_ids: list[int] | torch.Tensor, logits_indices: list[int],
              batch_invariant: bool = False, pad_multiple: int = 0, capacity: Capacity | None = None,
              out: torch.Tensor | None = None, finalize: bool = True, checked: bool = False) -> StepPlan:
        """The plan of one step (validated by :meth:`check_seq`, one host-to-device copy, then
        :meth:`StepPlan.finalize`).

        Args:
            seqs: the step's sequences in token-row order (``check``-ed here).
            input_ids: ``[num_tokens]`` host ids, or a tensor on the plan's device (kept as it is, padded).
            logits_indices: token rows whose logits are returned.
            pad_multiple: pad the token rows to a multiple of this (batch-invariant ``dequant`` path), 0 = none.
            capacity: graph mode: decode sequences only, every list at the fixed lengths of ``capacity``.
            out: a device int64 buffer of exactly the plan's size to hold it (graph mode: the captured plan's
                buffer, so the replay reads the new plan); default a fresh one.
            finalize: derive the device index lists now (graph mode: the captured forward derives them).
            checked: the sequences were validated by :meth:`check_seq` already.
        Raises:
            ValueError naming the field at fault (lengths, block ids, logits rows, capacity).
        """
        chunks, meta, T, rows, max_len = self._chunks(seqs, input_ids, logits_indices, pad_multiple, capacity, checked)
        views = self._upload(chunks, out)
        ids_t = views["input_ids"]
        if isinstance(input_ids, torch.Tensor):
            ids_t[:T].copy_(input_ids.reshape(-1), non_blocking=True)
        comp = {}
        for m, overlap, n_close in meta:
            g = lambda name: views.get(f"{name}{m}")  # noqa: E731
            comp[m] = CompressorPlan(m, overlap, 2 * m if overlap else m, g("ring_src"), g("cur"), g("prev"),
                                     g("prev_ok"), g("w_pos"), g("dst"), g("st_src"),
                                     g("st_dst"), n_close)
        n_ent = {m: max_len // m for m, _ in self.ratios}
        plan = StepPlan(T, rows, len(logits_indices), max_len, self.block_size, batch_invariant, ids_t,
                        views["positions"],
                        views["token_slots"], views["tok_bt"], views["logits_indices"],
                        views.get("row_valid"), comp, n_ent,
                        graph=capacity is not None, tok_wbt=views["tok_wbt"], win_base=views["win_base"])
        return plan.finalize(self.config) if finalize else plan

    def fill(self, seqs: StepSeqs, input_ids: list[int] | torch.Tensor, logits_indices: list[int],
             capacity: Capacity, out: torch.Tensor, checked: bool = False) -> tuple[int, int]:
        """Write a decode step (one token per sequence, or up to ``capacity.tokens_per_seq``: a verification, the
        MTP pass) into a captured graph-mode plan's buffer ``out``: what :meth:`build` with ``capacity`` and ``out``
        uploads, computed in one C++ call (:func:`deepinfer_ops.decode_plan_fill`; the numpy lists of
        :meth:`_chunks` are its reference) and copied without making the plan's views (the graph replays the
        captured plan). Returns ``(num_tokens, num_logits)`` for the captured plan. Raises as :meth:`build`."""
        seqs, c0s, qs, _, T, li_host, _ = self._check_inputs(seqs, input_ids, logits_indices, 0, capacity, checked)
        ids = None if isinstance(input_ids, torch.Tensor) else np.asarray(input_ids, dtype=np.int64)
        dev = self._fill(seqs, c0s, qs, None, ids, li_host, capacity, out)
        if ids is None:  # after positions, slots, tok_bt, tok_wbt, win_base and the logits rows
            at = capacity.num_rows * (4 + capacity.max_blocks + self._window_width(capacity.tokens_per_seq))
            dev[at:at + T].copy_(input_ids.reshape(-1), non_blocking=True)
        return T, len(logits_indices)

    def _window_width(self, tokens_per_seq: int) -> int:
        """Window-group blocks per token row at a graph capacity: ``lookback + q`` positions span at most these."""
        return _blocks_for(self.lookback + tokens_per_seq - 1, self.block_size) + 1

    def _fill(self, seqs: StepSeqs, c0s: np.ndarray, qs: np.ndarray, row_starts: np.ndarray | None,
              ids: np.ndarray | None, li_host: np.ndarray, capacity: Capacity, out: torch.Tensor | None) -> torch.Tensor:
        """:func:`deepinfer_ops.decode_plan_fill` of checked ``seqs`` at ``capacity``, uploaded (into ``out`` when
        given); returns the device buffer."""
        n, nb, qc = capacity.num_seqs, capacity.max_blocks, capacity.tokens_per_seq
        bt = seqs.block_tables.astype(np.int64, copy=False)
        wt = bt if seqs.window_tables is None else seqs.window_tables.astype(np.int64, copy=False)
        ratios, overlaps = [m for m, _ in self.ratios], [o for _, o in self.ratios]
        args = (_i64(c0s), _i64(None if qc == 1 else qs), _i64(row_starts), _i64(bt), _i64(wt), _i64(seqs.shared_len),
                _i64(ids), _i64(li_host.reshape(-1)))

        def write(host: torch.Tensor) -> None:
            deepinfer_ops.decode_plan_fill(host, *args, n, qc, nb, self.block_size, self.lookback, ratios, overlaps)

        return self._stager.upload_filled(self.fill_size(capacity), write, self.device, out)

    def fill_size(self, capacity: Capacity) -> int:
        """int64 entries of the buffer :func:`deepinfer_ops.decode_plan_fill` writes at ``capacity``."""
        n, nb, qc = capacity.num_seqs, capacity.max_blocks, capacity.tokens_per_seq
        size = n * qc * (6 + nb + self._window_width(qc))
        for m, overlap in self.ratios:
            R, close = (2 * m if overlap else m), n * -(-qc // m)
            size += n * (R - 1) + close * (m + 2) + 2 * n * R * (1 + -(-(qc - 1) // self.block_size))
            size += close * (m + 1) if overlap else 0
        return size

    def _check_inputs(self, seqs, input_ids, logits_indices, pad_multiple: int, capacity: Capacity | None,
                      checked: bool):
        """The checks of :meth:`build` / :meth:`fill`: ``(seqs as StepSeqs, c0 [S], q [S], L [S], num_tokens,
        logits_indices as an array, longest context)``. Raises ValueError naming the field."""
        if isinstance(seqs, StepSeqs):
            if not checked:
                self.check_arrays(seqs)
        else:
            if not checked:
                self.check_step(seqs)
            seqs = StepSeqs.from_list(seqs, self.block_size)
        B = self.block_size
        c0s, qs = seqs.c0.astype(np.int64, copy=False), seqs.q.astype(np.int64, copy=False)
        Ls = c0s + qs
        S = len(c0s)
        T = int(qs.sum())
        li_host = np.asarray(logits_indices)
        if li_host.size and (li_host.dtype.kind not in "iu" or li_host.ndim != 1 or int(li_host.min()) < 0
                             or int(li_host.max()) >= T):
            raise ValueError(f"logits_indices: integers in [0, {T}) expected")
        if not _is_int(pad_multiple) or pad_multiple < 0:
            raise ValueError(f"pad_multiple: an integer >= 0 expected, got {pad_multiple!r}")
        if isinstance(input_ids, torch.Tensor):
            if input_ids.dim() != 1 or input_ids.dtype not in (torch.int64, torch.int32) or input_ids.numel() != T:
                raise ValueError(f"input_ids: expected a 1-D int64 / int32 tensor of {T} ids (sum of query_lens), "
                                 f"got {tuple(input_ids.shape)} {input_ids.dtype}")
        else:
            if len(input_ids) != T:
                raise ValueError(f"input_ids: {len(input_ids)} ids for {T} tokens (sum of query_lens)")
            self.check_ids(input_ids)
        max_L = int(Ls.max()) if S else 0
        if capacity is not None and (S > capacity.num_seqs or (qs > capacity.tokens_per_seq).any()
                                     or not 1 <= capacity.tokens_per_seq <= B or max_L > capacity.max_len
                                     or len(logits_indices) > capacity.num_rows
                                     or _blocks_for(capacity.max_len, B) > capacity.max_blocks):
            raise ValueError(f"capacity: the step ({S} sequences, query lens {sorted(set(qs.tolist()))}, "
                             f"{len(logits_indices)} logits rows) does not fit {capacity}")
        return seqs, c0s, qs, Ls, T, li_host, max_L

    def _chunks(self, seqs, input_ids, logits_indices, pad_multiple: int, capacity: Capacity | None,
                checked: bool) -> tuple[dict[str, np.ndarray], list, int, int, int]:
        """The host part of :meth:`build`: ``(chunks by name, compressor meta, num_tokens, num_rows, max_len)``."""
        seqs, c0s, qs, Ls, T, li_host, max_L = self._check_inputs(seqs, input_ids, logits_indices, pad_multiple,
                                                                   capacity, checked)
        B = self.block_size
        S = len(c0s)
        w0s = np.maximum(c0s - self.lookback, 0) // B  # each sequence's first window-group block
        if capacity is not None:
            rows = capacity.num_rows
            nb = capacity.max_blocks
            # the window of q new tokens spans lookback + q positions: at most this many blocks
            nwb = _blocks_for(self.lookback + capacity.tokens_per_seq - 1, B) + 1
            max_len = capacity.max_len
        else:
            rows = -(-T // pad_multiple) * pad_multiple if pad_multiple > 0 else T
            nb = (_blocks_for(max_L, B) if S else 1) or 1
            nwb = int((-(-Ls // B) - w0s).max()) if S else 1
            max_len = max_L
        chunks: dict[str, np.ndarray] = {}
        starts = np.cumsum(qs) - qs  # each sequence's first token row
        positions = np.zeros(rows, dtype=np.int64)
        positions[:T] = np.repeat(c0s - starts, qs) + np.arange(T)
        row_seq = np.full(rows, S, dtype=np.int64)  # padding rows -> the all -1 table row S
        row_seq[:T] = np.repeat(np.arange(S), qs)
        seq_bt = np.full((S + 1, nb), -1, dtype=np.int64)
        w = min(nb, seqs.block_tables.shape[1])
        need = -(-Ls // B)
        seq_bt[:S, :w] = np.where(np.arange(w)[None, :] < need[:, None], seqs.block_tables[:, :w], -1)
        # window group: blocks w0 .. need - 1 of each sequence, from column 0 of its row (win_base = w0)
        wt = seqs.block_tables if seqs.window_tables is None else seqs.window_tables
        seq_wbt = np.full((S + 1, nwb), -1, dtype=np.int64)
        seq_w0 = np.zeros(S + 1, dtype=np.int64)
        seq_w0[:S] = w0s
        if S and wt.shape[1]:
            cols = w0s[:, None] + np.arange(nwb)[None, :]
            inside = (cols < need[:, None]) & (cols < wt.shape[1])
            seq_wbt[:S] = np.where(inside, wt[np.arange(S)[:, None], np.minimum(cols, wt.shape[1] - 1)], -1)
        tok_bt = seq_bt[row_seq]
        tok_wbt = seq_wbt[row_seq]
        win_base = seq_w0[row_seq]
        slots = np.full(rows, -1, dtype=np.int64)
        slots[:T] = tok_wbt[np.arange(T), positions[:T] // B - win_base[:T]] * B + positions[:T] % B
        chunks["positions"] = positions
        chunks["token_slots"] = slots
        chunks["tok_bt"] = tok_bt
        chunks["tok_wbt"] = tok_wbt
        chunks["win_base"] = win_base
        n_logit_rows = capacity.num_rows if capacity is not None else len(logits_indices)
        li = np.zeros(n_logit_rows, dtype=np.int64)
        li[:li_host.size] = li_host
        chunks["logits_indices"] = li
        ids = np.zeros(rows, dtype=np.int64)
        if not isinstance(input_ids, torch.Tensor):
            ids[:T] = input_ids
        chunks["input_ids"] = ids
        if capacity is not None:
            chunks["row_valid"] = (np.arange(rows) < T).astype(np.int64)
        meta = []
        for m, overlap in self.ratios:
            if S and int(qs.max()) <= B and (S >= self.VECTORISE_FROM or (qs == 1).all()):
                lists = self._short_compressor_lists(c0s, Ls, seq_bt, seq_wbt, w0s, starts, m, overlap, capacity,
                                                     seqs.shared_len)
            else:
                lists = self._compressor_lists(c0s.tolist(), Ls.tolist(), seq_bt.tolist(), seq_wbt.tolist(),
                                               w0s.tolist(), starts.tolist(), m, overlap, capacity,
                                               None if seqs.shared_len is None else seqs.shared_len.tolist())
            meta.append((m, overlap, lists["n_close"]))
            for name, arr in lists.items():
                if name != "n_close":
                    chunks[f"{name}{m}"] = arr
        return chunks, meta, T, rows, max_len

    def state_commit(self, seqs: StepSeqs, row_starts: np.ndarray, checked: bool = False,
                     capacity: Capacity | None = None,
                     out: torch.Tensor | None = None) -> dict[int, tuple[torch.Tensor, ...]]:
        """The ring-state writes of a step whose state was deferred (``CompressorPlan.deferred``), for the tokens
        it keeps: sequence ``i`` keeps positions ``[c0[i], c0[i] + q[i])`` of the step, whose token rows start at
        ``row_starts[i]`` (``[num_seqs]`` int64, the step's own rows). Returns ``{ratio: (ring_src, st_src,
        st_dst)}`` on the device (one copy): the lists of a graph-mode plan of exactly the kept tokens
        (:func:`deepinfer_ops.decode_plan_fill`, padding rows writing nowhere), their new-token rows pointing into
        the deferred step's rows. ``checked``: ``seqs`` (or a step over the same tables covering their positions)
        passed :meth:`check_arrays` already. ``capacity`` fixes the list lengths (a captured commit's; else the
        step's own) and ``out`` (:meth:`fill_size` entries) receives them. Host data; raises ValueError naming
        the field (``capacity`` when the step does not fit it)."""
        if not checked:
            self.check_arrays(seqs)
        B = self.block_size
        c0s, qs = seqs.c0.astype(np.int64), seqs.q.astype(np.int64)
        S = len(c0s)
        row_starts = np.asarray(row_starts, dtype=np.int64)
        if row_starts.shape != (S,):
            raise ValueError(f"row_starts: expected [{S}] ints, got shape {row_starts.shape}")
        if not S or not self.ratios:
            empty = torch.empty(0, dtype=torch.int64, device=self.device)
            return {m: (empty, empty, empty) for m, _ in self.ratios}
        qc = int(qs.max())
        if qc > B:
            raise ValueError(f"seqs: a commit keeps at most block_size={B} tokens per sequence, got {qc}")
        cap = Capacity(S, max(1, seqs.block_tables.shape[1]), int((c0s + qs).max()), qc)
        if capacity is not None:
            if S > capacity.num_seqs or qc > capacity.tokens_per_seq or cap.max_len > capacity.max_len:
                raise ValueError(f"capacity: the commit ({S} sequences keeping up to {qc} tokens, contexts to "
                                 f"{cap.max_len}) does not fit {capacity}")
            cap = capacity
        dev = self._fill(seqs, c0s, qs, row_starts, None, np.zeros(0, dtype=np.int64), cap, out)
        n, qc = cap.num_seqs, cap.tokens_per_seq
        at = cap.num_rows * (6 + cap.max_blocks + self._window_width(qc))
        lists = {}
        for m, overlap in self.ratios:  # the layout of _chunks: ring_src, cur, w_pos, dst, st_src, st_dst, ...
            R, close = (2 * m if overlap else m), n * -(-qc // m)
            n_ring, n_st = n * (R - 1), n * R * (1 + -(-(qc - 1) // B))
            ring_src = dev[at:at + n_ring]
            at += n_ring + close * (m + 2)
            lists[m] = (ring_src, dev[at:at + n_st], dev[at + n_st:at + 2 * n_st])
            at += 2 * n_st + (close * (m + 1) if overlap else 0)
        return lists

    def check_ids(self, ids) -> None:
        """Token ids must lie in ``[0, vocab_size)`` (host data; raises ValueError naming ``input_ids``)."""
        a = np.asarray(ids)
        if a.size and (a.dtype.kind not in "iu" or int(a.min()) < 0 or int(a.max()) >= self.config.vocab_size):
            raise ValueError(f"input_ids: token ids must be integers in [0, {self.config.vocab_size})")

    def _upload(self, chunks: dict[str, np.ndarray], out: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """``chunks`` in one host-to-device copy that does not wait for the device (:class:`HostStager`); returns
        device views by name."""
        dev = self._stager.upload(list(chunks.values()), self.device, out)
        views, at = {}, 0
        for name, a in chunks.items():
            views[name] = dev[at:at + a.size].view(a.shape)
            at += a.size
        return views

    def from_forward_batch(self, batch: ForwardBatch, pad_multiple: int = 0) -> StepPlan:
        """A plan from a :class:`ForwardBatch` (the test / convenience form of a step): its shapes and positions are
        checked on the host (errors name the field and the first faulty sequence), then :meth:`build`."""
        ids, pos = batch.input_ids, batch.positions
        if ids.dim() != 1 or ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"input_ids: expected 1-D int64, got {tuple(ids.shape)} {ids.dtype}")
        if pos.shape != ids.shape:
            raise ValueError(f"positions: shape {tuple(pos.shape)} != input_ids {tuple(ids.shape)}")
        if len(batch.query_lens) != len(batch.context_lens):
            raise ValueError("query_lens / context_lens: different number of sequences")
        if sum(batch.query_lens) != ids.shape[0]:
            raise ValueError(f"query_lens: sum {sum(batch.query_lens)} != num_tokens {ids.shape[0]}")
        bt = batch.block_tables
        li = batch.logits_indices
        if li.dim() != 1 or li.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"logits_indices: expected 1-D int64, got {tuple(li.shape)} {li.dtype}")
        if bt.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"block_tables: expected int32 / int64, got {bt.dtype}")
        self.check_ids(ids.cpu().numpy())
        if bt.dim() != 2 or bt.shape[0] != len(batch.query_lens):
            raise ValueError(f"block_tables: expected [num_seqs={len(batch.query_lens)}, max_blocks], got "
                             f"{tuple(bt.shape)}")
        rows = bt.cpu().long().tolist()
        pos_cpu = pos.cpu()
        seqs, a = [], 0
        for i, (q, L) in enumerate(zip(batch.query_lens, batch.context_lens)):
            if q < 1 or L < q:
                raise ValueError(f"query_lens[{i}]={q} / context_lens[{i}]={L}: need 1 <= query_len <= context_len")
            if not torch.equal(pos_cpu[a:a + q], torch.arange(L - q, L, dtype=pos_cpu.dtype)):
                raise ValueError(f"positions: sequence {i} must hold {L - q}..{L - 1} "
                                 "(context_len - query_len .. context_len - 1)")
            seqs.append(SeqStep(L - q, q, tuple(rows[i])))
            self.check_seq(i, seqs[-1])
            a += q
        self.check_step(seqs)
        return self.build(seqs, ids, li.cpu().tolist(), batch.batch_invariant, pad_multiple, checked=True)

    def _compressor_lists(self, c0s: list[int], Ls: list[int], bts: list[list[int]], wbts: list[list[int]],
                          w0s: list[int], starts: list[int], m: int, overlap: bool, capacity: Capacity | None,
                          shared: list[int] | None = None) -> dict:
        """The :class:`CompressorPlan` lists of ratio ``m`` as numpy arrays (padded to ``capacity`` in graph mode),
        per sequence in Python: steps with long chunks (short ones take :meth:`_short_compressor_lists`).
        ``bts``: ``full``-group tables (compressed entries); ``wbts``: ``window``-group blocks (the state rings)
        from block ``w0s[i]`` on.

        Per sequence (positions ``[c0, L)`` new): windows ``w`` in ``[c0 // m, L // m)`` close; the open window(s)
        of ``c0`` start at ``s0`` (CSA: one window earlier, whose first half feeds the next entry). Ring rows
        ``[s0, c0)`` of the block of ``c0 - 1`` are read when a window closes or when the state moves to another
        block. The state as of ``E`` goes to the ring of the block of ``E - 1`` for every block end ``E`` the step
        crosses and for ``E = L``; rows a ring already holds are not written again.

        ``shared[i]``: windows closing at or before it are pooled nowhere (``dst`` -1: shared prefix-cache
        entries); a ring read from a block the sequence does not hold (a replay's start) reads slot 0 instead,
        whose rows only feed such windows."""
        B = self.block_size
        R = 2 * m if overlap else m
        per_block = B // m
        ring_src: list[int] = []
        cur: list[int] = []
        prev: list[int] = []
        prev_ok: list[int] = []
        w_pos: list[int] = []
        dst: list[int] = []
        st_src: list[int] = []
        st_dst: list[int] = []
        ring_rows_cap = R - 1  # graph mode: ring reads per sequence (a decode reads at most R - 1 positions)
        for i, (c0, L, bids, wrow, w0) in enumerate(zip(c0s, Ls, bts, wbts, w0s)):
            s0 = max(0, (c0 // m) * m - m) if overlap else (c0 // m) * m
            first_w, end_w = c0 // m, L // m
            ends = list(range((c0 // B + 1) * B, L, B)) + [L]
            same = [c0 > 0 and (E - 1) // B == (c0 - 1) // B for E in ends]
            r0s = [max(0, (E // m) * m - m) if overlap else (E // m) * m for E in ends]
            starts_w = [max(r0, c0) if sm else r0 for r0, sm in zip(r0s, same)]
            read = c0 > s0 and (end_w > first_w or any(st < c0 for st in starts_w))
            base = len(ring_src)
            if read:
                blk = max(wrow[(c0 - 1) // B - w0], 0)
                ring_src.extend(blk * R + p % R for p in range(s0, c0))
            if capacity is not None:
                ring_src.extend([0] * (base + ring_rows_cap - len(ring_src)))

            def row(p: int, i=i, s0=s0, base=base, c0=c0) -> int:
                # ring rows as they are, new-token rows r as -(r + 1) (they follow every ring row, fixed up below)
                return -(starts[i] + p - c0) - 1 if p >= c0 else base + p - s0

            for w in range(first_w, end_w):
                cur.extend(row(p) for p in range(w * m, w * m + m))
                if overlap:
                    if w >= 1:
                        prev.extend(row(p) for p in range((w - 1) * m, w * m))
                        prev_ok.append(1)
                    else:
                        prev.extend([0] * m)
                        prev_ok.append(0)
                w_pos.append(w * m)
                dst.append(-1 if shared is not None and (w + 1) * m <= shared[i]
                           else bids[(w * m) // B] * per_block + w % per_block)
            for E, st in zip(ends, starts_w):
                blk = wrow[(E - 1) // B - w0]
                for p in range(st, E):
                    st_src.append(row(p))
                    st_dst.append(blk * R + p % R)
        if capacity is not None:
            n, q = capacity.num_seqs, capacity.tokens_per_seq
            ring_src.extend([0] * (n * ring_rows_cap - len(ring_src)))
            # q new tokens close at most ceil(q / m) windows and cross at most ceil((q - 1) / B) block ends
            # besides their own last one, each end writing at most R state rows
            close_cap, st_cap = -(-q // m), R * (1 + -(-(q - 1) // B))
            k = n * close_cap - len(w_pos)
            cur.extend([0] * (k * m))
            if overlap:
                prev.extend([0] * (k * m))
                prev_ok.extend([0] * k)
            w_pos.extend([0] * k)
            dst.extend([-1] * k)
            k = n * st_cap - len(st_dst)
            st_src.extend([0] * k)
            st_dst.extend([-1] * k)
        n_ring = len(ring_src)

        def rows(entries) -> np.ndarray:
            a = np.array(entries, dtype=np.int64)
            return np.where(a < 0, n_ring - 1 - a, a)

        out = {"ring_src": np.array(ring_src, dtype=np.int64), "cur": rows(cur).reshape(-1, m),
               "w_pos": np.array(w_pos, dtype=np.int64), "dst": np.array(dst, dtype=np.int64),
               "st_src": rows(st_src), "st_dst": np.array(st_dst, dtype=np.int64), "n_close": len(w_pos)}
        if overlap:
            out["prev"] = rows(prev).reshape(-1, m)
            out["prev_ok"] = np.array(prev_ok, dtype=np.int64)
        return out

    # sequences from which a step of up to block_size tokens each takes the vectorised lists (below, numpy's
    # fixed cost per call outweighs the per-sequence Python, measured on the CPU machine; a decode step always
    # takes them)
    VECTORISE_FROM = 16

    def _short_compressor_lists(self, c0: np.ndarray, L: np.ndarray, bt: np.ndarray, wbt: np.ndarray, w0: np.ndarray,
                                starts: np.ndarray, m: int, overlap: bool, capacity: Capacity | None,
                                shared: np.ndarray | None = None) -> dict:
        """:meth:`_compressor_lists` of a step whose sequences each add 1 to ``block_size`` tokens (a verification,
        the MTP pass over its kept positions, their ring-state commit), vectorised over the sequences: the same
        lists in the same order. A sequence then crosses at most one block end before its last position."""
        B = self.block_size
        R = 2 * m if overlap else m
        per_block = B // m
        S = len(c0)
        i = np.arange(S)
        s0 = np.maximum(0, (c0 // m) * m - m) if overlap else (c0 // m) * m
        first_w, end_w = c0 // m, L // m
        e1 = (c0 // B + 1) * B  # the block end inside the step, if any, then L
        has1 = e1 < L
        ends = np.stack([np.where(has1, e1, L), L], axis=1)
        end_ok = np.stack([np.ones(S, dtype=bool), has1], axis=1)
        same = (c0 > 0)[:, None] & ((ends - 1) // B == ((c0 - 1) // B)[:, None])
        r0 = np.maximum(0, (ends // m) * m - m) if overlap else (ends // m) * m
        st = np.where(same, np.maximum(r0, c0[:, None]), r0)
        read = (c0 > s0) & ((end_w > first_w) | ((st < c0[:, None]) & end_ok).any(axis=1))
        n_read = np.where(read, c0 - s0, 0)
        k = np.arange(R - 1)
        blk_prev = np.maximum(wbt[i, np.maximum(c0 - 1, 0) // B - w0], 0)  # -1: a replay's start (as there)
        ring_slot = blk_prev[:, None] * R + (s0[:, None] + k[None, :]) % R
        valid = k[None, :] < n_read[:, None]
        if capacity is not None:
            ring_src = np.zeros(capacity.num_seqs * (R - 1), dtype=np.int64)
            ring_src[:S * (R - 1)] = np.where(valid, ring_slot, 0).reshape(-1)
            base = i * (R - 1)
        else:
            ring_src = ring_slot[valid]
            base = np.cumsum(n_read) - n_read
        n_ring = ring_src.size

        def row(pos: np.ndarray, at: np.ndarray) -> np.ndarray:
            """Rows of ``all``: ring rows first, then the step's new-token rows."""
            return np.where(pos >= c0[at], n_ring + starts[at] + pos - c0[at], base[at] + pos - s0[at])

        wj = np.arange(int((L - c0).max()) // m + 1)
        cs, cj = np.nonzero(first_w[:, None] + wj[None, :] < end_w[:, None])  # closing windows, sequence order
        w = first_w[cs] + cj
        win = (w * m)[:, None] + np.arange(m)[None, :]
        cur = row(win, cs[:, None])
        w_pos = w * m
        dst = bt[cs, w_pos // B] * per_block + w % per_block
        if shared is not None:
            dst = np.where((w + 1) * m <= shared[cs], -1, dst)
        if overlap:
            has_prev = w >= 1
            prev = np.where(has_prev[:, None], row(win - m, cs[:, None]), 0)
            prev_ok = has_prev.astype(np.int64)
        pos = st[:, :, None] + np.arange(R)[None, None, :]  # state writes: positions st .. E - 1 per end E
        keep = end_ok[:, :, None] & (pos < ends[:, :, None])
        blk = wbt[i[:, None], (ends - 1) // B - w0[:, None]]
        st_src = row(pos, i[:, None, None])[keep]
        st_dst = (blk[:, :, None] * R + pos % R)[keep]
        if capacity is not None:
            n, q = capacity.num_seqs, capacity.tokens_per_seq
            pad = n * -(-q // m) - w_pos.size
            cur = np.concatenate([cur.reshape(-1, m), np.zeros((pad, m), dtype=np.int64)])
            w_pos = np.concatenate([w_pos, np.zeros(pad, dtype=np.int64)])
            dst = np.concatenate([dst, np.full(pad, -1, dtype=np.int64)])
            if overlap:
                prev = np.concatenate([prev.reshape(-1, m), np.zeros((pad, m), dtype=np.int64)])
                prev_ok = np.concatenate([prev_ok, np.zeros(pad, dtype=np.int64)])
            pad = n * R * (1 + -(-(q - 1) // B)) - st_dst.size
            st_src = np.concatenate([st_src, np.zeros(pad, dtype=np.int64)])
            st_dst = np.concatenate([st_dst, np.full(pad, -1, dtype=np.int64)])
        out = {"ring_src": ring_src.astype(np.int64), "cur": cur.reshape(-1, m).astype(np.int64),
               "w_pos": w_pos.astype(np.int64), "dst": dst.astype(np.int64), "st_src": st_src.astype(np.int64),
               "st_dst": st_dst.astype(np.int64), "n_close": w_pos.size}
        if overlap:
            out["prev"] = prev.reshape(-1, m).astype(np.int64)
            out["prev_ok"] = prev_ok.astype(np.int64)
        return out
