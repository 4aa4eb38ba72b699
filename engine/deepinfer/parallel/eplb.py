"""Expert-parallel load balancer (EPLB) policy: redundant replicas for hot experts and a placement of the physical
slots over ranks that minimises the per-step peak rank load over a window of recent steps. Pure (numpy, no
distributed state) and deterministic: equal inputs give equal placements on every rank and machine.

Load model. ``counts[t, e]`` tokens chose logical expert ``e`` at step ``t`` (summed over all DP ranks). Replica
routing (:meth:`ExpertPlacement.route`) spreads an expert's tokens evenly over its ``r_e`` replicas, so a replica
carries ``counts[t, e] / r_e`` and a rank the sum over its slots. The objective is the *mean per-step peak*:
``mean_t max_rank load[t, rank]`` -- the steps' critical path, since every rank waits for the slowest at each MoE
layer. A placement balanced on the window's total can still have high per-step peaks when experts are hot at
different steps; summing per-step maxima keeps those apart.

Policy (after DeepSeek's EPLB description; written anew):

1. Replication: start from one replica each and add the ``num_redundant`` replicas one at a time to the expert
   whose extra replica most lowers ``sum_t max_e counts[t, e] / r_e`` (a lower bound of the rank objective), ties to
   the larger per-replica total load, then the lower id; at most ``num_ranks`` replicas per expert.
2. Placement: replicas in decreasing per-replica total load (ties: lower expert id), each to the rank with a free
   slot and no copy of that expert that least raises ``sum_t peak_t`` (ties: lower rank total, then lower rank):
   a longest-processing-time greedy on per-step load vectors. If every free rank already holds the expert, one
   expert of a full rank without it moves to a free rank (always possible, see :func:`_place`).
3. Refinement: best-improvement swaps of two slots on different ranks while they lower the objective (at most
   ``refine_passes`` swaps).
4. Slot order: each rank's experts ascending, so a placement is canonical.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .placement import ExpertPlacement, _int


def _counts_array(counts) -> np.ndarray:
    if isinstance(counts, torch.Tensor):
        counts = counts.detach().cpu().double().numpy()
    try:
        a = np.asarray(counts, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise TypeError(f"counts must be a numeric [num_steps, num_experts] array, got {type(counts).__name__}") from e
    if a.ndim == 1:
        a = a[None, :]
    if a.ndim != 2 or a.shape[1] == 0:
        raise ValueError(f"counts must be [num_steps, num_experts] (or [num_experts]), got shape {list(a.shape)}")
    if a.shape[0] == 0:
        raise ValueError("counts: the window holds no steps (shape [0, num_experts])")
    if not np.isfinite(a).all() or (a < 0).any():
        bad = np.argwhere(~np.isfinite(a) | (a < 0))[0]
        raise ValueError(f"counts[{bad[0]}, {bad[1]}] = {a[tuple(bad)]}: token counts must be finite and >= 0")
    return a


def rank_loads(counts, placement: ExpertPlacement) -> np.ndarray:
    """``[num_steps, num_ranks]`` float64: each rank's expected tokens per step under ``placement`` (the load model
    of the module docstring)."""
    c = _counts_array(counts)
    if c.shape[1] != placement.num_experts:
        raise ValueError(f"counts has {c.shape[1]} experts, placement {placement.num_experts}")
    r = np.asarray(placement.num_replicas(), dtype=np.float64)
    per_slot = (c / r)[:, list(placement.phys_to_logical)]  # [T, P]
    return per_slot.reshape(c.shape[0], placement.num_ranks, placement.slots_per_rank).sum(axis=2)


def mean_peak_load(counts, placement: ExpertPlacement) -> float:
    """``mean_t max_rank load[t, rank]`` (the policy's objective; tokens per step)."""
    return float(rank_loads(counts, placement).max(axis=1).mean())


def balancedness(counts, placement: ExpertPlacement) -> float:
    """``mean_t mean_rank load / mean_t max_rank load`` in (0, 1]: 1 is a perfectly even step; 1 for no load."""
    loads = rank_loads(counts, placement)
    peak = loads.max(axis=1).mean()
    return float(loads.mean(axis=1).mean() / peak) if peak > 0 else 1.0


def _replicate(c: np.ndarray, num_ranks: int, num_redundant: int) -> np.ndarray:
    E = c.shape[1]
    r = np.ones(E, dtype=np.int64)
    total = c.sum(axis=0)
    ids = np.arange(E)
    for _ in range(num_redundant):
        load = c / r  # [T, E] per-replica load
        order = np.argsort(-load, axis=1, kind="stable")
        top1 = np.take_along_axis(load, order[:, :1], axis=1)[:, 0]
        top2 = np.take_along_axis(load, order[:, 1:2], axis=1)[:, 0] if E > 1 else np.zeros_like(top1)
        arg1 = order[:, 0]
        # objective with one more replica of e: per step max(max over others, c[t, e] / (r_e + 1))
        others = np.where(arg1[:, None] == ids[None, :], top2[:, None], top1[:, None])
        new_obj = np.maximum(others, c / (r + 1)).sum(axis=0)
        ok = r < num_ranks
        # lexicographic: lowest objective, then largest per-replica total, then lowest id
        keys = np.lexsort((ids, -(total / r), new_obj))
        e = next(int(k) for k in keys if ok[k])
        r[e] += 1
    return r


def _place(c: np.ndarray, r: np.ndarray, num_ranks: int) -> list[list[int]]:
    """Greedy placement; returns per rank the list of logical experts (unsorted)."""
    T, E = c.shape
    S = int(r.sum()) // num_ranks
    w = c / r  # [T, E] per-replica load vectors
    wt = w.sum(axis=0)
    items = sorted(((e, i) for e in range(E) for i in range(int(r[e]))), key=lambda ei: (-wt[ei[0]], ei[0], ei[1]))
    load = np.zeros((T, num_ranks))
    peak = np.zeros(T)
    ranks: list[list[int]] = [[] for _ in range(num_ranks)]
    for e, _ in items:
        free = [d for d in range(num_ranks) if len(ranks[d]) < S and e not in ranks[d]]
        if not free:
            # Every rank with a free slot (one exists: slots = replicas) holds e. A rank d2 without e exists
            # (r_e <= R and e is not yet fully placed) and is full; it holds S experts, the free rank d fewer than
            # S with e among them, so some x on d2 is not on d: move x to d, then e fits on d2.
            d = next(dd for dd in range(num_ranks) if len(ranks[dd]) < S)
            d2 = next(dd for dd in range(num_ranks) if e not in ranks[dd])
            x = next(xx for xx in sorted(ranks[d2], key=lambda xx: (-wt[xx], xx)) if xx not in ranks[d])
            ranks[d2].remove(x)
            ranks[d].append(x)
            load[:, d2] -= w[:, x]
            load[:, d] += w[:, x]
            peak = load.max(axis=1)
            free = [d2]
        cand = np.asarray(free)
        new = load[:, cand] + w[:, e:e + 1]  # [T, len(free)]
        raise_ = np.maximum(new, peak[:, None]).sum(axis=0) - peak.sum()
        keys = np.lexsort((cand, load[:, cand].sum(axis=0), raise_))
        d = int(cand[keys[0]])
        ranks[d].append(e)
        load[:, d] += w[:, e]
        peak = np.maximum(peak, load[:, d])
    return ranks


def _refine(c: np.ndarray, r: np.ndarray, ranks: list[list[int]], passes: int) -> None:
    """Best-improvement swaps of two slots on different ranks (in place), at most ``passes``, while the objective
    drops by more than a relative 1e-9. Per pass: every rank pair, all its slot pairs at once (numpy)."""
    w = c / r
    R, T = len(ranks), c.shape[0]
    for _ in range(passes):
        load = np.stack([w[:, rk].sum(axis=1) for rk in ranks], axis=1)  # [T, R]
        top = np.argsort(-load, axis=1, kind="stable")[:, :3] if R > 2 else None  # the 3 most loaded per step
        obj = load.max(axis=1).sum()
        best, move = obj * (1 - 1e-9), None
        for a in range(R):
            xa = np.asarray(ranks[a])
            for b in range(a + 1, R):
                xb = np.asarray(ranks[b])
                rest = np.zeros(T)
                if top is not None:  # max over the ranks other than a and b: the first of the top three that is neither
                    pick = np.where((top[:, 0] != a) & (top[:, 0] != b), top[:, 0],
                                    np.where((top[:, 1] != a) & (top[:, 1] != b), top[:, 1], top[:, 2]))
                    rest = load[np.arange(T), pick]
                delta = w[:, xb][:, None, :] - w[:, xa][:, :, None]  # [T, |a|, |b|]: swap x_i (a) with y_j (b)
                o = np.maximum(rest[:, None, None], np.maximum(load[:, a, None, None] + delta,
                                                               load[:, b, None, None] - delta)).sum(axis=0)
                bad = np.isin(xb, xa)[None, :] | np.isin(xa, xb)[:, None]  # a copy would meet its twin
                o = np.where(bad, np.inf, o)
                i, j = np.unravel_index(int(np.argmin(o)), o.shape)
                if o[i, j] < best:
                    best, move = o[i, j], (a, int(i), b, int(j))
        if move is None:
            return
        a, i, b, j = move
        ranks[a][i], ranks[b][j] = ranks[b][j], ranks[a][i]


def rebalance(counts, num_ranks: int, num_redundant: int = 0, refine_passes: int = 16) -> ExpertPlacement:
    """Choose replicas and a placement for one MoE layer from its recent expert loads (the policy of the module
    docstring).

    Args:
        counts: ``[num_steps, num_experts]`` (or ``[num_experts]``: one step) non-negative token counts per step
            and logical expert, summed over DP ranks (numpy, torch or nested lists).
        num_ranks: EP ranks ``R`` (>= 1).
        num_redundant: extra replica slots ``N`` (>= 0); ``num_experts + N`` must be a multiple of ``num_ranks``
            and ``N <= num_experts * (num_ranks - 1)`` (at most one replica of an expert per rank).
        refine_passes: most swap improvements after the greedy placement (0: greedy only). Each pass costs
            ``O(P^2 T)``.
    Returns:
        An :class:`ExpertPlacement` with ``num_experts + num_redundant`` slots; each rank's experts ascending.
    Raises:
        TypeError / ValueError naming the argument (shape, negative or non-finite counts, bad sizes).
    """
    c = _counts_array(counts)
    _int("num_ranks", num_ranks, 1)
    _int("num_redundant", num_redundant, 0)
    _int("refine_passes", refine_passes, 0)
    E = c.shape[1]
    P = E + num_redundant
    if P % num_ranks:
        raise ValueError(f"num_experts + num_redundant = {E} + {num_redundant} = {P} is not a multiple of "
                         f"num_ranks={num_ranks}")
    if P < num_ranks:
        raise ValueError(f"num_experts + num_redundant = {P} slots cannot give each of num_ranks={num_ranks} ranks "
                         f"one slot")
    if num_redundant > E * (num_ranks - 1):
        raise ValueError(f"num_redundant={num_redundant} exceeds num_experts * (num_ranks - 1) = "
                         f"{E * (num_ranks - 1)} (at most one replica of an expert per rank)")
    # counts scaled to a unit mean: the ties and tolerances do not depend on the units of the counts
    scale = c.mean()
    c = c / scale if scale > 0 and math.isfinite(scale) else np.zeros_like(c)
    r = _replicate(c, num_ranks, num_redundant)
    ranks = _place(c, r, num_ranks)
    if refine_passes and num_ranks > 1:
        _refine(c, r, ranks, refine_passes)
    return ExpertPlacement(E, num_ranks, tuple(e for rk in ranks for e in sorted(rk)))


class ExpertLoadWindow:
    """Per-step expert token counts of every MoE layer over the last ``window`` steps, kept on the device.

    :meth:`record` adds one routing (``topk_idx``) to the current step's row with a device ``bincount`` (no host
    synchronisation); :meth:`next_step` moves to the next row of the ring; :meth:`counts` returns the window
    (oldest first) for :func:`rebalance`. Under DP, all-reduce the tensor from :meth:`counts` over the DP group
    first (every rank must then see the same counts, so every rank computes the same placement).
    """

    def __init__(self, num_layers: int, num_experts: int, window: int, device: torch.device | str = "cpu"):
        _int("num_layers", num_layers, 1)
        _int("num_experts", num_experts, 1)
        _int("window", window, 1)
        self.num_experts = num_experts
        self.window = window
        # window + 1 rows: the completed steps and the current one
        self._counts = torch.zeros(num_layers, window + 1, num_experts, dtype=torch.int64, device=device)
        self._row = 0
        self.num_steps = 0

    def record(self, layer: int, topk_idx: torch.Tensor) -> None:
        """Count ``topk_idx [T, k]``'s valid ids (in ``[0, E)``) into ``layer``'s current step."""
        idx = topk_idx.reshape(-1).long()
        idx = idx[(idx >= 0) & (idx < self.num_experts)] if idx.device.type == "cpu" else \
            torch.where((idx >= 0) & (idx < self.num_experts), idx, self.num_experts)
        binc = torch.bincount(idx, minlength=self.num_experts + 1)[: self.num_experts]
        self._counts[layer, self._row] += binc.to(self._counts.device)

    def next_step(self) -> None:
        self._row = (self._row + 1) % (self.window + 1)
        self._counts[:, self._row].zero_()
        self.num_steps += 1

    def counts(self, layer: int | None = None) -> torch.Tensor:
        """``[min(steps, window), E]`` for ``layer`` (or ``[layers, ...]`` for all), oldest step first, completed
        steps only."""
        n = min(self.num_steps, self.window)
        rows = [(self._row - n + i) % (self.window + 1) for i in range(n)]
        t = self._counts[:, rows]
        return t if layer is None else t[layer]
