"""The confidence schedule's cost model and choice (``docs/speculative.md``): step costs profiled at start-up
(:class:`StepCostTable`, :func:`profile_step_cost`, :func:`profile_plain_steps`), the cost shapes of a step
(:class:`CostByLongest` for graph steps, :class:`CostByTokens` for eager ones) and :func:`choose_lengths`, the
verified drafts per sequence that maximise expected emitted tokens per unit of cost."""

from __future__ import annotations

import time

import torch


class StepCostTable:
    """Measured step cost against batch shape, read on the host: ``table(num_seqs, num_tokens)`` -> seconds.

    ``points``: ``{num_seqs: [(num_tokens, seconds), ...]}``. A query takes the smallest measured batch size at or
    above ``num_seqs`` (the largest when none is), then interpolates linearly in ``num_tokens`` between its points
    (extrapolating from the last two past either end). Raises ValueError naming ``points`` when it is empty or a
    batch size has no point."""

    def __init__(self, points: dict[int, list[tuple[int, float]]]) -> None:
        if not points or any(not v for v in points.values()):
            raise ValueError("points: every measured batch size needs at least one (num_tokens, seconds) point")
        self.points = {int(n): sorted((int(t), float(c)) for t, c in v) for n, v in points.items()}
        self._sizes = sorted(self.points)

    def __call__(self, num_seqs: int, num_tokens: int) -> float:
        fits = [n for n in self._sizes if n >= num_seqs]
        pts = self.points[fits[0] if fits else self._sizes[-1]]
        if len(pts) == 1:
            return pts[0][1]
        i = next((j for j in range(1, len(pts)) if pts[j][0] >= num_tokens), len(pts) - 1)
        (t0, c0), (t1, c1) = pts[i - 1], pts[i]
        c = c0 + (c1 - c0) * (num_tokens - t0) / max(t1 - t0, 1)
        return max(c, 1e-9)


@torch.inference_mode()
def profile_step_cost(runner, batch_sizes: list[int], max_drafts: int, repeats: int = 2) -> StepCostTable:
    """Time verification-shaped target forwards at start-up (before any request: the dummy sequences all write
    block 0, as a graph capture's do): for each batch size ``n`` and each ``1 + k`` tokens per sequence (``k`` in
    ``0 .. max_drafts``), the best of ``repeats`` timed forwards after one warm-up. Returns the
    :class:`StepCostTable`."""
    from deepinfer.models.deepseek_v4.plan import SeqStep

    dev = runner.device
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    points: dict[int, list[tuple[int, float]]] = {}
    for n in batch_sizes:
        for q in range(1, max_drafts + 2):
            plan_args = ([SeqStep(0, q, (0,))] * n, [0] * (n * q), list(range(n * q)))
            best = float("inf")
            for r in range(repeats + 1):
                plan = runner.builder.build(*plan_args, runner.batch_invariant, checked=True)
                for cp in plan.comp.values():
                    cp.deferred = []
                sync()
                t = time.perf_counter()
                runner.model.forward(plan, runner.cache)
                sync()
                if r:
                    best = min(best, time.perf_counter() - t)
            points.setdefault(n, []).append((n * q, best))
    return StepCostTable(points)


@torch.inference_mode()
def profile_plain_steps(runner, repeats: int = 3) -> dict[int, float]:
    """Seconds of a plain decode step per captured CUDA-graph bucket at start-up: the best of ``repeats`` timed
    replays (after one warm-up) of each bucket's graph over its dummy plan. Empty without graphs."""
    from deepinfer.spec_graphs import best_seconds

    return {bucket: best_seconds(g.graph.replay, runner.device, repeats) for bucket, g in sorted(runner.graphs.items())}


def default_step_cost(num_seqs: int, num_tokens: int) -> float:
    """A step's cost in arbitrary units when none was profiled: a fixed part and a part per token (the shape of a
    step that reads every weight once and then grows with its tokens)."""
    return 1.0 + num_tokens / 64.0


class CostByLongest:
    """A step cost set by its longest verification alone (one CUDA graph per draft count):
    ``cost(lengths) = per_drafts[max(lengths)]``. :func:`choose_lengths` then tries the common caps only."""

    __slots__ = ("per_drafts",)

    def __init__(self, per_drafts: list[float]) -> None:
        self.per_drafts = per_drafts

    def __call__(self, lengths: list[int]) -> float:
        return self.per_drafts[max(lengths, default=0)]


class CostByTokens:
    """A step cost set by its tokens: ``cost(num_seqs, base + sum(lengths))`` (``base``: the tokens besides the
    drafts). :func:`choose_lengths` keeps the draft total as it goes instead of summing ``lengths`` per try."""

    __slots__ = ("cost", "num_seqs", "base")

    def __init__(self, cost, num_seqs: int, base: int) -> None:
        self.cost, self.num_seqs, self.base = cost, num_seqs, base

    def __call__(self, lengths: list[int]) -> float:
        return self.of_drafts(sum(lengths))

    def of_drafts(self, drafts: int) -> float:
        return self.cost(self.num_seqs, self.base + drafts)


def choose_lengths(confidences: list[list[float]], step_cost) -> tuple[list[int], float]:
    """Verified drafts per sequence that maximise expected emitted tokens per unit of step cost.

    A sequence verifying ``j`` drafts emits ``1 + sum_{i <= j} s_i`` tokens in expectation, where the survival
    ``s_i`` is the product of its first ``i`` confidences. Two families of choices are tried, each the best for one
    shape of cost: the ``T`` largest survivals for every ``T`` (a cost that grows with the number of drafts:
    survivals only fall along a sequence), and every common cap ``L`` (a cost set by the longest sequence, as one
    CUDA graph per length is). A :class:`CostByLongest` takes the caps alone: at a given longest length, verifying
    every sequence's drafts up to it costs nothing more and only adds expected tokens.

    Args:
        confidences: per sequence, its drafts' confidences (probabilities in [0, 1]), in order.
        step_cost: ``step_cost(lengths) -> float > 0``, the step's cost verifying ``lengths[i]`` drafts of
            sequence ``i``.
    Returns:
        ``(lengths, rate)``: drafts to verify per sequence (each at most its number of drafts), and the expected
        tokens per unit of cost that choice gives.
    """
    surv = []
    for cs in confidences:
        s, row = 1.0, []
        for c in cs:
            s *= min(max(float(c), 0.0), 1.0)
            row.append(s)
        surv.append(row)
    n = len(confidences)
    k = [0] * n
    best, best_k = n / step_cost(k), list(k)

    def consider(lengths: list[int], expected: float) -> None:
        nonlocal best, best_k
        rate = expected / step_cost(lengths)
        if rate > best:
            best, best_k = rate, list(lengths)

    expected = float(n)
    if not isinstance(step_cost, CostByLongest):
        by_total = step_cost.of_drafts if isinstance(step_cost, CostByTokens) else None
        total = 0
        for neg_s, j, i in sorted((-s, j, i) for i, row in enumerate(surv) for j, s in enumerate(row)):
            if j + 1 > k[i]:
                total += j + 1 - k[i]
                k[i] = j + 1
            expected -= neg_s
            if by_total is None:
                consider(k, expected)
            elif expected / by_total(total) > best:
                best, best_k = expected / by_total(total), list(k)
    expected = float(n)
    for cap in range(1, max(map(len, surv), default=0) + 1):
        expected += sum(row[cap - 1] for row in surv if len(row) >= cap)
        consider([min(cap, len(row)) for row in surv], expected)
    return best_k, best
