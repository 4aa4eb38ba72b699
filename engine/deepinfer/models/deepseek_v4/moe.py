"""DeepSeek-V4 MoE: router (``sqrtsoftplus`` scores, hash layers by token id), routed experts, shared expert.

Selection by ``tid2eid[token]`` (hash layers) or the top-k of ``score + bias`` by the tie rule (higher score first,
then lower expert id); weights = the selected unbiased scores renormalised x ``routed_scaling_factor``; experts
``w2(silu(min(w1 x, L)) * clamp(w3 x, -L, L))``; the shared expert (same clamp) added unscaled.
Source: transformers 5.23 ``modeling_deepseek_v4.py``; DeepSeek-V4 paper.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import deepinfer_ops
from deepinfer.batch_invariant import pointwise

from .config import HASH_MOE, DeepseekV4Config
from .layers import Linear, _fp8_out_dtype, _param, linear_rows, pad_rows, pad_rows_buffer, quant_act_fp8


class Expert(nn.Module):
    def __init__(self, dim: int, inter: int, dtype: torch.dtype):
        super().__init__()
        self.w1 = Linear(inter, dim, dtype)  # gate
        self.w2 = Linear(dim, inter, dtype)  # down
        self.w3 = Linear(inter, dim, dtype)  # up

    def forward(self, x: torch.Tensor, limit: float, rows: int = 0) -> torch.Tensor:
        """``w2(silu(min(w1 x, limit)) * clamp(w3 x, -limit, limit))`` for ``x [M, dim]``. FP8 weights: ``x`` is
        quantised once, the gate / up GEMMs write one ``[M, 2 inter]`` tensor, the clamped SwiGLU is fused with the
        re-quantisation for ``w2`` (:func:`deepinfer_ops.swiglu_clamp_quant_fp8`, the routed experts' recipe)."""
        if self.w1.is_fp8:
            xq, xs = quant_act_fp8(x)
            dt = _fp8_out_dtype(x)
            inter = self.w1.weight.shape[0]
            gate_up = torch.empty(x.shape[0], 2 * inter, dtype=dt, device=x.device)  # each GEMM writes its half
            deepinfer_ops.fp8_gemm_nt(xq, xs, self.w1.weight, self.w1.scale, out=gate_up[:, :inter])
            deepinfer_ops.fp8_gemm_nt(xq, xs, self.w3.weight, self.w3.scale, out=gate_up[:, inter:])
            hq, hs = deepinfer_ops.swiglu_clamp_quant_fp8(gate_up, limit, column_major_scales=x.is_cuda)
            return deepinfer_ops.fp8_gemm_nt(hq, hs, self.w2.weight, self.w2.scale, out_dtype=dt)
        m = x.shape[0]
        x = pad_rows(x, rows)  # batch-invariant mode: pad once, the three GEMMs then take whole chunks
        gate = self.w1(x, rows).clamp(max=limit)
        up = self.w3(x, rows).clamp(min=-limit, max=limit)
        return self.w2(pointwise(F.silu, gate, rows) * up, rows)[:m]


class Gate(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, hashed: bool, dtype: torch.dtype):
        super().__init__()
        self.hashed = hashed
        self.weight = _param(cfg.n_routed_experts, cfg.hidden_size, dtype=dtype)
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.int64))
        else:
            self.bias = _param(cfg.n_routed_experts)  # float32


class MoE(nn.Module):
    """Router ``gate``, routed ``experts`` (one :class:`Expert` each: path ``"dequant"``) or their stacked FP8 form
    ``w13 [E, 2I', hidden]``, ``w13_scale``, ``w2 [E, hidden, I']``, ``w2_scale`` (path ``"fp8"``, set by
    :meth:`set_fp8_experts`; ``experts`` is then empty), and the ``shared_experts``.

    Expert parallelism (:meth:`set_expert_parallel`): the layer holds only its rank's slots (``local_experts``, in
    slot order, in place of all ``E``), and :meth:`forward` dispatches tokens to the ranks of their experts and
    combines the results (``deepinfer.parallel.dispatch``; ``docs/expert-parallel.md``)."""

    def __init__(self, cfg: DeepseekV4Config, mlp_type: str, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        self.gate = Gate(cfg, mlp_type == HASH_MOE, dtype)
        self.experts = nn.ModuleList(
            Expert(cfg.hidden_size, cfg.moe_intermediate_size, dtype) for _ in range(cfg.n_routed_experts)
        )
        self.shared_experts = Expert(cfg.hidden_size, cfg.moe_intermediate_shared, dtype)
        for name in ("w13", "w13_scale", "w2", "w2_scale"):
            self.register_parameter(name, None)
        self.ep = None  # deepinfer.parallel.sharding.ExpertParallel
        self.placement = None  # deepinfer.parallel.ExpertPlacement of this layer under EP
        self.local_experts = tuple(range(cfg.n_routed_experts))  # logical id of each held slot
        self.load_recorder = None  # (deepinfer.parallel.eplb.ExpertLoadWindow, layer index) under EPLB

    def set_expert_parallel(self, ep, name: str) -> None:
        """Hold only this rank's slots of the layer ``name`` (e.g. ``layers.3.ffn``) under ``ep``
        (:class:`deepinfer.parallel.sharding.ExpertParallel`); call before the weights are loaded."""
        if self.is_fp8:
            raise ValueError("set_expert_parallel: the experts are already loaded; build a new model")
        placement = ep.placement(name)
        if placement.num_experts != self.cfg.n_routed_experts:
            raise ValueError(f"set_expert_parallel: the placement of {name!r} has {placement.num_experts} experts, "
                             f"the model {self.cfg.n_routed_experts}")
        dtype = self.shared_experts.w1.weight.dtype
        dev = self.shared_experts.w1.weight.device
        self.ep, self.placement = ep, placement
        self.local_experts = placement.local_experts(ep.rank)
        with torch.device(dev):
            self.experts = nn.ModuleList(Expert(self.cfg.hidden_size, self.cfg.moe_intermediate_size, dtype)
                                         for _ in self.local_experts)

    @property
    def is_fp8(self) -> bool:
        return self.w13 is not None

    def set_fp8_experts(self, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                        w2_scale: torch.Tensor) -> None:
        """Take over the stacked FP8 experts (layout of :func:`deepinfer_ops.fused_moe_fp8`) and drop the per-expert
        modules."""
        for name, t in (("w13", w13), ("w13_scale", w13_scale), ("w2", w2), ("w2_scale", w2_scale)):
            self._parameters[name] = nn.Parameter(t, requires_grad=False)
        self.experts = nn.ModuleList()


    def route(self, x: torch.Tensor, input_ids: torch.Tensor, rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Router: ``x [T, D]`` -> (weights ``[T, top_k]`` float32, expert ids ``[T, top_k]`` int64). Hash layers take
        ``tid2eid[input_ids]``; score-routed layers the top-k of ``score + bias`` by the tie rule. Weights are the
        chosen unbiased scores, renormalised, times ``routed_scaling_factor``."""
        cfg = self.cfg
        logits = linear_rows(x, self.gate.weight, rows).float()
        if cfg.scoring_func == "sqrtsoftplus":
            scores = pointwise(F.softplus, logits, rows).sqrt()
        elif cfg.scoring_func == "sigmoid":
            scores = pointwise(torch.sigmoid, logits, rows)
        else:
            scores = torch.softmax(logits, dim=-1)
        if self.gate.hashed:
            indices = self.gate.tid2eid[input_ids].long()
        else:
            _, indices = deepinfer_ops.topk(scores + self.gate.bias.float(), cfg.num_experts_per_tok)
        weights = scores.gather(1, indices)
        if rows:  # batch-invariant mode: the sum as explicit adds in slot order (no reduction kernel chosen by T)
            total = weights[:, 0]
            for j in range(1, weights.shape[1]):
                total = total + weights[:, j]
            total = total.unsqueeze(1)
        else:
            total = weights.sum(dim=-1, keepdim=True)
        weights = weights / (total + 1e-20) * cfg.routed_scaling_factor
        return weights, indices

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, rows: int = 0, num_tokens: int | None = None,
                row_valid: torch.Tensor | None = None) -> torch.Tensor:
        """Routed experts + shared expert for ``x [num_rows, D]``. The combine is in a fixed order in both modes.
        FP8 experts (:func:`deepinfer_ops.fused_moe_fp8`): a token's ``top_k`` slots added in slot order in
        float32, no host synchronisation. Dequantised experts: a token's expert outputs added in ascending expert id
        (one ``index_add_`` per expert present: a data-dependent loop, so this path reads the routing on the host
        and cannot be captured in a CUDA graph); ``rows > 0``: every expert GEMM runs in fixed-shape chunks.

        Args:
            num_tokens: rows past it are padding, never dispatched (batch-invariant ``dequant`` padding).
            row_valid: ``[num_rows]`` int64, graph-mode padding rows (0) are dispatched to no expert.
        """
        cfg = self.cfg
        if self.ep is not None:
            return self._forward_ep(x, input_ids, rows, num_tokens, row_valid)
        weights, indices = self.route(x, input_ids, rows)
        if num_tokens is not None and num_tokens < indices.shape[0]:
            weights, indices = weights[:num_tokens], indices[:num_tokens]
        if row_valid is not None:
            indices = torch.where(row_valid.view(-1, 1) != 0, indices, -1)
        limit = cfg.swiglu_limit
        if self.is_fp8:
            n = indices.shape[0]
            routed = deepinfer_ops.fused_moe_fp8(x[:n], indices, weights, self.w13, self.w13_scale, self.w2,
                                                 self.w2_scale, limit, out_dtype=x.dtype)
            if n < x.shape[0]:
                routed = torch.cat([routed, routed.new_zeros(x.shape[0] - n, x.shape[1])])
            return routed + self.shared_experts(x, limit, rows)
        y = torch.zeros_like(x)
        for e in torch.unique(indices[indices >= 0]).tolist():
            tok, slot = torch.where(indices == e)
            if rows:  # gather straight into a buffer of whole GEMM chunks (the expert then copies nothing)
                xe = pad_rows_buffer(x, tok.shape[0], rows)
                torch.index_select(x, 0, tok, out=xe[:tok.shape[0]])
                h = self.experts[e](xe, limit, rows)[:tok.shape[0]]
            else:
                h = self.experts[e](x[tok], limit, rows)
            h = h * weights[tok, slot, None].to(x.dtype)
            y.index_add_(0, tok, h)
        return y + self.shared_experts(x, limit, rows)

    def _forward_ep(self, x: torch.Tensor, input_ids: torch.Tensor, rows: int, num_tokens: int | None,
                    row_valid: torch.Tensor | None) -> torch.Tensor:
        """:meth:`forward` under expert parallelism (collective: every EP rank calls it, ``x`` may have 0 rows).
        The tokens are routed here, dispatched in the contiguous layout, run through the local slots, combined in
        the single-process order of the GEMM path (FP8: slot order in float32, as ``fused_moe_fp8``; dequant:
        ascending expert id, as the loop of :meth:`forward`), so a row's result equals the single-process one
        whenever the expert GEMMs are batch-invariant (path ``"fp8"``; path ``"dequant"`` with ``rows > 0``)."""
        from deepinfer.parallel.dispatch import combine, dispatch

        cfg, ep = self.cfg, self.ep
        k, limit = cfg.num_experts_per_tok, cfg.swiglu_limit
        n = x.shape[0] if num_tokens is None else min(num_tokens, x.shape[0])
        if x.shape[0]:
            weights, indices = self.route(x, input_ids, rows)
            weights, indices = weights[:n], indices[:n]
            if row_valid is not None:
                indices = torch.where(row_valid[:n].view(-1, 1) != 0, indices, -1)
        else:  # an idle rank: no tokens of its own, but its experts serve the others'
            weights = torch.zeros(0, k, dtype=torch.float32, device=x.device)
            indices = torch.zeros(0, k, dtype=torch.int64, device=x.device)
        if self.load_recorder is not None:
            window, layer = self.load_recorder
            window.record(layer, indices)
        if self.is_fp8 and ep.layout == "masked":  # decode: [S, max_m, .] per slot, masked_m valid rows
            xq, xs = deepinfer_ops.per_token_group_quant_fp8(x[:n], 128)
            d = dispatch(xq, indices, self.placement, x_scale=xs, layout="masked",
                         max_tokens_per_expert=ep.max_tokens_per_expert, group=ep.group)
            S, max_m, _ = d.x.shape
            h = deepinfer_ops.m_grouped_fp8_gemm_nt_masked(d.x, d.x_scale, self.w13, self.w13_scale, d.masked_m,
                                                           out=d.x.new_zeros(S, max_m, self.w13.shape[1],
                                                                             dtype=torch.bfloat16))
            hq, hs = deepinfer_ops.swiglu_clamp_quant_fp8(h.view(S * max_m, -1), limit)  # rows past masked_m: 0
            y = deepinfer_ops.m_grouped_fp8_gemm_nt_masked(hq.view(S, max_m, -1), hs.view(S, max_m, -1), self.w2,
                                                           self.w2_scale, d.masked_m)
            routed = combine(y, d, weights, order="slot", out_dtype=x.dtype)
        elif self.is_fp8:
            xq, xs = deepinfer_ops.per_token_group_quant_fp8(x[:n], 128)
            d = dispatch(xq, indices, self.placement, x_scale=xs, group=ep.group)
            h = deepinfer_ops.m_grouped_fp8_gemm_nt_contiguous(d.x, d.x_scale, self.w13, self.w13_scale, d.m_indices)
            hq, hs = deepinfer_ops.swiglu_clamp_quant_fp8(h, limit, column_major_scales=h.is_cuda)
            y = deepinfer_ops.m_grouped_fp8_gemm_nt_contiguous(hq, hs, self.w2, self.w2_scale, d.m_indices)
            routed = combine(y, d, weights, order="slot", out_dtype=x.dtype)
        else:
            d = dispatch(x[:n], indices, self.placement, group=ep.group)
            y = torch.empty_like(d.x)
            start = 0
            for slot, cnt in enumerate(d.tokens_per_expert):
                if not cnt:
                    continue
                xe = d.x[start:start + cnt]
                if rows:  # the fixed-shape chunks of the single-process loop
                    buf = pad_rows_buffer(xe, cnt, rows)
                    buf[:cnt].copy_(xe)
                    xe = buf
                y[start:start + cnt] = self.experts[slot](xe, limit, rows)[:cnt]
                start += cnt
            routed = combine(y, d, weights, order="expert", out_dtype=x.dtype)
        if n < x.shape[0]:
            routed = torch.cat([routed, routed.new_zeros(x.shape[0] - n, x.shape[1])])
        if x.shape[0] == 0:
            return routed
        return routed + self.shared_experts(x, limit, rows)
