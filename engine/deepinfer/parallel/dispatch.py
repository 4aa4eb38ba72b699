"""Token dispatch and combine for expert parallelism over torch.distributed (``all_to_all_single`` with split sizes).

Every EP rank holds the stacked weights of its ``slots_per_rank`` physical expert slots (:class:`ExpertPlacement`).
One MoE layer on one rank:

1. :func:`dispatch` maps each token's top-k logical experts to physical slots (the placement's replica rule), and
   sends the token's hidden state *once* to every rank that holds at least one of its slots, with a ``[k]`` row of
   the local slot ids it meets there (-1 elsewhere). The payload rows are raw bytes, so bf16 / fp32 activations and
   FP8 codes with their float32 1x128 scales travel alike: ``[hidden codes | scales | k int32 slot ids]``.
2. The receiving rank lays the (row, slot) pairs it got out per local expert, in the shapes the grouped GEMMs take:
   ``"contiguous"`` (prefill: ``[M, hidden]`` rows sorted by local expert with ``m_indices [M]``, for
   :func:`deepinfer_ops.m_grouped_fp8_gemm_nt_contiguous`) or ``"masked"`` (decode: ``[S, max_m, hidden]`` with
   ``masked_m [S]``, for :func:`deepinfer_ops.m_grouped_fp8_gemm_nt_masked`). Within an expert, pairs keep the order
   (source rank, token, slot), so the layout depends only on the routing.
3. :func:`combine` sends every pair's expert output back to the token's rank (one row per (token, slot): the
   reduction is *not* split across ranks) and reduces there in a fixed order: slot order ``j = 0..k-1`` in float32
   (``deepinfer_ops.moe_combine``, the ``fused_moe_fp8`` order) or ascending expert id in the output dtype (the
   ``"dequant"`` path's order). A token's result is then bit-identical to the single-process MoE whenever the
   expert GEMMs compute each row on their own (batch-invariant kernels), whatever the other ranks send.

Counts. Each rank first contributes its ``[R, 1 + S]`` counts (rows per destination, pairs per destination slot) to
one ``all_gather``, so every rank knows the whole ``[R, R, 1 + S]`` matrix on the host: the split sizes, the
per-expert sizes of the layout and the ``max_tokens_per_expert`` check are then decided alike on every rank (an
overflow raises on every rank, never on one while the others wait), and a step where no rank routes a token skips
the data collectives on every rank. A rank whose inputs fail validation still joins the ``all_gather`` with a
poisoned row, so every rank raises instead of hanging.

Synchronisation: the split sizes must be host integers, so dispatch reads the counts back (one host sync per
layer); this path therefore cannot be captured in a CUDA graph (a fixed-capacity device-side path is future work).
Sources: DeepEP's dispatch / combine interface and layouts, DeepGEMM's contiguous / masked grouped layouts (read for
design, not copied).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

import deepinfer_ops

from .placement import ExpertPlacement

LAYOUTS = ("contiguous", "masked")
ORDERS = ("slot", "expert")
_SCALE_GROUP = 128


class DispatchError(ValueError):
    """Raised on every rank of a dispatch when any rank's inputs are invalid or a capacity is exceeded."""


@dataclass
class Dispatched:
    """A rank's received tokens, laid out for its local experts, and what :func:`combine` needs.

    Attributes:
        x: ``"contiguous"``: ``[M, hidden]`` rows grouped by local slot (ascending), ``M`` = pairs received;
            ``"masked"``: ``[S, max_m, hidden]`` (rows past ``masked_m[s]`` are zero). Dtype as sent.
        x_scale: float32 ``[M, ceil(hidden / 128)]`` / ``[S, max_m, ceil(hidden / 128)]`` when scales were sent.
        m_indices: ``"contiguous"``: ``[M]`` int32 local slot of each row; else None.
        masked_m: ``"masked"``: ``[S]`` int32 valid rows per local slot; else None.
        tokens_per_expert: host ``list[int]`` of ``S`` pair counts (equal to the groups' sizes).
    """

    x: torch.Tensor
    x_scale: torch.Tensor | None
    m_indices: torch.Tensor | None
    masked_m: torch.Tensor | None
    tokens_per_expert: list[int]
    layout: str
    handle: "_Handle"


@dataclass
class _Handle:
    group: object
    world: int
    num_tokens: int
    top_k: int
    slot_rows: torch.Tensor  # [T, k] int64 row of the combine's receive buffer per (token, slot), -1 padding
    logical: torch.Tensor  # [T, k] int64 logical expert ids (-1 padding): the "expert" order
    back_send: list[int]  # pairs returned to each source rank (this rank as the expert rank)
    back_recv: list[int]  # pairs coming back from each destination rank (this rank as the source)
    ret_index: torch.Tensor  # [pairs] row of the layout (flattened) holding each pair, in return order
    empty: bool  # no rank routed anything: combine skips its collective on every rank


def _world(group) -> tuple[int, int]:
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _check_inputs(x, x_scale, topk_idx, placement, layout, world) -> str | None:
    """The first problem with this rank's dispatch inputs, as a message naming the argument, or None."""
    if layout not in LAYOUTS:
        return f"layout must be one of {LAYOUTS}, got {layout!r}"
    if placement.num_ranks != world:
        return f"placement.num_ranks={placement.num_ranks} but the process group has {world} ranks"
    if x.dim() != 2:
        return f"x must be [num_tokens, hidden], got shape {list(x.shape)}"
    if topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0]:
        return f"topk_idx must be [num_tokens={x.shape[0]}, top_k], got shape {list(topk_idx.shape)}"
    if topk_idx.dtype.is_floating_point or topk_idx.dtype.is_complex or topk_idx.dtype == torch.bool:
        return f"topk_idx must be an integer tensor, got {topk_idx.dtype}"
    if topk_idx.device != x.device:
        return f"topk_idx is on {topk_idx.device}, x on {x.device}"
    if x.dtype == torch.float8_e4m3fn and x_scale is None:
        return "x is float8_e4m3fn: x_scale ([num_tokens, ceil(hidden / 128)] float32) is required"
    if x_scale is not None:
        want = (x.shape[0], -(-x.shape[1] // _SCALE_GROUP))
        if tuple(x_scale.shape) != want or x_scale.dtype != torch.float32 or x_scale.device != x.device:
            return (f"x_scale must be float32 {list(want)} on {x.device}, got {x_scale.dtype} {list(x_scale.shape)} "
                    f"on {x_scale.device}")
    return None


def dispatch(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    placement: ExpertPlacement,
    *,
    x_scale: torch.Tensor | None = None,
    layout: str = "contiguous",
    max_tokens_per_expert: int | None = None,
    group=None,
) -> Dispatched:
    """Send each token to the ranks holding its top-k experts and lay the received tokens out per local expert.

    Collective: every rank of ``group`` must call it (with its own tokens, possibly none) in the same order, then
    :func:`combine` with the result. Works without an initialised process group when ``placement`` has one rank.

    Args:
        x: ``[T, hidden]`` activations of this rank (any dtype; ``T`` may be 0). float8_e4m3fn needs ``x_scale``.
        topk_idx: ``[T, k]`` integer *logical* expert ids; ids outside ``[0, E)`` (e.g. -1) are padding, sent
            nowhere.
        placement: the layer's :class:`ExpertPlacement` (identical on every rank).
        x_scale: optional ``[T, ceil(hidden / 128)]`` float32 per-token-group scales sent with the rows.
        layout: ``"contiguous"`` or ``"masked"`` (see :class:`Dispatched`).
        max_tokens_per_expert: ``"masked"`` only: ``max_m`` (a fixed capacity keeps the shape static); None takes
            the largest count of any slot on any rank this step.
        group: the EP process group (None: the default group).
    Returns:
        :class:`Dispatched`.
    Raises:
        DispatchError on every rank (naming the argument and the rank at fault) when a rank's inputs are invalid or
        a slot receives more than ``max_tokens_per_expert`` pairs.
    """
    rank, world = _world(group)
    err = _check_inputs(x, x_scale, topk_idx, placement, layout, world)
    if err is None and max_tokens_per_expert is not None and (
            isinstance(max_tokens_per_expert, bool) or not isinstance(max_tokens_per_expert, int)
            or max_tokens_per_expert < 0 or layout != "masked"):
        err = f"max_tokens_per_expert must be None or an int >= 0 with layout='masked', got {max_tokens_per_expert!r}"
    R, S = placement.num_ranks, placement.slots_per_rank
    dev = x.device
    if err is None:
        T, k = topk_idx.shape
        logical = topk_idx.long()
        logical = torch.where((logical >= 0) & (logical < placement.num_experts), logical, -1)
        phys = placement.route(logical, rank)
        valid = phys >= 0
        dst = torch.where(valid, phys // S, -1)
        loc = torch.where(valid, phys % S, -1)
        # counts[d, 0] = rows sent to d, counts[d, 1 + s] = pairs for d's local slot s
        counts = torch.zeros(R, 1 + S, dtype=torch.int64, device=dev)
        sendmask = torch.zeros(T, R + 1, dtype=torch.bool, device=dev)
        sendmask.scatter_(1, torch.where(valid, dst, R), True)
        sendmask = sendmask[:, :R]
        counts[:, 0] = sendmask.sum(0)
        flat = (dst * S + loc)[valid]
        counts[:, 1:] = torch.bincount(flat, minlength=R * S).view(R, S)
    else:
        counts = torch.full((world if world > 0 else 1, 1 + S), -1, dtype=torch.int64, device=dev)
    allc = _gather_counts(counts.cpu(), world, group)  # [R_src, R_dst, 1 + S] host
    bad = [r for r in range(len(allc)) if bool((allc[r] < 0).any())]
    if bad:
        raise DispatchError(f"dispatch: {err}" if err else f"dispatch: rank(s) {bad} passed invalid inputs "
                            f"(the message is on those ranks)")
    per_expert = allc[:, :, 1:].sum(0)  # [R_dst, S]
    if layout == "masked":
        worst = int(per_expert.max()) if per_expert.numel() else 0
        if max_tokens_per_expert is not None and worst > max_tokens_per_expert:
            d, s = divmod(int(per_expert.argmax()), S)
            raise DispatchError(f"dispatch: max_tokens_per_expert={max_tokens_per_expert} is exceeded: local slot "
                                f"{s} of rank {d} receives {worst} tokens this step")
        max_m = max_tokens_per_expert if max_tokens_per_expert is not None else worst
    empty = int(allc[:, :, 0].sum()) == 0
    send_rows = allc[rank, :, 0].tolist()
    recv_rows = allc[:, rank, 0].tolist()
    back_send = allc[:, rank, 1:].sum(1).tolist()  # pairs this rank received from (and returns to) each source
    back_recv = allc[rank, :, 1:].sum(1).tolist()

    # ---- the send buffer: rows by destination then token ---------------------------------------------------------
    d_idx, t_idx = sendmask.t().nonzero(as_tuple=True)  # sorted by destination, then token
    meta = torch.where(dst[t_idx] == d_idx.view(-1, 1), loc[t_idx], -1).to(torch.int32)  # [rows, k]
    parts = [_bytes(x)[t_idx]]  # bytes: any dtype (FP8 included) moves alike
    if x_scale is not None:
        parts.append(_bytes(x_scale)[t_idx])
    parts.append(_bytes(meta))
    widths = [p.shape[1] for p in parts]
    send = torch.cat(parts, dim=1) if t_idx.shape[0] else torch.empty(0, sum(widths), dtype=torch.uint8, device=dev)
    recv = torch.empty(sum(recv_rows), sum(widths), dtype=torch.uint8, device=dev)
    if not empty and world > 1:
        dist.all_to_all_single(recv, send, recv_rows, send_rows, group=group)
    elif not empty:
        recv = send
    n = recv.shape[0]
    rx = recv[:, :widths[0]]  # [n, hidden * itemsize] bytes
    rs = _from_bytes(recv[:, widths[0]:widths[0] + widths[1]], torch.float32) if x_scale is not None else None
    rmeta = _from_bytes(recv[:, sum(widths) - widths[-1]:], torch.int32).long()

    # ---- the layout ----------------------------------------------------------------------------------------------
    pair_row, pair_slot = (rmeta >= 0).nonzero(as_tuple=True)  # return order: (source, token, slot)
    le = rmeta[pair_row, pair_slot]
    order = torch.sort(le, stable=True).indices  # layout order: by local slot, then return order
    tokens_per_expert = per_expert[rank].tolist()
    if layout == "contiguous":
        src = pair_row[order]
        lx = _from_bytes(rx[src], x.dtype)
        ls = rs[src] if rs is not None else None
        m_indices = le[order].to(torch.int32)
        masked_m = None
        ret_index = torch.empty_like(order)
        ret_index[order] = torch.arange(order.shape[0], device=dev)
    else:
        starts = torch.tensor([0] + tokens_per_expert, dtype=torch.int64).cumsum(0)[:-1].to(dev)
        pos = torch.empty_like(order)
        pos[order] = torch.arange(order.shape[0], device=dev)
        ret_index = le * max_m + (pos - starts[le])
        lx = torch.zeros(S * max_m, widths[0], dtype=torch.uint8, device=dev)
        lx[ret_index] = rx[pair_row]
        lx = _from_bytes(lx, x.dtype).view(S, max_m, x.shape[1])
        ls = None
        if rs is not None:
            ls = torch.zeros(S * max_m, rs.shape[1], dtype=torch.float32, device=dev)
            ls[ret_index] = rs[pair_row]
            ls = ls.view(S, max_m, rs.shape[1])
        m_indices = None
        masked_m = torch.tensor(tokens_per_expert, dtype=torch.int32, device=dev)

    # ---- where each (token, slot) comes back (this rank as the source) -----------------------------------------------
    key = (dst * (T * k) + torch.arange(T * k, device=dev).view(T, k))[valid]
    kord = torch.sort(key).indices
    pos = torch.empty_like(kord)
    pos[kord] = torch.arange(kord.shape[0], device=dev)
    slot_rows = torch.full((T, k), -1, dtype=torch.int64, device=dev)
    slot_rows[valid] = pos
    handle = _Handle(group, world, T, k, slot_rows, logical, back_send, back_recv, ret_index, empty)
    return Dispatched(lx, ls, m_indices, masked_m, tokens_per_expert, layout, handle)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A 2-D tensor's rows as bytes ``[rows, cols * itemsize]`` uint8 (a view of a contiguous copy)."""
    t = t.contiguous()
    return t.view(torch.uint8).view(t.shape[0], t.shape[1] * t.element_size())


def _from_bytes(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`_bytes`: ``[rows, nbytes]`` uint8 -> ``[rows, nbytes / itemsize]`` of ``dtype``."""
    b = b.contiguous()
    size = torch.empty((), dtype=dtype).element_size()
    return b.view(dtype).view(b.shape[0], b.shape[1] // size)


def _gather_counts(counts: torch.Tensor, world: int, group) -> torch.Tensor:
    """``[R_src, R_dst, 1 + S]`` host int64: every rank's counts (a poisoned rank's rows are -1)."""
    if world <= 1:
        return counts.unsqueeze(0)
    out = [torch.empty_like(counts) for _ in range(world)]
    dist.all_gather(out, counts, group=group)
    return torch.stack(out)


def combine(
    y: torch.Tensor,
    dispatched: Dispatched,
    topk_weights: torch.Tensor,
    *,
    order: str = "slot",
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Bring every pair's expert output back to its token's rank and reduce it in a fixed order.

    Collective (after :func:`dispatch`, on every rank of its group).

    Args:
        y: the local experts' outputs in ``dispatched``'s layout: ``[M, hidden]`` (contiguous) or
            ``[S, max_m, hidden]`` (masked); float32 / bfloat16 / float16. Unweighted (routing weights are applied
            here, on the token's rank).
        dispatched: this rank's :func:`dispatch` result.
        topk_weights: ``[T, k]`` routing weights of this rank's tokens (the ``topk_idx`` given to dispatch).
        order: ``"slot"``: ``out[t] = sum_j w[t, j] * y_j`` over ``j = 0..k-1`` in float32, rounded once
            (``deepinfer_ops.moe_combine``; the ``fused_moe_fp8`` result); ``"expert"``: ``h_j = y_j * w[t, j]`` in
            ``out_dtype``, added to zeros in ascending logical expert id in ``out_dtype`` (the ``"dequant"`` MoE).
        out_dtype: result dtype (default ``y.dtype``).
    Returns:
        ``[T, hidden]`` of ``out_dtype``; tokens with no valid slot are 0.
    Raises:
        ValueError naming the argument for a wrong ``order`` or shape (raised before any collective, so call it
        with the same ``order`` and layout shapes on every rank).
    """
    h = dispatched.handle
    if order not in ORDERS:
        raise ValueError(f"combine: order must be one of {ORDERS}, got {order!r}")
    if tuple(topk_weights.shape) != (h.num_tokens, h.top_k):
        raise ValueError(f"combine: topk_weights must be [{h.num_tokens}, {h.top_k}], got {list(topk_weights.shape)}")
    want = dispatched.x.shape[:-1]
    if y.shape[:-1] != want:
        raise ValueError(f"combine: y must be [{', '.join(map(str, want))}, hidden] like the dispatched x, got "
                         f"{list(y.shape)}")
    hidden = y.shape[-1]
    out_dtype = out_dtype or y.dtype
    flat = y.reshape(-1, hidden)
    send = flat[h.ret_index].contiguous()
    back = torch.empty(sum(h.back_recv), hidden, dtype=y.dtype, device=y.device)
    if not h.empty and h.world > 1:
        dist.all_to_all_single(_bytes(back), _bytes(send), h.back_recv, h.back_send, group=h.group)
    elif not h.empty:
        back = send
    if h.num_tokens == 0:
        return torch.zeros(0, hidden, dtype=out_dtype, device=y.device)
    if order == "slot":
        return deepinfer_ops.moe_combine(back, h.slot_rows, topk_weights.float().contiguous(), out_dtype)
    # ascending logical expert id; padding slots last
    key = torch.where(h.logical >= 0, h.logical, torch.iinfo(torch.int64).max)
    srt = torch.sort(key, dim=1, stable=True).indices
    rows = h.slot_rows.gather(1, srt)
    w = topk_weights.gather(1, srt)
    acc = torch.zeros(h.num_tokens, hidden, dtype=out_dtype, device=y.device)
    for j in range(h.top_k):
        sel = (rows[:, j] >= 0).nonzero(as_tuple=True)[0]
        if sel.numel():
            hj = back[rows[sel, j]].to(out_dtype) * w[sel, j, None].to(out_dtype)
            acc.index_add_(0, sel, hj)
    return acc
