"""Paged cache blocks: one free list and one block table per sequence for each cache group.

A cache group is a set of pools addressed by the same block ids (vLLM's ``KVCacheGroupSpec``). A model with one
group (the default) has every cache kind behind one id. DeepSeek-V4 has two (``models/deepseek_v4/cache.py``):
``"full"`` (compressed entries, indexer keys: kept for the sequence's life) and ``"window"`` (raw sliding-window KV
and the compressor state: only the last ``lookback`` positions are read, so older blocks go back to the pool).
Block ``j`` of every table covers positions ``[j * block_size, (j + 1) * block_size)``; a released block reads
``-1``. The block manager only hands out ids; the model decides what a block stores.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

from deepinfer.sequence import Sequence

FULL_GROUP = "full"
WINDOW_GROUP = "window"


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` context positions: ``ceil(num_tokens / block_size)``."""
    return -(-num_tokens // block_size)


@dataclass(frozen=True)
class CacheGroup:
    """One cache group.

    Attributes:
        name: the key of the sequence's table (``Sequence.block_tables[name]``).
        num_blocks: pool capacity in blocks.
        lookback: ``None``: a sequence keeps every block until it ends. An int ``>= 1``: a step whose first token
            is at position ``c`` reads this group only from position ``c - lookback`` on, so blocks that end at or
            before that position are released when the sequence's next step is allocated.
    """

    name: str
    num_blocks: int
    lookback: int | None = None


class BlockChanges(NamedTuple):
    """What :meth:`BlockManager.allocate_step` did to one sequence's tables, per group: ``new`` block ids (appended,
    in table order) and ``released`` ones (their entries became ``-1``; they went back to the pool first, so a block
    may be in both lists of a group)."""

    new: dict[str, list[int]]
    released: dict[str, list[int]]


class _Pool:
    """Free list and owners of one group."""

    def __init__(self, group: CacheGroup) -> None:
        self.group = group
        self.free: deque[int] = deque(range(group.num_blocks))
        self.owner: dict[int, int] = {}  # block id -> seq_id (for checks)


def window_blocks_needed(lookback: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Blocks a sliding-window group needs so that it never runs out before the kept group does: each running
    sequence holds the blocks of ``[start - lookback, end)`` of its last step, at most ``blocks_for(lookback) + 2``
    plus one per ``block_size`` tokens of its chunk, and the chunks of one step sum to at most
    ``max_num_batched_tokens``."""
    return max_num_seqs * (blocks_for(lookback, block_size) + 2) + blocks_for(max_num_batched_tokens, block_size)


class BlockManager:
    """Allocator of cache blocks of ``block_size`` tokens, one pool per :class:`CacheGroup`.

    Args:
        num_blocks: blocks of the default single group ``"full"`` (used when ``groups`` is None).
        block_size: tokens per block (every group).
        groups: the model's cache groups; the first one must keep its blocks (``lookback`` None): ``num_blocks``,
            ``num_free_blocks`` and ``Sequence.block_table`` refer to it.
    Raises:
        ValueError naming the field for non-positive sizes, a duplicate group name or a first group that releases
        blocks.

    Blocks are handed out from a FIFO free list per group (lowest ids first at start). A sequence's tables grow as
    its context grows (:meth:`allocate`), the sliding-window ones also release their old blocks there, and all are
    returned by :meth:`free` (on finish, abort or preemption).
    """

    def __init__(self, num_blocks: int, block_size: int, groups: list[CacheGroup] | None = None) -> None:
        if block_size <= 0:
            raise ValueError(f"BlockManager: block_size must be positive, got {block_size}")
        groups = list(groups) if groups is not None else [CacheGroup(FULL_GROUP, num_blocks)]
        if not groups or groups[0].lookback is not None:
            raise ValueError("BlockManager: groups[0] must be a group that keeps its blocks (lookback None)")
        for g in groups:
            if isinstance(g.num_blocks, bool) or not isinstance(g.num_blocks, int) or g.num_blocks <= 0:
                raise ValueError(f"BlockManager: num_blocks of group {g.name!r} must be positive, got {g.num_blocks}")
            if g.lookback is not None and (isinstance(g.lookback, bool) or not isinstance(g.lookback, int)
                                           or g.lookback < 1):
                raise ValueError(f"BlockManager: lookback of group {g.name!r} must be an integer >= 1 or None, "
                                 f"got {g.lookback!r}")
        if len({g.name for g in groups}) != len(groups):
            raise ValueError(f"BlockManager: group names must differ, got {[g.name for g in groups]}")
        self.block_size = block_size
        self.groups = groups
        self._pools = {g.name: _Pool(g) for g in groups}
        self.main = groups[0].name

    # ------------------------------------------------------------------ sizes
    @property
    def num_blocks(self) -> int:
        """Capacity of the first (kept) group."""
        return self.groups[0].num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Free blocks of the first (kept) group."""
        return len(self._pools[self.main].free)

    @property
    def free_blocks(self) -> deque[int]:
        return self._pools[self.main].free

    def num_free(self, group: str) -> int:
        """Free blocks of ``group`` (KeyError for an unknown name)."""
        return len(self._pools[group].free)

    def first_needed_block(self, group: CacheGroup, start: int) -> int:
        """Index of the first block of ``group`` a step starting at position ``start`` reads."""
        return 0 if group.lookback is None else max(0, start - group.lookback) // self.block_size

    def peak_blocks(self, num_tokens: int, max_step_tokens: int) -> dict[str, int]:
        """Most blocks of each group a request of ``num_tokens`` positions holds when it runs alone with steps of at
        most ``max_step_tokens`` tokens (admission: a request whose peak exceeds a group's capacity never runs)."""
        out = {}
        for g in self.groups:
            n = blocks_for(num_tokens, self.block_size)
            if g.lookback is not None:
                n = min(n, blocks_for(g.lookback + max_step_tokens, self.block_size) + 1)
            out[g.name] = n
        return out

    # ------------------------------------------------------------------ per group
    def _releasable(self, seq: Sequence, g: CacheGroup) -> list[int]:
        """Table indices of ``seq``'s held blocks of ``g`` that its next step (from ``num_computed_tokens``) no
        longer reads."""
        table = seq.block_tables.get(g.name, [])
        first = self.first_needed_block(g, seq.num_computed_tokens)
        return [j for j in range(min(first, len(table))) if table[j] >= 0]

    def blocks_needed(self, seq: Sequence, num_context_tokens: int, group: str | None = None) -> int:
        """Extra blocks of ``group`` (default: the first) ``seq`` needs so that its table covers
        ``num_context_tokens`` positions (its step starts at ``seq.num_computed_tokens``)."""
        g = self._pools[group or self.main].group
        table = seq.block_tables.get(g.name, [])
        first = self.first_needed_block(g, seq.num_computed_tokens)
        end = blocks_for(num_context_tokens, self.block_size)
        return sum(1 for j in range(first, end) if j >= len(table) or table[j] < 0)

    def can_allocate(self, seq: Sequence, num_context_tokens: int, group: str | None = None) -> bool:
        """Whether :meth:`allocate` would succeed for ``group`` (None: every group), counting the blocks it
        releases first."""
        names = [group] if group is not None else [g.name for g in self.groups]
        for name in names:
            pool = self._pools[name]
            free = len(pool.free) + len(self._releasable(seq, pool.group))
            if self.blocks_needed(seq, num_context_tokens, name) > free:
                return False
        return True

    def fits_held(self, seq: Sequence, num_context_tokens: int) -> bool:
        """Whether ``seq``'s step (from ``seq.num_computed_tokens`` to ``num_context_tokens``) needs no allocation:
        every table already covers the step and no sliding-window group has a block to release. O(1) per group (a
        window group's held blocks are one run at the end of its table: blocks are released oldest first)."""
        if not seq.block_tables:
            return False
        end = blocks_for(num_context_tokens, self.block_size)
        for g in self.groups:
            table = seq.block_tables.get(g.name)
            if table is None or len(table) < end:
                return False
            if g.lookback is not None:
                first = self.first_needed_block(g, seq.num_computed_tokens)
                if first > 0 and table[min(first, len(table)) - 1] >= 0:
                    return False
        return True

    def allocate(self, seq: Sequence, num_context_tokens: int, group: str | None = None) -> dict[str, list[int]]:
        """Release the blocks ``seq``'s step (from ``seq.num_computed_tokens``) no longer reads, then grow its tables
        to cover ``num_context_tokens`` positions, for ``group`` (None: every group).

        Returns:
            ``{group: new block ids}`` in table order (they extend the table: a table has no gap before its end).
        Raises:
            RuntimeError: not enough free blocks in a group (callers check :meth:`can_allocate` first); nothing
            changes then.
        """
        return self.allocate_step(seq, num_context_tokens, group).new

    def allocate_step(self, seq: Sequence, num_context_tokens: int, group: str | None = None) -> BlockChanges:
        """:meth:`allocate`, also returning the block ids it released (``BlockChanges.released``: ``{group: ids}``
        whose table entries became ``-1``; empty lists for groups that keep their blocks). The scheduler hands both
        to the model runner, which keeps its own copy of the tables.

        Raises:
            RuntimeError: as :meth:`allocate`.
        """
        names = [group] if group is not None else [g.name for g in self.groups]
        for name in names:
            if not self.can_allocate(seq, num_context_tokens, name):
                need = self.blocks_needed(seq, num_context_tokens, name)
                free = len(self._pools[name].free) + len(self._releasable(seq, self._pools[name].group))
                raise RuntimeError(f"BlockManager.allocate: sequence {seq.seq_id} needs {need} blocks, {free} free"
                                   + ("" if name == self.main else f" in cache group {name!r}"))
        for g in self.groups:  # every table exists, in group order (``Sequence.block_table`` is the first)
            seq.block_tables.setdefault(g.name, [])
        new: dict[str, list[int]] = {}
        released: dict[str, list[int]] = {}
        for name in names:
            pool = self._pools[name]
            table = seq.block_tables[name]
            gone = []
            for j in self._releasable(seq, pool.group):
                self._give_back(pool, table[j], seq)
                gone.append(table[j])
                table[j] = -1
            first = self.first_needed_block(pool.group, seq.num_computed_tokens)
            end = blocks_for(num_context_tokens, self.block_size)
            got = []
            for j in range(first, end):
                if j < len(table) and table[j] >= 0:
                    continue
                block = pool.free.popleft()
                pool.owner[block] = seq.seq_id
                if j >= len(table):
                    table.extend([-1] * (j + 1 - len(table)))
                table[j] = block
                got.append(block)
            new[name] = got
            released[name] = gone
        return BlockChanges(new, released)

    def free(self, seq: Sequence) -> None:
        """Return all of ``seq``'s blocks of every group to their free lists and empty its tables.

        Raises:
            RuntimeError: a table lists a block another sequence owns (a corrupted table).
        """
        for name, table in seq.block_tables.items():
            pool = self._pools[name]
            for block in table:
                if block >= 0:
                    self._give_back(pool, block, seq)
        seq.block_tables = {}

    @staticmethod
    def _give_back(pool: _Pool, block: int, seq: Sequence) -> None:
        owner = pool.owner.pop(block, None)
        if owner != seq.seq_id:
            if owner is not None:
                pool.owner[block] = owner
            raise RuntimeError(f"BlockManager.free: block {block} is owned by {owner}, not sequence {seq.seq_id}")
        pool.free.append(block)
