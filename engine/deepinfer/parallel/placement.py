"""Where the routed experts of one MoE layer live under expert parallelism (EP).

A layer has ``num_experts`` *logical* experts (the router's ids) and ``P = num_experts + num_redundant`` *physical*
slots spread evenly over ``num_ranks`` ranks: slot ``p`` lives on rank ``p // slots_per_rank`` at local index
``p % slots_per_rank``. ``phys_to_logical[p]`` is the logical expert slot ``p`` holds. Every logical expert has at
least one slot; a hot expert may have several (replicas, identical weights), never two on one rank (a second copy
on the same rank would take none of its load).

Replica routing (:meth:`ExpertPlacement.route`): token ``t`` of source rank ``s`` sends its slot for expert ``e``
to replica ``(t + s) % num_replicas[e]`` (replicas ordered by physical slot). The rule is deterministic and depends
only on the token's index, not on the other tokens' experts; since replicas hold the same weights and every expert
GEMM computes a row on its own (batch-invariant kernels), which replica serves a token never changes its bits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


def _int(name: str, v, minimum: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{name} must be an integer, got {v!r}")
    if v < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {v}")
    return v


@dataclass(frozen=True)
class ExpertPlacement:
    """The physical slots of one MoE layer (see the module docstring).

    Attributes:
        num_experts: logical experts ``E`` (>= 1).
        num_ranks: EP ranks ``R`` (>= 1).
        phys_to_logical: ``P`` logical ids, ``P % R == 0``; slot ``p`` on rank ``p // (P // R)``.
    Raises (on construction): TypeError / ValueError naming the field: a non-integer, ``P`` not a positive multiple
        of ``num_ranks``, an id outside ``[0, E)``, an expert with no slot, or an expert twice on one rank.
    """

    num_experts: int
    num_ranks: int
    phys_to_logical: tuple[int, ...]

    def __post_init__(self) -> None:
        _int("ExpertPlacement.num_experts", self.num_experts, 1)
        _int("ExpertPlacement.num_ranks", self.num_ranks, 1)
        p2l = tuple(self.phys_to_logical)
        object.__setattr__(self, "phys_to_logical", p2l)
        P, R, E = len(p2l), self.num_ranks, self.num_experts
        if P == 0 or P % R:
            raise ValueError(f"ExpertPlacement.phys_to_logical: {P} slots is not a positive multiple of "
                             f"num_ranks={R}")
        for p, e in enumerate(p2l):
            if isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < E:
                raise ValueError(f"ExpertPlacement.phys_to_logical[{p}] = {e!r} is not an expert id in [0, {E})")
        missing = sorted(set(range(E)) - set(p2l))
        if missing:
            raise ValueError(f"ExpertPlacement.phys_to_logical: experts {missing[:8]} have no slot (every expert "
                             f"must be placed at least once)")
        S = P // R
        for r in range(R):
            local = p2l[r * S:(r + 1) * S]
            if len(set(local)) != S:
                dup = next(e for e in local if local.count(e) > 1)
                raise ValueError(f"ExpertPlacement.phys_to_logical: expert {dup} has two slots on rank {r} "
                                 f"(replicas must be on distinct ranks)")
        object.__setattr__(self, "_tables", {})  # replica tables per device (not a field: equality ignores it)

    # ---- constructors ---------------------------------------------------------------------------------------
    @classmethod
    def contiguous(cls, num_experts: int, num_ranks: int) -> "ExpertPlacement":
        """No redundancy: rank ``r`` holds experts ``[r E / R, (r + 1) E / R)``. Raises ValueError naming
        ``num_experts`` when it is not a multiple of ``num_ranks`` (use :func:`deepinfer.parallel.eplb.rebalance`
        with redundant slots instead)."""
        _int("num_experts", num_experts, 1)
        _int("num_ranks", num_ranks, 1)
        if num_experts % num_ranks:
            raise ValueError(f"num_experts={num_experts} is not a multiple of num_ranks={num_ranks}; give redundant "
                             f"slots to eplb.rebalance instead")
        return cls(num_experts, num_ranks, tuple(range(num_experts)))

    # ---- queries --------------------------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return len(self.phys_to_logical)

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.num_ranks

    @property
    def num_redundant(self) -> int:
        return self.num_slots - self.num_experts

    def local_experts(self, rank: int) -> tuple[int, ...]:
        """Logical ids of ``rank``'s slots, in local slot order (the order of its stacked expert weights)."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.num_ranks:
            raise ValueError(f"rank must be in [0, {self.num_ranks}), got {rank!r}")
        S = self.slots_per_rank
        return self.phys_to_logical[rank * S:(rank + 1) * S]

    def replicas(self, expert: int) -> tuple[int, ...]:
        """Physical slots of logical ``expert``, ascending."""
        return tuple(p for p, e in enumerate(self.phys_to_logical) if e == expert)

    def num_replicas(self) -> list[int]:
        counts = [0] * self.num_experts
        for e in self.phys_to_logical:
            counts[e] += 1
        return counts

    def replica_table(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """``(table [E, max_replicas] int64, counts [E] int64)``: ``table[e, i]`` the i-th slot of expert ``e``
        (ascending), -1 past ``counts[e]``. Built once per device and cached (read-only: do not mutate)."""
        key = str(torch.device(device))
        if key in self._tables:
            return self._tables[key]
        counts = self.num_replicas()
        table = torch.full((self.num_experts, max(counts)), -1, dtype=torch.int64)
        fill = [0] * self.num_experts
        for p, e in enumerate(self.phys_to_logical):
            table[e, fill[e]] = p
            fill[e] += 1
        self._tables[key] = (table.to(device), torch.tensor(counts, dtype=torch.int64, device=device))
        return self._tables[key]

    def route(self, topk_idx: torch.Tensor, src_rank: int) -> torch.Tensor:
        """Physical slot of every (token, slot) pair of ``topk_idx [T, k]`` (logical ids; ids outside ``[0, E)``,
        e.g. -1, are padding and give -1) on source rank ``src_rank``: replica ``(t + src_rank) % num_replicas[e]``.
        Device work only (no host synchronisation)."""
        table, counts = self.replica_table(topk_idx.device)
        idx = topk_idx.long()
        valid = (idx >= 0) & (idx < self.num_experts)
        e = torch.where(valid, idx, 0)
        tok = torch.arange(idx.shape[0], device=idx.device).view(-1, 1) + int(src_rank)
        choice = torch.remainder(tok, counts[e])
        return torch.where(valid, table[e, choice], -1)

    def to_dict(self) -> dict:
        return {"num_experts": self.num_experts, "num_ranks": self.num_ranks,
                "phys_to_logical": list(self.phys_to_logical)}

    @classmethod
    def from_dict(cls, d: dict) -> "ExpertPlacement":
        for key in ("num_experts", "num_ranks", "phys_to_logical"):
            if key not in d:
                raise ValueError(f"ExpertPlacement: missing field {key!r}")
        p2l = d["phys_to_logical"]
        if not isinstance(p2l, Sequence) or isinstance(p2l, str):
            raise TypeError(f"ExpertPlacement.phys_to_logical must be a list of ints, got {p2l!r}")
        return cls(d["num_experts"], d["num_ranks"], tuple(p2l))
