"""Prefix caching: chain hashes of full blocks, and where a cache hit lets a request start.

The block manager (``deepinfer.block_manager``) keeps the blocks, their reference counts and the LRU of cached free
blocks; this module holds the parts that do not touch the pools. The design: ``docs/prefix-cache.md``.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from dataclasses import asdict, dataclass
from typing import NamedTuple


def cache_salt(**parts) -> bytes:
    """The root of every chain hash: a SHA-256 digest of ``parts`` (model identity, model config, cache dtype,
    GEMM path, batch-invariant mode: anything that changes what a block holds), JSON with sorted keys (values that
    JSON cannot hold are written with ``str``)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).digest()


def block_hash(parent: bytes, tokens) -> bytes:
    """The chain hash of one full block: SHA-256 of the previous block's hash (the salt for block 0) and the
    block's token ids as int64 (a cryptographic hash: a prompt cannot be forged to collide with another's)."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


@dataclass(frozen=True)
class PrefixCaching:
    """Prefix-caching settings of a :class:`~deepinfer.block_manager.BlockManager`.

    Attributes:
        salt: root of the chain hashes (:func:`cache_salt`).
        replay_tokens: a hit without a window snapshot at its end recomputes at least this many positions before
            the end of the shared blocks (the window KV and compressor state of a sliding-window group are rebuilt
            by them); ``>= 1``. The start of the recomputation is rounded down to a block boundary.
        exact_replay: ``replay_tokens`` reaches the model's exact bound, so a replayed window equals the one a
            full computation writes and may be kept as a snapshot.
    """

    salt: bytes
    replay_tokens: int
    exact_replay: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.salt, bytes) or not self.salt:
            raise ValueError("PrefixCaching.salt must be non-empty bytes")
        if isinstance(self.replay_tokens, bool) or not isinstance(self.replay_tokens, int) or self.replay_tokens < 1:
            raise ValueError(f"prefix_replay_tokens must be an integer >= 1, got {self.replay_tokens!r}")


class PrefixHit(NamedTuple):
    """Where a request starts after a prefix-cache lookup (all positions are block boundaries).

    Attributes:
        start: the first position it computes (the tokens before it count as cached).
        shared: positions ``[0, shared)`` of the kept groups come from the cache and are never written by it
            (``shared >= start``; the positions ``[start, shared)`` are replayed).
        window_floor: sliding-window groups hold no block before this position (``start`` when no window snapshot
            ends at ``start``, else 0).
        ids: ``{group: {table index: block id}}`` of the cached device blocks it holds: every kept-group block
            before ``shared``, and the window snapshot blocks before ``start`` when there is one.
        host: ``{group: {table index: chain hash}}`` of the blocks among them that the host tier holds: they get a
            device block and a copy-in when the hit is applied.
    """

    start: int
    shared: int
    window_floor: int
    ids: dict[str, dict[int, int]]
    host: dict[str, dict[int, bytes]] = {}


@dataclass
class PrefixCacheStats:
    """Counters of one block manager (tokens; a request counts at its first admission).

    Attributes:
        queries: prompt tokens of admitted requests.
        hits: of them, tokens served from the cache (not computed).
        replayed: tokens recomputed before the end of a shared prefix (window rebuild).
        evictions: cached blocks handed out again (every group).
        host_stores / host_loads / host_evictions: blocks copied to the host tier, restored from it, and dropped
            from it to make room (every group).
    """

    queries: int = 0
    hits: int = 0
    replayed: int = 0
    evictions: int = 0
    host_stores: int = 0
    host_loads: int = 0
    host_evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "hit_rate": self.hit_rate}
