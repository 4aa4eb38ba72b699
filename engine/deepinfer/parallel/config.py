"""The parallel configuration and the DP step agreement.

``ParallelConfig(data_parallel_size, expert_parallel_size, ...)``: attention runs data-parallel (each DP rank
schedules its own requests and holds its own cache) and the routed experts are spread over the EP ranks; on one
node the two groups are the same processes (DeepInfer's EP4DP4 / EP64DP64), so ``expert_parallel_size`` must equal
``data_parallel_size`` or be 1 (no EP). Processes come from torch's own launchers (``torch.multiprocessing`` spawn
or torchrun's environment) with NCCL on GPUs and gloo on the CPU.

DP steps (:func:`dp_any_work`): the MoE layers meet across ranks in every step, so the ranks agree each step,
with one all-reduce of a flag, whether anyone has work; a rank without work then runs an empty step (the model
still joins each MoE layer's collectives, ``DeepseekV4ForCausalLM._idle_moe``) and nobody waits forever. When no
rank has work they all stop together.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .placement import _int

BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class ParallelConfig:
    """Attributes:
        data_parallel_size: DP attention ranks (>= 1).
        expert_parallel_size: EP ranks (1 or ``data_parallel_size``).
        num_redundant_experts: extra replica slots per MoE layer for the load balancer (>= 0).
        eplb_window: steps of expert counts the balancer looks at (>= 1).
        eplb_interval: steps between rebalances (None: static placement).
        backend: ``"gloo"`` / ``"nccl"``; None picks NCCL on CUDA devices, gloo otherwise.
        prefill_budget: the most prefill tokens all DP ranks together compute per step under expert parallelism
            (None: the engine's ``max_num_batched_tokens``; see :func:`allocate_prefill`).
        timeout_s: seconds a collective waits for the other ranks before it fails.
    """

    data_parallel_size: int = 1
    expert_parallel_size: int = 1
    num_redundant_experts: int = 0
    eplb_window: int = 128
    eplb_interval: int | None = None
    backend: str | None = None
    prefill_budget: int | None = None
    timeout_s: float = 600.0

    def validate(self) -> None:
        """Raise TypeError / ValueError naming the field."""
        _int("ParallelConfig.data_parallel_size", self.data_parallel_size, 1)
        _int("ParallelConfig.expert_parallel_size", self.expert_parallel_size, 1)
        _int("ParallelConfig.num_redundant_experts", self.num_redundant_experts, 0)
        _int("ParallelConfig.eplb_window", self.eplb_window, 1)
        if self.eplb_interval is not None:
            _int("ParallelConfig.eplb_interval", self.eplb_interval, 1)
        if self.expert_parallel_size not in (1, self.data_parallel_size):
            raise ValueError(f"ParallelConfig.expert_parallel_size={self.expert_parallel_size} must be 1 or equal "
                             f"data_parallel_size={self.data_parallel_size} (EP spans the DP ranks)")
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"ParallelConfig.backend must be one of {BACKENDS} or None, got {self.backend!r}")
        if self.num_redundant_experts and self.expert_parallel_size == 1:
            raise ValueError("ParallelConfig.num_redundant_experts needs expert_parallel_size > 1")
        if self.eplb_interval is not None and self.expert_parallel_size == 1:
            raise ValueError("ParallelConfig.eplb_interval needs expert_parallel_size > 1")
        if self.prefill_budget is not None:
            _int("ParallelConfig.prefill_budget", self.prefill_budget, 1)
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0 or t == float("inf"):
            raise ValueError(f"ParallelConfig.timeout_s must be a positive finite number of seconds, got {t!r}")

    @property
    def world_size(self) -> int:
        return self.data_parallel_size

    def resolved_backend(self, device: torch.device | str) -> str:
        if self.backend is not None:
            return self.backend
        return "nccl" if torch.device(device).type == "cuda" else "gloo"


def allocate_prefill(demands: list[int], budget: int, quantum: int = 1, step: int = 0) -> list[int]:
    """Share one step's prefill budget among the DP ranks (pure; every rank computes it from the same gathered
    demands, so they agree without another message).

    Args:
        demands: per rank, the prefill tokens it could compute this step (>= 0).
        budget: the most prefill tokens of all ranks together (>= ``quantum``).
        quantum: the allocation unit (the chunk alignment in batch-invariant mode, else 1): a rank gets a multiple
            of it, and a demand is rounded up to one (a prompt's last chunk may be shorter).
        step: rotates which rank takes the remainder first, so that no rank is always last.
    Returns:
        per rank its allowance: a multiple of ``quantum``, the sum at most ``budget``, max-min fair (a rank never
        gets more than its rounded demand; every demanding rank gets at least one quantum when the budget allows
        it, and within ``len(demands)`` steps otherwise).
    """
    R = len(demands)
    want = [-(-max(0, int(d)) // quantum) for d in demands]  # in quanta
    left = budget // quantum
    got = [0] * R
    order = [(step + i) % R for i in range(R)]
    active = [r for r in order if want[r] > 0]
    while left > 0 and active:
        share = max(1, left // len(active))
        for r in list(active):
            g = min(share, want[r] - got[r], left)
            got[r] += g
            left -= g
            if got[r] == want[r]:
                active.remove(r)
            if left == 0:
                break
    return [g * quantum for g in got]


def dp_step_agreement(has_work: bool, demand: int, group=None, device: torch.device | str = "cpu",
                      stop: bool = False) -> list[tuple[bool, int, bool]]:
    """Collective: every DP rank's ``(has_work, prefill demand, stop)`` for this step, from one ``all_gather`` of
    three integers (without an initialised process group: this rank's alone). ``stop``: the rank asks every rank to
    leave its loop (a server shutting down)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [(bool(has_work), int(demand), bool(stop))]
    mine = torch.tensor([1 if has_work else 0, int(demand), 1 if stop else 0], dtype=torch.int64, device=device)
    out = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, mine, group=group)
    return [(bool(t[0]), int(t[1]), bool(t[2])) for t in torch.stack(out).cpu()]


def dp_any_work(has_work: bool, group=None, device: torch.device | str = "cpu") -> bool:
    """Collective: True when any DP rank of ``group`` has work this step (one all-reduce of a flag; without an
    initialised process group, ``has_work`` itself)."""
    if not (dist.is_available() and dist.is_initialized()):
        return bool(has_work)
    flag = torch.tensor([1 if has_work else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())
