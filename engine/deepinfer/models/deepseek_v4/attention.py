"""DeepSeek-V4 attention sublayer: q-LoRA, one shared K=V head, sliding window plus compressed entries.

q-LoRA (``wq_a`` -> ``q_norm`` -> ``wq_b``), unweighted per-head q RMSNorm, one shared K=V head (``wkv`` ->
``kv_norm``), interleaved RoPE on the trailing ``qk_rope_head_dim`` channels (sliding layers: ``rope_theta``;
compressed layers: ``compress_rope_theta`` with YaRN), scale ``head_dim^-0.5``, a per-head sink logit, the output's
rope slice rotated back, grouped low-rank output ``wo_a`` (``o_groups``) then ``wo_b``. Keys: the last
``sliding_window`` raw tokens plus, for CSA, the indexer's top-``index_topk`` closed entries, for HCA every closed
entry: one :func:`deepinfer_ops.sparse_mqa_prefill` call over both index lists.
Source: transformers 5.23 ``modeling_deepseek_v4.py``; DeepSeek-V4 paper.
"""

from __future__ import annotations

import torch
from torch import nn

import deepinfer_ops
from deepinfer_ops.quant import scale_buffer

from .cache import query_dtype, write_cache
from .compressor import Compressor, Indexer
from .config import CSA, HCA, SLIDING, DeepseekV4Config
from .layers import FP8_BLOCK, Linear, RMSNorm, _param, linear_rows, quant_act_fp8
from .plan import StepPlan

GROUP_QUANT_MIN_ROWS = 512  # from here on, quantise each group in place rather than transposing the bf16 input


def quant_groups_fp8(x: torch.Tensor, min_rows: int = GROUP_QUANT_MIN_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, G, K]`` -> the FP8 codes ``[G * T, K]`` in group-major row order and their column-major 1x128 scales:
    :func:`quant_act_fp8` of ``x.transpose(0, 1)`` bit for bit (a row's codes depend on that row only). Large ``T``
    (``>= min_rows``) quantises each group's strided rows straight into its slice (no transposed bf16 copy); small
    ``T`` (decode, where launches count) transposes first."""
    T, G, K = x.shape
    if T < min_rows:
        return quant_act_fp8(x.transpose(0, 1).reshape(G * T, K))
    xq = torch.empty(G * T, K, dtype=torch.float8_e4m3fn, device=x.device)
    xs = scale_buffer(G * T, -(-K // FP8_BLOCK), x.device, x.is_cuda)
    for g in range(G):
        torch.ops.deepinfer_ops.per_token_group_quant_fp8(xq[g * T:(g + 1) * T], xs[g * T:(g + 1) * T], x[:, g],
                                                          FP8_BLOCK, False)
    return xq, xs


class Attention(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, ratio: int, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        H, hd, D = cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size
        self.layer_type = cfg.layer_type_of_ratio(ratio)
        self.ratio = ratio
        self.rope_kind = "main" if self.layer_type == SLIDING else "compress"
        self.wq_a = Linear(cfg.q_lora_rank, D, dtype)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dtype)
        self.wq_b = Linear(H * hd, cfg.q_lora_rank, dtype)
        self.wkv = Linear(hd, D, dtype)
        self.kv_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype)
        self.wo_a = Linear(cfg.o_groups * cfg.o_lora_rank, H * hd // cfg.o_groups, dtype)
        self.wo_b = Linear(D, cfg.o_groups * cfg.o_lora_rank, dtype)
        self.attn_sink = _param(H)  # float32
        if self.layer_type != SLIDING:
            self.compressor = Compressor(cfg, ratio, hd, self.layer_type == CSA, dtype)
        if self.layer_type == CSA:
            self.indexer = Indexer(cfg, ratio, dtype)
        self.x_fused: torch.Tensor | None = None  # set by fuse_x_projections (load time)

    # ---- the compressor / indexer input projections as one GEMM -------------------------------------------------
    def x_linears(self) -> list[Linear]:
        """The projections of the attention input, in output order: compressor ``wkv``, ``wgate``, then for CSA the
        indexer compressor's ``wkv``, ``wgate`` and the indexer ``weights_proj``."""
        if self.layer_type == SLIDING:
            return []
        lins = [self.compressor.wkv, self.compressor.wgate]
        if self.layer_type == CSA:
            ic = self.indexer.compressor
            lins += [ic.wkv, ic.wgate, self.indexer.weights_proj]
        return lins

    def fuse_x_projections(self) -> None:
        """Concatenate the dequantised :meth:`x_linears` weights into one tensor and make every linear's weight a view
        of its rows (in-place updates reach the fused GEMM; a replaced weight needs another call). Load time only."""
        dense = [lin for lin in self.x_linears() if not lin.is_fp8]
        self.x_fused = None
        if len(dense) < 2:
            return
        fused = torch.cat([lin.weight.detach() for lin in dense])
        r = 0
        for lin in dense:
            n = lin.weight.shape[0]
            lin._parameters["weight"] = nn.Parameter(fused[r:r + n], requires_grad=False)
            r += n
        self.x_fused = fused

    def x_projections(self, x: torch.Tensor, rows: int) -> list[torch.Tensor]:
        """Outputs of :meth:`x_linears` for ``x [T, D]``: the dequantised ones from one GEMM over ``x_fused`` (the
        ``x`` reads and, in batch-invariant mode, the fixed-shape chunk launches are shared), FP8 ones on their own."""
        lins = self.x_linears()
        if self.x_fused is None:
            return [lin(x, rows) for lin in lins]
        y = linear_rows(x, self.x_fused, rows)
        outs, r = [], 0
        for lin in lins:
            if lin.is_fp8:
                outs.append(lin(x, rows))
                continue
            n = lin.weight.shape[0]
            outs.append(y[:, r:r + n])  # a column block: every consumer takes strided rows (no copy kernel)
            r += n
        return outs

    # ---- forward --------------------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, plan: StepPlan, pools: dict[str, torch.Tensor], rope_table: torch.Tensor,
                ties: list, rows: int = 0) -> torch.Tensor:
        """One attention sublayer over the step's rows ``x [num_rows, D]`` (device work only).

        Args:
            plan: the step's plan (finalised); pools: this layer's cache pools (mutated: the step's writes).
            rope_table: the cos/sin table of this layer's RoPE kind, covering ``plan.max_len``.
            ties: the indexer appends its tie counts (0-d device tensors).
            rows: > 0 in batch-invariant mode (fixed-shape GEMM chunks of ``rows`` rows).
        """
        cfg = self.cfg
        T = x.shape[0]
        H, hd = cfg.num_attention_heads, cfg.head_dim
        positions = plan.positions
        qr = self.q_norm(self.wq_a(x, rows))
        q = self.wq_b(qr, rows).view(T, H, hd)
        q = deepinfer_ops.rms_norm(q.contiguous(), None, cfg.rms_norm_eps)
        deepinfer_ops.rotary_embedding(q, positions, rope_table)
        kv = self.kv_norm(self.wkv(x, rows)).contiguous()
        deepinfer_ops.rotary_embedding(kv, positions, rope_table)
        lt = self.layer_type
        # 1. the step's cache writes: raw K=V of every token (padding rows have slot -1: skipped), then every window
        #    closing in this step (compressed entries and indexer keys)
        kv_cache = pools["kv"]  # window group: [window_blocks, B, hd] (FP8: [.., 584] uint8)
        write_cache(kv_cache, kv, plan.token_slots)
        comp_cache = comp_idx = None
        if lt != SLIDING:
            m = self.ratio
            cp = plan.comp[m]
            proj = self.x_projections(x, rows)
            self.compressor(proj[0], proj[1], cp, pools["state_kv"], pools["state_gate"], pools["comp"], rope_table)
            n_ent = plan.n_ent[m]
            if lt == CSA:
                idx = self.indexer
                idx.compressor(proj[2], proj[3], cp, pools["idx_state_kv"], pools["idx_state_gate"], pools["idx"],
                               rope_table)
            if n_ent > 0:
                comp_cache = pools["comp"]  # [num_blocks, B // m, hd]: a paged cache with block_size B // m
                if lt == HCA:
                    comp_idx = plan.derived["hca_idx"]
                else:  # CSA: lightning-indexer scores over the paged indexer keys, then the top-k
                    iq = idx.wq_b(qr, rows).view(T, idx.n_heads, idx.head_dim).contiguous()
                    deepinfer_ops.rotary_embedding(iq, positions, rope_table)
                    iw = proj[4].float() * (idx.n_heads ** -0.5)
                    ikeys = pools["idx"]
                    ent = idx.select(iq.to(query_dtype(ikeys)), iw, ikeys, n_ent, plan.derived["tok_bt32"],
                                     plan.derived[f"n_vis{m}"], ties)
                    per_block = comp_cache.shape[1]
                    ec = ent.clamp(max=n_ent - 1)
                    blk = plan.tok_bt.gather(1, ec // per_block)
                    comp_idx = torch.where((ent < n_ent) & (blk >= 0), blk * per_block + ec % per_block,
                                           -1).to(torch.int32)
        # 2. sparse MQA over the window and the entries (K = V, one shared head), the per-head sink in the denominator
        out, _ = deepinfer_ops.sparse_mqa_prefill(
            q.to(query_dtype(kv_cache)).contiguous(), kv_cache, plan.derived["win_idx"], hd ** -0.5,
            extra_kv_cache=comp_cache, extra_indices=comp_idx, attn_sink=self.attn_sink.float().contiguous())
        out = out.to(x.dtype)
        deepinfer_ops.rotary_embedding(out, positions, rope_table, inverse=True)
        return self.output(out, rows)

    def output(self, out: torch.Tensor, rows: int) -> torch.Tensor:
        """The grouped low-rank output projection of the attention result ``out [T, H, hd]``."""
        cfg = self.cfg
        T = out.shape[0]
        G, olr = cfg.o_groups, cfg.o_lora_rank
        if self.wo_a.is_fp8:  # the G groups as one masked grouped FP8 GEMM, every group all T rows (batch-invariant
            #                   by construction, any mode; bfloat16 out, which wo_b re-quantises to FP8 anyway)
            xq, xs = quant_groups_fp8(out.view(T, G, -1))
            w, ws = self.wo_a.fp8_groups(G)
            # written straight into wo_b's [T, G * olr] input (group g at columns g * olr): no transposing copy
            o = torch.empty(T, G, olr, dtype=torch.bfloat16, device=out.device)
            deepinfer_ops.m_grouped_fp8_gemm_nt_masked(xq.view(G, T, -1), xs.view(G, T, -1), w, ws,
                                                       torch.full((G,), T, dtype=torch.int32, device=out.device),
                                                       out=o.transpose(0, 1))
            return self.wo_b(o.view(T, G * olr).to(out.dtype), rows)
        wa = self.wo_a.weight.view(G, olr, -1)
        if rows:  # one fixed-shape GEMM chain per group (the einsum below is a bmm whose kernel depends on T)
            per_group = out.view(T, G, -1).transpose(0, 1).contiguous()
            o = torch.stack([linear_rows(per_group[g], wa[g], rows) for g in range(G)], dim=1)
            return self.wo_b(o.reshape(T, G * olr), rows)
        o = torch.einsum("tgi,goi->tgo", out.view(T, G, -1), wa).reshape(T, G * olr)
        return self.wo_b(o)
