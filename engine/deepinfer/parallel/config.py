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
    """

    data_parallel_size: int = 1
    expert_parallel_size: int = 1
    num_redundant_experts: int = 0
    eplb_window: int = 128
    eplb_interval: int | None = None
    backend: str | None = None

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

    @property
    def world_size(self) -> int:
        return self.data_parallel_size

    def resolved_backend(self, device: torch.device | str) -> str:
        if self.backend is not None:
            return self.backend
        return "nccl" if torch.device(device).type == "cuda" else "gloo"


def dp_any_work(has_work: bool, group=None, device: torch.device | str = "cpu") -> bool:
    """Collective: True when any DP rank of ``group`` has work this step (one all-reduce of a flag; without an
    initialised process group, ``has_work`` itself)."""
    if not (dist.is_available() and dist.is_initialized()):
        return bool(has_work)
    flag = torch.tensor([1 if has_work else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())
