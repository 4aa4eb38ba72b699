"""Paged cache blocks: a free list and one block table per sequence.

One block id addresses every cache kind of every layer of the model (window KV, compressed entries, indexer keys,
compressor state; see ``deepinfer.forward_batch``): the block manager only hands out ids.
"""

from __future__ import annotations

from collections import deque

from deepinfer.sequence import Sequence

KV_GROUP = "kv"  # the one cache group of today: every cache kind behind one block id


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` context positions: ``ceil(num_tokens / block_size)``."""
    return -(-num_tokens // block_size)


class BlockManager:
    """Allocator of ``num_blocks`` cache blocks of ``block_size`` tokens.

    Blocks are handed out from a FIFO free list (lowest ids first at start). A sequence's ``block_table`` grows as
    its context grows and is returned whole by ``free`` (on finish or preemption).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"BlockManager: num_blocks must be positive, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"BlockManager: block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self._owner: dict[int, int] = {}  # block id -> seq_id (for checks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    def blocks_needed(self, seq: Sequence, num_context_tokens: int) -> int:
        """Extra blocks ``seq`` needs so that its table covers ``num_context_tokens`` positions."""
        return max(0, blocks_for(num_context_tokens, self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_context_tokens: int) -> bool:
        return self.blocks_needed(seq, num_context_tokens) <= len(self.free_blocks)

    def allocate(self, seq: Sequence, num_context_tokens: int) -> list[int]:
        """Grow ``seq.block_table`` to cover ``num_context_tokens`` positions; returns the new block ids (in table
        order, possibly none).

        Raises:
            RuntimeError: not enough free blocks (callers check ``can_allocate`` first).
        """
        need = self.blocks_needed(seq, num_context_tokens)
        if need > len(self.free_blocks):
            raise RuntimeError(
                f"BlockManager.allocate: sequence {seq.seq_id} needs {need} blocks, {len(self.free_blocks)} free"
            )
        new = [self.free_blocks.popleft() for _ in range(need)]
        for block in new:
            self._owner[block] = seq.seq_id
        seq.block_table.extend(new)
        return new

    def free(self, seq: Sequence) -> None:
        """Return all of ``seq``'s blocks to the free list and empty its table."""
        for block in seq.block_table:
            owner = self._owner.pop(block, None)
            if owner != seq.seq_id:
                raise RuntimeError(f"BlockManager.free: block {block} is owned by {owner}, not sequence {seq.seq_id}")
            self.free_blocks.append(block)
        seq.block_table = []
