"""The host-memory tier of the prefix cache: evicted blocks copied to (pinned) host memory, restored on a hit.

The block manager decides (``HostIndex`` per cache group: which chain hash sits in which host slot, an LRU); the
scheduler hands the step's copies to the runner as ``SchedulerOutput.cache_swaps``; the runner's
:class:`HostCacheTier` runs them, in order, before the step's forward. Design: ``docs/prefix-cache.md``.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import torch


class SwapOp(NamedTuple):
    """One block copy between a device pool and the host tier.

    Attributes:
        kind: ``"out"`` (device block -> host slot: the block was evicted) or ``"in"`` (host slot -> device block:
            a prefix hit restores it).
        group: the cache group.
        block: the device block id.
        slot: the host slot.
    """

    kind: str
    group: str
    block: int
    slot: int


class HostIndex:
    """Host slots of one cache group: ``chain hash -> slot``, least recently stored first.

    Args:
        num_slots: capacity (>= 1).
    """

    def __init__(self, num_slots: int) -> None:
        if isinstance(num_slots, bool) or not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"HostIndex: num_slots must be an integer >= 1, got {num_slots!r}")
        self.num_slots = num_slots
        self.by_key: OrderedDict[bytes, int] = OrderedDict()
        self.free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self.stores = 0
        self.loads = 0
        self.evictions = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self.by_key

    def __len__(self) -> int:
        return len(self.by_key)

    def put(self, key: bytes) -> int:
        """A slot for ``key`` (already stored: its slot, refreshed). A full index drops its oldest entry."""
        if key in self.by_key:
            self.by_key.move_to_end(key)
            return self.by_key[key]
        if self.free:
            slot = self.free.pop()
        else:
            _, slot = self.by_key.popitem(last=False)
            self.evictions += 1
        self.by_key[key] = slot
        self.stores += 1
        return slot

    def take(self, key: bytes) -> int:
        """Remove ``key`` (its copy goes back to the device) and return its slot. The slot stays in use until
        :meth:`release`: the copy-in must be queued before another copy-out may reuse it. Raises KeyError when
        ``key`` is not stored."""
        slot = self.by_key.pop(key)
        self.loads += 1
        return slot

    def release(self, slot: int) -> None:
        """A slot :meth:`take` returned becomes free."""
        self.free.append(slot)

    def discard(self, key: bytes) -> None:
        """Forget ``key`` if stored (the device holds that content again)."""
        slot = self.by_key.pop(key, None)
        if slot is not None:
            self.free.append(slot)


def host_slots(host_bytes: int, group_bytes_per_block: dict[str, int], num_blocks: dict[str, int]) -> dict[str, int]:
    """Host slots per cache group for ``host_bytes`` of host memory: every group gets the same fraction of its
    device capacity (``floor(host_bytes * num_blocks[g] / device bytes)``), so the tier mirrors the device cache's
    mix. Groups that would get no slot are left out."""
    device = sum(group_bytes_per_block[g] * n for g, n in num_blocks.items())
    out = {}
    for g, n in num_blocks.items():
        k = int(host_bytes * n // device) if device else 0
        if k > 0 and group_bytes_per_block[g] > 0:
            out[g] = k
    return out


class HostCacheTier:
    """Host copies of cache blocks, one host tensor per device pool tensor: ``[slots, *per-block shape]``, pinned
    when the pools are on CUDA.

    Args:
        pools: ``{group: [device pool tensors, first dim = block id]}`` (the model cache's ``group_tensors``).
        slots: ``{group: host slots}`` (:func:`host_slots`); groups without slots cannot swap.
    Raises:
        ValueError: a group in ``slots`` without pools.

    :meth:`apply` runs a step's copies in list order (a slot or block reused within one step is read before it is
    written again). On CUDA they run on a side stream that starts after the work already queued on the current
    stream, and the current stream waits for them: the host thread never blocks, and the step's forward sees the
    restored blocks.
    """

    def __init__(self, pools: dict[str, list[torch.Tensor]], slots: dict[str, int]) -> None:
        for g in slots:
            if not pools.get(g):
                raise ValueError(f"HostCacheTier: cache group {g!r} has no pools")
        self.slots = dict(slots)
        self.pools = {g: list(pools[g]) for g in slots}
        first = next((ts[0] for ts in self.pools.values()), None)
        self.cuda = first is not None and first.is_cuda
        self.host = {g: [torch.empty((slots[g], *t.shape[1:]), dtype=t.dtype, pin_memory=self.cuda)
                         for t in self.pools[g]] for g in slots}
        self.stream = torch.cuda.Stream(first.device) if self.cuda else None
        self.bytes_copied = 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self.host.values() for t in ts)

    def block_bytes(self, group: str) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.host[group])

    def apply(self, ops) -> None:
        """Run ``ops`` (:class:`SwapOp`, in order). Raises KeyError for a group without host slots and IndexError
        for a block or slot out of range."""
        if not ops:
            return
        for op in ops:
            if op.kind not in ("out", "in"):
                raise ValueError(f"HostCacheTier: unknown SwapOp kind {op.kind!r}")
            if op.group not in self.host:
                raise KeyError(f"HostCacheTier: cache group {op.group!r} has no host slots")
            if not (0 <= op.slot < self.slots[op.group]) or not (0 <= op.block < self.pools[op.group][0].shape[0]):
                raise IndexError(f"HostCacheTier: {op} is out of range")
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
            with torch.cuda.stream(self.stream):
                self._copy(ops, non_blocking=True)
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
        else:
            self._copy(ops, non_blocking=False)

    def _copy(self, ops, non_blocking: bool) -> None:
        for kind, group, blocks, slots in _runs(ops):
            # one gather (or scatter) per pool tensor on the device and one host copy per run of consecutive slots,
            # not one copy per tensor per block (62 tensors per block at V4-Flash's depth)
            order = sorted(range(len(slots)), key=slots.__getitem__)
            blocks = [blocks[i] for i in order]
            slots = [slots[i] for i in order]
            idx = torch.tensor(blocks, dtype=torch.long).to(self.pools[group][0].device, non_blocking=non_blocking)
            spans = _spans(slots)
            for dev, host in zip(self.pools[group], self.host[group]):
                if kind == "out":
                    staged = dev.index_select(0, idx)
                    for j, s0, n in spans:
                        host[s0:s0 + n].copy_(staged[j:j + n], non_blocking=non_blocking)
                else:
                    staged = torch.empty((len(blocks), *dev.shape[1:]), dtype=dev.dtype, device=dev.device)
                    for j, s0, n in spans:
                        staged[j:j + n].copy_(host[s0:s0 + n], non_blocking=non_blocking)
                    dev.index_copy_(0, idx, staged)
            self.bytes_copied += self.block_bytes(group) * len(blocks)


def _runs(ops):
    """``ops`` as maximal runs ``(kind, group, blocks, slots)`` of one kind and group in which no destination (a
    slot for ``out``, a block for ``in``) repeats: a run's copies commute (sources and destinations sit in different
    memories), so each run is copied at once and the runs, in order, give the ops' in-order result."""
    runs, key, dests = [], None, set()
    for op in ops:
        dest = op.slot if op.kind == "out" else op.block
        if (op.kind, op.group) != key or dest in dests:
            runs.append((op.kind, op.group, [], []))
            key, dests = (op.kind, op.group), set()
        runs[-1][2].append(op.block)
        runs[-1][3].append(op.slot)
        dests.add(dest)
    return runs


def _spans(slots: list[int]) -> list[tuple[int, int, int]]:
    """Sorted ``slots`` as runs of consecutive ids: ``[(index of the first, first slot, length)]``."""
    spans, j = [], 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[i - 1] + 1:
            spans.append((j, slots[j], i - j))
            j = i
    return spans
