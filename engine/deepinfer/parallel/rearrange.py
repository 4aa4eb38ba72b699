"""EPLB between steps: count expert loads, choose new placements, move expert weights in place between ranks.

:func:`rearrange_moe` moves one MoE layer from its placement to a new one with the same slot count. Every rank
knows both placements, so the transfers need no count exchange: a slot whose new expert the rank already held is
copied locally; any other slot receives the expert's bytes from the lowest rank that held it, in one
``all_to_all_single`` (sends ordered by destination rank, then destination slot; receives by source rank, then
slot). The layer's tensors keep their storage (the stacked FP8 ``w13`` / ``w2`` and scales, or the per-slot
``Expert`` weights), so nothing referencing them goes stale, and the peak extra memory is the moved slots only.

:class:`EPLBController` ties it to the step loop: each MoE forward records its routing into an
:class:`~.eplb.ExpertLoadWindow`; every ``interval`` steps the window is summed over the EP group (so every rank
sees the same counts and computes the same placement), :func:`~.eplb.rebalance` runs per layer, and the layers are
rearranged. Results do not change: replicas hold identical weights and routing stays deterministic.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .eplb import ExpertLoadWindow, rebalance
from .placement import ExpertPlacement


def _slot_tensors(moe) -> list[list[torch.Tensor]]:
    """Per local slot, the tensors (views) holding that slot's expert."""
    if moe.is_fp8:
        return [[moe.w13[s], moe.w13_scale[s], moe.w2[s], moe.w2_scale[s]] for s in range(len(moe.local_experts))]
    return [[ex.w1.weight, ex.w3.weight, ex.w2.weight] for ex in moe.experts]


def _to_bytes(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().contiguous().view(torch.uint8).reshape(-1) for t in ts])


def _from_bytes_(ts: list[torch.Tensor], b: torch.Tensor) -> None:
    off = 0
    for t in ts:
        n = t.numel() * t.element_size()
        assert t.is_contiguous(), "expert slot tensors are contiguous views"
        t.data.view(-1).view(torch.uint8).copy_(b[off:off + n])  # in place: the storage stays the same
        off += n


def rearrange_moe(moe, new: ExpertPlacement, name: str, group=None) -> int:
    """Collective over the EP group: move the MoE layer ``name`` to placement ``new`` (same slots per rank).

    Returns: the number of slots this rank filled from another rank.
    Raises: ValueError naming ``new`` when it does not fit the layer (raised on every rank alike: the check uses
        only data every rank shares).
    """
    old, ep = moe.placement, moe.ep
    if old is None or ep is None:
        raise ValueError(f"rearrange_moe: layer {name!r} is not expert-parallel")
    if (new.num_experts, new.num_ranks, new.num_slots) != (old.num_experts, old.num_ranks, old.num_slots):
        raise ValueError(f"rearrange_moe: new placement for {name!r} has (experts, ranks, slots) = "
                         f"{(new.num_experts, new.num_ranks, new.num_slots)}, the layer "
                         f"{(old.num_experts, old.num_ranks, old.num_slots)}")
    me, R = ep.rank, old.num_ranks
    src_of = {}  # logical expert -> (lowest old rank holding it, its old slot there)
    for r in range(R):
        for s, e in enumerate(old.local_experts(r)):
            src_of.setdefault(e, (r, s))
    slots = _slot_tensors(moe)
    nbytes = sum(t.numel() * t.element_size() for t in slots[0])
    # sends: for each destination d != me, d's new slots (ascending) whose expert d lacks and whose source is me
    send_items, send_counts = [], [0] * R
    recv_items, recv_counts = [], [0] * R  # (source rank, my new slot)
    for d in range(R):
        held = set(old.local_experts(d))
        for s, e in enumerate(new.local_experts(d)):
            if e in held:
                continue
            q, qs = src_of[e]
            if q == me and d != me:
                send_items.append(qs)
                send_counts[d] += 1
            if d == me:
                recv_items.append((q, s))
                recv_counts[q] += 1
    recv_items.sort()
    dev = slots[0][0].device
    send = torch.cat([_to_bytes(slots[qs]) for qs in send_items]) if send_items else \
        torch.empty(0, dtype=torch.uint8, device=dev)
    recv = torch.empty(len(recv_items) * nbytes, dtype=torch.uint8, device=dev)
    if R > 1:
        dist.all_to_all_single(recv, send, [c * nbytes for c in recv_counts], [c * nbytes for c in send_counts],
                               group=group if group is not None else ep.group)
    # local moves: copy the old bytes of kept experts first (slots may permute), then write every slot
    old_local = old.local_experts(me)
    keep = {e: _to_bytes(slots[old_local.index(e)]) for e in new.local_experts(me) if e in old_local}
    for i, (_, s) in enumerate(recv_items):
        _from_bytes_(slots[s], recv[i * nbytes:(i + 1) * nbytes])
    for s, e in enumerate(new.local_experts(me)):
        if e in keep:
            _from_bytes_(slots[s], keep[e])
    moe.placement = new
    moe.local_experts = new.local_experts(me)
    ep.placements = {**ep.placements, name: new}
    return len(recv_items)


class EPLBController:
    """Record expert loads every step and rebalance every ``interval`` steps (collective on every EP rank).

    Args:
        model: an expert-parallel model (``model.expert_parallel`` set).
        num_redundant: redundant slots per layer (the layers' current slot counts must equal
            ``num_experts + num_redundant``).
        window: steps of counts kept; interval: steps between rebalances.
    """

    def __init__(self, model, num_redundant: int, window: int, interval: int):
        from deepinfer.models.deepseek_v4.moe import MoE

        self.model, self.num_redundant, self.interval = model, num_redundant, interval
        self.moes = [(n, m) for n, m in model.named_modules() if isinstance(m, MoE) and m.ep is not None]
        if not self.moes:
            raise ValueError("EPLBController: the model has no expert-parallel MoE layer")
        E = self.moes[0][1].cfg.n_routed_experts
        dev = next(model.parameters()).device
        self.window = ExpertLoadWindow(len(self.moes), E, window, dev)
        for i, (_, m) in enumerate(self.moes):
            m.load_recorder = (self.window, i)
        self.steps = 0

    def after_step(self) -> bool:
        """Close the step's counts; every ``interval`` steps rebalance. Returns True when it rebalanced."""
        self.window.next_step()
        self.steps += 1
        if self.steps % self.interval:
            return False
        self.rebalance()
        return True

    def rebalance(self) -> None:
        counts = self.window.counts().clone()  # [layers, steps, E]
        ep = self.moes[0][1].ep
        if ep.world_size > 1:
            dist.all_reduce(counts, group=ep.group)
        for i, (name, moe) in enumerate(self.moes):
            new = rebalance(counts[i].cpu(), ep.world_size, self.num_redundant)
            rearrange_moe(moe, new, name)
