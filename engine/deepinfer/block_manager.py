"""Paged cache blocks: one free list and one block table per sequence for each cache group.

A cache group is a set of pools addressed by the same block ids (vLLM's ``KVCacheGroupSpec``). A model with one
group (the default) has every cache kind behind one id. DeepSeek-V4 has two (``models/deepseek_v4/cache.py``):
``"full"`` (compressed entries, indexer keys: kept for the sequence's life) and ``"window"`` (raw sliding-window KV
and the compressor state: only the last ``lookback`` positions are read, so older blocks go back to the pool).
Block ``j`` of every table covers positions ``[j * block_size, (j + 1) * block_size)``; a released block reads
``-1``. The block manager only hands out ids; the model decides what a block stores.

With prefix caching (``PrefixCaching``), blocks are reference-counted and shared by chain hash, unreferenced ones
keep their content in an LRU, and a lookup tells a new request where it may start (``docs/prefix-cache.md``).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import NamedTuple

from deepinfer.host_cache import HostIndex, SwapOp
from deepinfer.prefix_cache import PrefixCaching, PrefixCacheStats, PrefixHit, block_hash
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
    """Blocks of one group: the uncached free list, the LRU of unreferenced blocks that keep cached content, the
    holders of every referenced block and the content keys (chain hashes) of cached blocks."""

    def __init__(self, group: CacheGroup, host: HostIndex | None = None, swaps: list[SwapOp] | None = None) -> None:
        self.group = group
        self.host = host  # the host tier's slots of this group (None: evicted content is lost)
        self.swaps = swaps  # the block manager's pending copies (shared by its pools, in order)
        self.free: deque[int] = deque(range(group.num_blocks))  # no content worth keeping: handed out first
        self.cached: OrderedDict[int, bytes] = OrderedDict()  # unreferenced, content kept; least recently used first
        self.holders: dict[int, set[int]] = {}  # referenced block -> the sequences holding it
        self.key_of: dict[int, bytes] = {}
        self.by_key: dict[bytes, int] = {}
        self.evictions = 0

    @property
    def num_free(self) -> int:
        return len(self.free) + len(self.cached)

    def take(self, seq_id: int) -> int:
        """A block for ``seq_id`` to write: an uncached one, else the least recently used cached one (evicted)."""
        if self.free:
            block = self.free.popleft()
        else:
            block, key = self.cached.popitem(last=False)
            del self.key_of[block], self.by_key[key]
            self.evictions += 1
            if self.host is not None:  # keep the content in host memory before the block is written again
                self.swaps.append(SwapOp("out", self.group.name, block, self.host.put(key)))
        self.holders[block] = {seq_id}
        return block

    def hold(self, block: int, seq_id: int) -> None:
        """One more reference to a cached block (a prefix-cache hit)."""
        self.cached.pop(block, None)
        self.holders.setdefault(block, set()).add(seq_id)

    def release(self, block: int, seq_id: int) -> None:
        """Drop ``seq_id``'s reference; an unreferenced block goes to the LRU when it has a key, else to the free
        list. Raises RuntimeError when ``seq_id`` does not hold it."""
        holders = self.holders.get(block)
        if not holders or seq_id not in holders:
            owner = None if not holders else (next(iter(holders)) if len(holders) == 1 else sorted(holders))
            raise RuntimeError(f"BlockManager.free: block {block} is owned by {owner}, not sequence {seq_id}")
        holders.discard(seq_id)
        if not holders:
            del self.holders[block]
            key = self.key_of.get(block)
            if key is None:
                self.free.append(block)
            else:
                self.cached[block] = key

    def register(self, block: int, key: bytes) -> None:
        """Give ``block`` the content key ``key`` (kept when another block already has it)."""
        if block not in self.key_of and key not in self.by_key:
            self.key_of[block] = key
            self.by_key[key] = block
            if self.host is not None:
                self.host.discard(key)  # the device holds it again

    def has(self, key: bytes) -> bool:
        """Whether ``key``'s content is cached on the device or in the host tier."""
        return key in self.by_key or (self.host is not None and key in self.host)

    def restore(self, key: bytes, seq_id: int) -> int:
        """A device block for ``seq_id`` holding the host tier's copy of ``key`` (a copy-in is queued)."""
        slot = self.host.take(key)  # first: the eviction that frees a device block may store into the host tier
        block = self.take(seq_id)
        self.swaps.append(SwapOp("in", self.group.name, block, slot))
        self.host.release(slot)
        self.register(block, key)
        return block


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
        prefix_caching: None (off), or the salt and replay length of prefix caching (``docs/prefix-cache.md``):
            full blocks get chain hashes, blocks are reference-counted and shared, and unreferenced blocks that keep
            cached content wait in an LRU (counted as free) until a block is needed.
    Raises:
        ValueError naming the field for non-positive sizes, a duplicate group name or a first group that releases
        blocks.

    Blocks are handed out from a FIFO free list per group (lowest ids first at start), then from the LRU of cached
    blocks. A sequence's tables grow as its context grows (:meth:`allocate`), the sliding-window ones also release
    their old blocks there, and all are returned by :meth:`free` (on finish, abort or preemption).
    """

    def __init__(self, num_blocks: int, block_size: int, groups: list[CacheGroup] | None = None,
                 prefix_caching: PrefixCaching | None = None, host_slots: dict[str, int] | None = None) -> None:
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
        if prefix_caching is not None and not isinstance(prefix_caching, PrefixCaching):
            raise ValueError(f"BlockManager: prefix_caching must be a PrefixCaching or None, got "
                             f"{type(prefix_caching).__name__}")
        host_slots = dict(host_slots or {})
        if host_slots and prefix_caching is None:
            raise ValueError("BlockManager: host_slots (the host-memory tier) needs prefix_caching")
        unknown = set(host_slots) - {g.name for g in groups}
        if unknown:
            raise ValueError(f"BlockManager: host_slots names unknown cache groups {sorted(unknown)}")
        self.block_size = block_size
        self.groups = groups
        self._swaps: list[SwapOp] = []
        self._pools = {g.name: _Pool(g, HostIndex(host_slots[g.name]) if g.name in host_slots else None, self._swaps)
                       for g in groups}
        self.main = groups[0].name
        self.prefix_caching = prefix_caching
        self._prefix_stats = PrefixCacheStats()

    # ------------------------------------------------------------------ sizes
    @property
    def num_blocks(self) -> int:
        """Capacity of the first (kept) group."""
        return self.groups[0].num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Free blocks of the first (kept) group (cached unreferenced blocks included)."""
        return self._pools[self.main].num_free

    @property
    def free_blocks(self) -> list[int]:
        """Free block ids of the first group: the uncached ones in hand-out order, then the cached ones (LRU)."""
        pool = self._pools[self.main]
        return list(pool.free) + list(pool.cached)

    def num_free(self, group: str) -> int:
        """Free blocks of ``group`` (cached unreferenced blocks included; KeyError for an unknown name)."""
        return self._pools[group].num_free

    def num_referenced(self, group: str | None = None) -> int:
        """Blocks of ``group`` (default: the first) some sequence holds (0 once every request has ended)."""
        return len(self._pools[group or self.main].holders)

    def num_cached(self, group: str | None = None) -> int:
        """Unreferenced blocks of ``group`` (default: the first) that keep cached content."""
        return len(self._pools[group or self.main].cached)

    @property
    def caching(self) -> bool:
        return self.prefix_caching is not None

    @property
    def prefix_stats(self) -> PrefixCacheStats:
        """Hit counters (tokens), evictions and host-tier copies (:class:`~deepinfer.prefix_cache.PrefixCacheStats`)."""
        st = self._prefix_stats
        st.evictions = sum(p.evictions for p in self._pools.values())
        hosts = [p.host for p in self._pools.values() if p.host is not None]
        st.host_stores = sum(h.stores for h in hosts)
        st.host_loads = sum(h.loads for h in hosts)
        st.host_evictions = sum(h.evictions for h in hosts)
        return st

    def num_host_cached(self, group: str | None = None) -> int:
        """Blocks of ``group`` (default: the first) whose content the host tier holds."""
        host = self._pools[group or self.main].host
        return 0 if host is None else len(host)

    def take_swaps(self) -> tuple[SwapOp, ...]:
        """The block copies queued since the last call (evictions to the host tier, restores from it), in the order
        they must run, before any later step's forward; the list empties."""
        out = tuple(self._swaps)
        self._swaps.clear()
        return out

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

    def _first_held(self, g: CacheGroup, seq: Sequence) -> int:
        """Index of the first block of ``g`` that ``seq``'s next step must hold: :meth:`first_needed_block`, and for
        a sliding-window group not before ``seq.window_floor`` (a prefix hit replayed without the window before
        it)."""
        first = self.first_needed_block(g, seq.num_computed_tokens)
        return first if g.lookback is None else max(first, seq.window_floor // self.block_size)

    def blocks_needed(self, seq: Sequence, num_context_tokens: int, group: str | None = None) -> int:
        """Extra blocks of ``group`` (default: the first) ``seq`` needs so that its table covers
        ``num_context_tokens`` positions (its step starts at ``seq.num_computed_tokens``)."""
        g = self._pools[group or self.main].group
        table = seq.block_tables.get(g.name, [])
        first = self._first_held(g, seq)
        end = blocks_for(num_context_tokens, self.block_size)
        return sum(1 for j in range(first, end) if j >= len(table) or table[j] < 0)

    def can_allocate(self, seq: Sequence, num_context_tokens: int, group: str | None = None) -> bool:
        """Whether :meth:`allocate` would succeed for ``group`` (None: every group), counting the blocks it
        releases first."""
        names = [group] if group is not None else [g.name for g in self.groups]
        for name in names:
            pool = self._pools[name]
            free = pool.num_free + self._releasable_blocks(seq, pool.group)
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
                free = self._pools[name].num_free + self._releasable_blocks(seq, self._pools[name].group)
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
            releasable = self._releasable(seq, pool.group)
            keys = self._snapshot_keys(seq, pool.group, False) if releasable and self.caching else {}
            for j in releasable:
                if j in keys:  # a window snapshot at a boundary worth keeping (prompt end, branch point)
                    pool.register(table[j], keys[j])
                pool.release(table[j], seq.seq_id)
                gone.append(table[j])
                table[j] = -1
            first = self._first_held(pool.group, seq)
            end = blocks_for(num_context_tokens, self.block_size)
            got = []
            for j in range(first, end):
                if j < len(table) and table[j] >= 0:
                    continue
                block = pool.take(seq.seq_id)
                if j >= len(table):
                    table.extend([-1] * (j + 1 - len(table)))
                table[j] = block
                got.append(block)
            new[name] = got
            released[name] = gone
        return BlockChanges(new, released)

    def free(self, seq: Sequence) -> None:
        """Drop all of ``seq``'s references in every group and empty its tables. With prefix caching, its full
        blocks keep their content (an LRU of free blocks), and so do its window-snapshot blocks
        (:meth:`_snapshot_keys`: a request sharing the prefix resumes there without a replay); blocks no other
        sequence holds go back last-first, so a prefix outlives its tail.

        Raises:
            RuntimeError: a table lists a block ``seq`` does not hold (a corrupted table).
        """
        if self.caching and seq.block_tables:
            self._keep_at_end(seq)
        for name, table in seq.block_tables.items():
            pool = self._pools[name]
            for block in (reversed(table) if self.caching else table):
                if block >= 0:
                    pool.release(block, seq.seq_id)
        seq.block_tables = {}
        seq.prefix_shared_tokens = 0
        seq.prefix_branch = 0
        seq.window_floor = 0
        seq.num_registered_blocks = 0

    # ------------------------------------------------------------------ prefix caching
    def _releasable_blocks(self, seq: Sequence, g: CacheGroup) -> int:
        """Blocks :meth:`allocate` would give back to ``g``'s free count before it allocates: ``seq``'s blocks
        before its step's window that no other sequence holds."""
        pool = self._pools[g.name]
        table = seq.block_tables.get(g.name, [])
        return sum(1 for j in self._releasable(seq, g) if len(pool.holders.get(table[j], ())) == 1)

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """``seq.block_hashes`` extended to its first ``num_blocks`` full blocks (their tokens must be known)."""
        hashes = seq.block_hashes
        B = self.block_size
        for j in range(len(hashes), num_blocks):
            parent = hashes[j - 1] if j else self.prefix_caching.salt
            hashes.append(block_hash(parent, seq.token_at(j * B, (j + 1) * B)))
        return hashes

    def lookup(self, seq: Sequence) -> PrefixHit | None:
        """Where ``seq`` (no blocks held) could start from the prefix cache, without changing anything; None when
        caching is off or nothing is cached for its first block.

        The hit covers the longest run of its full blocks whose chain hashes every kept group has, leaving at least
        one token to compute. A model with sliding-window groups then starts at the latest block boundary whose
        window snapshot is cached (exact, no replay) or ``replay_tokens`` before the end of the shared blocks
        (rounded down to a block), whichever is later; the positions between the start and the end of the shared
        blocks are recomputed without writing the shared blocks."""
        if not self.caching or seq.block_tables:
            return None
        B = self.block_size
        k = (seq.num_tokens - 1) // B
        if k <= 0:
            return None
        hashes = self._hashes(seq, k)
        kept = [g for g in self.groups if g.lookback is None]
        windows = [g for g in self.groups if g.lookback is not None]
        for g in kept:
            k = self._cached_run(self._pools[g.name], hashes[:k])
        if k == 0:
            return None
        shared = k * B
        ids: dict[str, dict[int, int]] = {}
        host: dict[str, dict[int, bytes]] = {}
        for g in kept:
            self._split(self._pools[g.name], hashes, range(k), ids, host)
        if not windows:
            return PrefixHit(shared, shared, 0, ids, host)
        replay_start = max(0, shared - self.prefix_caching.replay_tokens) // B * B
        for e in range(k, replay_start // B, -1):  # the latest boundary with a window snapshot
            snap_ids, snap_host = dict(ids), dict(host)
            for g in windows:
                cols = range(max(0, e * B - g.lookback) // B, e)
                if self._cached_run(self._pools[g.name], [hashes[j] for j in cols]) < len(cols):
                    break
                self._split(self._pools[g.name], hashes, cols, snap_ids, snap_host)
            else:
                return PrefixHit(e * B, shared, 0, snap_ids, snap_host)
        return PrefixHit(replay_start, shared, replay_start, ids, host)

    @staticmethod
    def _cached_run(pool: _Pool, keys: list[bytes]) -> int:
        """How many of ``keys``, from the first, the pool can give a hit: cached on the device, or in the host tier
        while a free block is left to restore each into (the hit's own cached blocks are not free for that)."""
        spare = pool.num_free
        for n, key in enumerate(keys):
            block = pool.by_key.get(key)
            if block is not None:
                spare -= block in pool.cached
            elif pool.host is not None and key in pool.host:
                spare -= 1
            else:
                return n
            if spare < 0:
                return n
        return len(keys)

    @staticmethod
    def _split(pool: _Pool, hashes: list[bytes], cols, ids: dict, host: dict) -> None:
        """File table indices ``cols`` of a hit under ``ids`` (device blocks) or ``host`` (chain hashes)."""
        name = pool.group.name
        for j in cols:
            block = pool.by_key.get(hashes[j])
            if block is not None:
                ids.setdefault(name, {})[j] = block
            else:
                host.setdefault(name, {})[j] = hashes[j]

    def apply_hit(self, seq: Sequence, hit: PrefixHit) -> None:
        """Take ``hit`` (from :meth:`lookup`, for ``seq`` holding no blocks): hold its blocks in ``seq``'s tables
        (``-1`` elsewhere), start ``seq`` at ``hit.start`` (``num_computed_tokens``) and record the shared length and
        window floor on it. :meth:`free` undoes it."""
        for g in self.groups:
            table = seq.block_tables.setdefault(g.name, [])
            pool = self._pools[g.name]
            placed = dict(hit.ids.get(g.name, {}))
            for block in placed.values():  # hold first: a restore below must not evict the hit's own blocks
                pool.hold(block, seq.seq_id)
            for j, key in sorted(hit.host.get(g.name, {}).items()):
                placed[j] = pool.restore(key, seq.seq_id)
            for j, block in sorted(placed.items()):
                if j >= len(table):
                    table.extend([-1] * (j + 1 - len(table)))
                table[j] = block
        seq.num_computed_tokens = hit.start
        seq.prefix_shared_tokens = hit.shared
        # a replay of the exact bound rebuilds the window at the end of the shared blocks: worth a snapshot
        seq.prefix_branch = hit.shared if hit.start < hit.shared and self.prefix_caching.exact_replay else 0
        seq.window_floor = hit.window_floor
        seq.num_registered_blocks = hit.shared // self.block_size

    def cache_blocks(self, seq: Sequence) -> None:
        """Give the kept-group blocks of ``seq`` that became full (computed, with known tokens) their chain hashes,
        so later requests can share them. O(1) when no block became full."""
        if not self.caching:
            return
        B = self.block_size
        n = min(seq.num_computed_tokens, seq.num_tokens) // B
        if n <= seq.num_registered_blocks:
            return
        hashes = self._hashes(seq, n)
        for g in self.groups:
            if g.lookback is None:
                table, pool = seq.block_tables.get(g.name, []), self._pools[g.name]
                for j in range(seq.num_registered_blocks, min(n, len(table))):
                    pool.register(table[j], hashes[j])
        seq.num_registered_blocks = n

    def _snapshot_keys(self, seq: Sequence, g: CacheGroup, at_end: bool) -> dict[int, bytes]:
        """``{table index: chain hash}`` of the blocks of window group ``g`` that make up ``seq``'s window snapshots:
        the window before the last full block boundary of its prompt, of its shared prefix when a hit replayed it
        (``prefix_branch``: where the next request with this prefix diverges too) and, ``at_end``, of its context.
        Only boundaries its computed, known tokens reach."""
        B = self.block_size
        n = min(seq.num_computed_tokens, seq.num_tokens) // B
        ends = {seq.num_prompt_tokens // B, seq.prefix_branch // B} | ({n} if at_end else set())
        ends = {k for k in ends if 0 < k <= n}
        if not ends:
            return {}
        hashes = self._hashes(seq, max(ends))
        return {j: hashes[j] for k in ends for j in range(max(0, k * B - g.lookback) // B, k)}

    def _keep_at_end(self, seq: Sequence) -> None:
        """Before ``seq`` lets go of its blocks: hash its full kept-group blocks, and give its held window-snapshot
        blocks (:meth:`_snapshot_keys`) their keys."""
        self.cache_blocks(seq)
        for g in self.groups:
            if g.lookback is not None:
                table, pool = seq.block_tables.get(g.name, []), self._pools[g.name]
                for j, key in self._snapshot_keys(seq, g, True).items():
                    if j < len(table) and table[j] >= 0:
                        pool.register(table[j], key)
