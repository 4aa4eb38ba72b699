"""Expert parallelism at load time: which routed-expert tensors a rank reads, and how they map to its slots.

Each EP rank builds the whole model except the routed experts, of which it holds only its placement's local slots
(:meth:`ExpertPlacement.local_experts`): attention, router, shared expert, embeddings and head are replicated. The
checkpoint loader reads tensors memory-mapped, one by one (``safetensors.safe_open``), so skipping the other ranks'
experts (:meth:`ExpertParallel.skip`, the ``skip`` argument of ``deepinfer.checkpoint.load_checkpoint``) means their
bytes are never read; their headers are still validated, so a broken checkpoint fails on every rank alike.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .placement import ExpertPlacement, _int

#: ``<moe>.experts.<E>.<leaf>``: ``<moe>`` is the MoE module's name (``layers.3.ffn``, ``mtp.0.ffn``)
_EXPERT_NAME = re.compile(r"^(?P<moe>.+\.ffn)\.experts\.(?P<expert>\d+)\.(?P<leaf>.+)$")


def parse_expert_name(name: str) -> tuple[str, int, str] | None:
    """``"layers.3.ffn.experts.17.w1.weight"`` -> ``("layers.3.ffn", 17, "w1.weight")``; None for other tensors."""
    m = _EXPERT_NAME.match(name)
    return (m["moe"], int(m["expert"]), m["leaf"]) if m else None


@dataclass
class ExpertParallel:
    """One rank's expert-parallel context: its rank in the EP group, the group, and the placement of every MoE
    layer (``placements[moe_name]``, else ``default``).

    Attributes:
        rank: this rank in ``[0, world_size)``.
        world_size: EP ranks; every placement must have ``num_ranks == world_size``.
        group: the torch.distributed EP group (None: the default group).
        default: placement of MoE layers not in ``placements`` (None: every layer must be listed).
        placements: ``{moe module name: ExpertPlacement}`` (EPLB output per layer).
        layout: the expert-side layout of the FP8 path, ``"contiguous"`` (``m_grouped_fp8_gemm_nt_contiguous``) or
            ``"masked"`` (``m_grouped_fp8_gemm_nt_masked``, ``max_tokens_per_expert`` rows per slot; None: the
            step's largest count). The same on every rank (a masked capacity overflow raises on every rank).
        max_tokens_per_expert: the masked layout's capacity.
    Raises (on construction): TypeError / ValueError naming the field.
    """

    rank: int
    world_size: int
    group: Any = None
    default: ExpertPlacement | None = None
    placements: Mapping[str, ExpertPlacement] = field(default_factory=dict)
    layout: str = "contiguous"
    max_tokens_per_expert: int | None = None

    def __post_init__(self) -> None:
        if self.layout not in ("contiguous", "masked"):
            raise ValueError(f"ExpertParallel.layout must be 'contiguous' or 'masked', got {self.layout!r}")
        if self.max_tokens_per_expert is not None:
            _int("ExpertParallel.max_tokens_per_expert", self.max_tokens_per_expert, 0)
        _int("ExpertParallel.world_size", self.world_size, 1)
        _int("ExpertParallel.rank", self.rank, 0)
        if self.rank >= self.world_size:
            raise ValueError(f"ExpertParallel.rank={self.rank} must be < world_size={self.world_size}")
        for where, p in [("default", self.default)] + [(f"placements[{k!r}]", v) for k, v in self.placements.items()]:
            if p is None:
                continue
            if not isinstance(p, ExpertPlacement):
                raise TypeError(f"ExpertParallel.{where} must be an ExpertPlacement, got {type(p).__name__}")
            if p.num_ranks != self.world_size:
                raise ValueError(f"ExpertParallel.{where} has num_ranks={p.num_ranks}, world_size is "
                                 f"{self.world_size}")

    def placement(self, moe_name: str) -> ExpertPlacement:
        p = self.placements.get(moe_name, self.default)
        if p is None:
            raise ValueError(f"ExpertParallel: no placement for MoE layer {moe_name!r} and no default")
        return p

    def local_experts(self, moe_name: str) -> tuple[int, ...]:
        return self.placement(moe_name).local_experts(self.rank)

    def skip(self, name: str) -> bool:
        """True for a routed-expert tensor this rank does not hold (the checkpoint loader's ``skip``)."""
        parsed = parse_expert_name(name)
        if parsed is None:
            return False
        moe, expert, _ = parsed
        return expert not in self.local_experts(moe)

    def module_name(self, name: str) -> str:
        """The model-side name of checkpoint tensor ``name``: a routed expert ``<moe>.experts.<E>.<leaf>`` lives
        in its local slot, ``<moe>.experts.<slot>.<leaf>``; other names are unchanged. Raises ValueError for an
        expert this rank does not hold."""
        parsed = parse_expert_name(name)
        if parsed is None:
            return name
        moe, expert, leaf = parsed
        local = self.local_experts(moe)
        if expert not in local:
            raise ValueError(f"tensor {name!r}: expert {expert} of {moe} is not on EP rank {self.rank} "
                             f"(its experts: {list(local)})")
        return f"{moe}.experts.{local.index(expert)}.{leaf}"


def initial_expert_parallel(num_experts: int, rank: int, world_size: int, num_redundant: int = 0,
                            **kwargs) -> ExpertParallel:
    """The placement a model starts with, the same for every MoE layer: contiguous without redundant slots, else
    ``eplb.rebalance`` of no counts (every expert once, the redundant slots to the lowest ids). ``kwargs`` go to
    :class:`ExpertParallel` (``layout``, ...).

    Raises:
        ValueError naming ``num_redundant_experts`` when ``num_experts + num_redundant`` is not a multiple of
        ``world_size``, or there are more redundant slots than ``num_experts * (world_size - 1)``.
    """
    import numpy as np

    from .eplb import rebalance

    _int("num_redundant_experts", num_redundant, 0)
    if (num_experts + num_redundant) % world_size:
        raise ValueError(f"num_redundant_experts={num_redundant}: the {num_experts} routed experts plus the redundant "
                         f"slots must be a multiple of expert_parallel_size={world_size}")
    if num_redundant > num_experts * (world_size - 1):
        raise ValueError(f"num_redundant_experts={num_redundant}: at most {num_experts * (world_size - 1)} for "
                         f"{num_experts} experts over {world_size} ranks (one replica per rank)")
    placement = ExpertPlacement.contiguous(num_experts, world_size) if num_redundant == 0 else \
        rebalance(np.zeros((1, num_experts)), world_size, num_redundant)
    return ExpertParallel(rank, world_size, default=placement, **kwargs)
