"""One DP rank's step loop under expert parallelism: agree, share the prefill budget, step or run an empty step,
rebalance the experts.

Every rank calls :meth:`DPStepper.step` once per iteration of its engine loop. Each call runs exactly one model
forward on every rank (a real step, or an empty one when the rank has nothing to run), so the MoE layers'
collectives pair up across ranks; the loop ends on every rank at the same iteration, when no rank has work.
Design: ``docs/expert-parallel.md`` ("DP attention and empty steps", "Prefill across ranks").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .config import allocate_prefill, dp_step_agreement


@dataclass
class DPStepStats:
    """Per iteration of the current run (reset by :meth:`DPStepper.reset`): ``(prefill tokens allowed, prefill
    tokens scheduled, all tokens scheduled)`` of this rank; and counters over the stepper's life."""

    steps: list[tuple[int, int, int]] = field(default_factory=list)
    num_empty_steps: int = 0
    num_rebalances: int = 0


class DPStepper:
    """The DP step loop of one rank (collective: every rank of the group calls :meth:`step` in lockstep).

    Args:
        engine: this rank's ``LLMEngine`` (its scheduler's ``prefill_budget`` is set before each step).
        rank / world: this rank in the DP group and the group's size.
        prefill_budget: the most prefill tokens of all ranks together per step (``allocate_prefill``).
        quantum: the allocation unit (the chunk alignment in batch-invariant mode, else 1).
        eplb: an ``rearrange.EPLBController`` (its ``after_step`` runs after every forward), or None.
        group: the process group (None: the default one); device: where the agreement's tensor lives (CUDA for
            NCCL).
    """

    def __init__(self, engine, rank: int, world: int, prefill_budget: int, quantum: int = 1, eplb=None,
                 group=None, device="cpu") -> None:
        self.engine, self.rank, self.world = engine, rank, world
        self.prefill_budget, self.quantum, self.eplb = prefill_budget, quantum, eplb
        self.group, self.device = group, device
        self.iteration = 0  # the same on every rank
        self.stopped = False  # some rank asked every rank to stop (``step(stop=True)``)
        self.stats = DPStepStats()

    def reset(self) -> None:
        """Start a run's per-iteration log (the life counters stay)."""
        self.stats.steps = []

    def step(self, stop: bool = False):
        """One iteration: the sequences touched (as ``LLMEngine.step``), or None when no rank has work or some rank
        passed ``stop`` (then ``stopped`` is set); every rank returns None at this same iteration."""
        engine = self.engine
        sched, runner = engine.scheduler, engine.runner
        has = engine.has_unfinished_requests()
        votes = dp_step_agreement(has, sched.prefill_demand() if has else 0, self.group, self.device, stop)
        if any(s for _, _, s in votes):
            self.stopped = True
            return None
        if not any(h for h, _, _ in votes):
            return None
        allowed = allocate_prefill([d for _, d, _ in votes], self.prefill_budget, self.quantum, self.iteration)
        self.iteration += 1
        sched.prefill_budget = allowed[self.rank]
        sched.last_prefill_tokens = sched.last_num_tokens = 0
        n0 = runner.num_forwards
        try:
            touched = engine.step() if has else []
        finally:
            sched.prefill_budget = None
        if runner.num_forwards == n0:  # nothing of ours ran: our experts still serve the other ranks' tokens
            runner.execute_empty()
            self.stats.num_empty_steps += 1
        self.stats.steps.append((allowed[self.rank], sched.last_prefill_tokens, sched.last_num_tokens))
        if self.eplb is not None and self.eplb.after_step():
            self.stats.num_rebalances += 1
        return touched
