"""DeepSeek-V4 (V4-Flash architecture): decoder blocks and the causal LM over a paged cache.

``DeepseekV4ForCausalLM.forward(plan, cache)`` runs one engine step (any mix of prefill chunks and decodes) from a
:class:`~.plan.StepPlan` and does device work only; ``forward(ForwardBatch, cache)`` builds the plan first (the test
and convenience form). The architecture, the GEMM paths and batch-invariant mode: ``docs/deepseek_v4.md``.
Source: transformers 5.23 ``modeling_deepseek_v4.py`` (the parity reference, read, not imported); DeepSeek-V4 paper.
"""

from __future__ import annotations

import torch
from torch import nn

import deepinfer_ops
from deepinfer.forward_batch import ForwardBatch

from .attention import Attention
from .cache import BLOCK_SIZE, DeepseekV4Cache, allocate_cache
from .config import MOE, DeepseekV4Config
from .layers import Embedding, Linear, RMSNorm, _param, hc_head, hc_post, hc_pre, resolve_gemm, rope_inv_freq
from .loading import load_native
from .moe import MoE
from .plan import PlanBuilder, StepPlan


class Block(nn.Module):
    """One decoder block: ``attn_norm``, ``attn``, ``ffn_norm``, ``ffn`` and the two mHC parameter sets."""

    def __init__(self, cfg: DeepseekV4Config, ratio: int, mlp_type: str, dtype: torch.dtype):
        super().__init__()
        D, hc = cfg.hidden_size, cfg.hc_mult
        mix = (2 + hc) * hc
        self.attn_norm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.ffn_norm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.attn = Attention(cfg, ratio, dtype)
        self.ffn = MoE(cfg, mlp_type, dtype)
        self.cfg = cfg
        for sub in ("attn", "ffn"):
            setattr(self, f"hc_{sub}_fn", _param(mix, hc * D))
            setattr(self, f"hc_{sub}_base", _param(mix))
            setattr(self, f"hc_{sub}_scale", _param(3))

    def forward(self, streams: torch.Tensor, plan: StepPlan, pools: dict[str, torch.Tensor],
                rope_table: torch.Tensor, ties: list, rows: int = 0, pad: bool = False) -> torch.Tensor:
        """One decoder block on the mHC streams ``[num_rows, hc, D]`` (device work only)."""
        cfg = self.cfg
        post, comb, collapsed = hc_pre(cfg, streams, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale)
        a = self.attn(self.attn_norm(collapsed), plan, pools, rope_table, ties, rows)
        streams = hc_post(streams, a, post, comb)
        post, comb, collapsed = hc_pre(cfg, streams, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale)
        f = self.ffn(self.ffn_norm(collapsed), plan.input_ids, rows, plan.num_tokens if pad else None,
                     plan.row_valid)
        return hc_post(streams, f, post, comb)


class MTPBlock(Block):
    def __init__(self, cfg: DeepseekV4Config, ratio: int, dtype: torch.dtype):
        super().__init__(cfg, ratio, MOE, dtype)
        D, hc = cfg.hidden_size, cfg.hc_mult
        self.e_proj = Linear(D, D, dtype)
        self.h_proj = Linear(D, D, dtype)
        self.enorm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.norm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.hc_head_fn = _param(hc, hc * D)
        self.hc_head_base = _param(hc)
        self.hc_head_scale = _param(1)




class DeepseekV4ForCausalLM(nn.Module):
    """DeepSeek-V4 with native parameter names. Parameters are zero until loaded (:meth:`from_parameters`,
    :meth:`from_checkpoint`, :meth:`load_native`).

    Args:
        config: the model config.
        dtype: parameter / activation dtype of matmul weights and norms (float32 for CPU tests, bfloat16 else); mHC
            parameters, sinks, ``ape`` and router biases stay float32 as in the checkpoints; mHC and softmax math
            run in float32.
        gemm: ``"auto"`` (default), ``"fp8"`` or ``"dequant"``: the GEMM path / weight format the weights take when
            loaded (``docs/deepseek_v4.md``, "GEMM paths"); ``"auto"`` is resolved on the device the weights are loaded to.
            ``model.gemm`` is the path in use (``"dequant"`` until an FP8 load).
        expert_parallel: a :class:`deepinfer.parallel.sharding.ExpertParallel`: every MoE layer holds only this
            rank's expert slots and meets the other EP ranks in each forward (``docs/expert-parallel.md``); an
            empty step still runs every MoE layer's collectives, so an idle DP rank never stalls the others.
    Raises:
        ValueError naming ``gemm`` for an unknown value.
    """

    # Batch-invariant mode (``ForwardBatch.batch_invariant``): rows per fixed-shape torch GEMM call (see
    # ``linear_rows``; the FP8 GEMMs of path "fp8" need none), per device type. The costs: up to rows - 1 padded GEMM
    # rows per call (about free while a call is bandwidth-bound on its weight, as decode steps are on the GPU) and one
    # launch per ``rows`` tokens. Path "fp8" on CUDA runs only the few small torch GEMMs (router, compressor / indexer
    # projections) in chunks, so they take 512 rows: an 8192-token prefill step is 16 launches per GEMM instead of 64
    # (the engine is host-bound there). Path "dequant" pads every expert's tokens too, so it keeps 128. The LM head
    # takes BI_GEMM_ROWS on either path (``_head_rows``): it only sees the step's logits rows (one per sequence), and
    # a 64-sequence decode step padded to 512 rows spent 0.7 ms in it on the H200 instead of the weight read's 0.3.
    BI_GEMM_ROWS = {"cuda": 128, "cpu": 16}
    BI_GEMM_ROWS_FP8 = {"cuda": 512}
    BI_GEMM_ROWS_DEFAULT = 128

    def __init__(self, config: DeepseekV4Config, dtype: torch.dtype = torch.float32, gemm: str = "auto",
                 expert_parallel=None):
        super().__init__()
        cfg = self.config = config
        self.dtype = dtype
        resolve_gemm(gemm, None)  # validates
        self.requested_gemm = gemm
        self.gemm = "dequant"  # the path of the weights held now; load_native sets it
        D, hc = cfg.hidden_size, cfg.hc_mult
        self.embed = Embedding(cfg.vocab_size, D, dtype)
        self.layers = nn.ModuleList(
            Block(cfg, cfg.compress_ratios[i], cfg.mlp_layer_types[i], dtype) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(D, cfg.rms_norm_eps, dtype)
        self.hc_head_fn = _param(hc, hc * D)
        self.hc_head_base = _param(hc)
        self.hc_head_scale = _param(1)
        self.head = Linear(cfg.vocab_size, D, dtype)
        self.mtp = nn.ModuleList(MTPBlock(cfg, cfg.mtp_compress_ratios[j], dtype) for j in range(cfg.num_nextn_predict_layers))
        with torch.device("cpu"):
            self._inv_freq = {k: rope_inv_freq(cfg, k) for k in ("main", "compress")}
        self._rope_tables: dict[tuple[str, torch.device], torch.Tensor] = {}
        # diagnostics of the last forward: 0-d device tensors, the indexer rows whose k-th and (k+1)-th best valid
        # scores tie (read through ``last_indexer_boundary_ties``, which synchronises)
        self._ties: list[torch.Tensor] = []
        self._plan_builders: dict[tuple, PlanBuilder] = {}
        self.expert_parallel = expert_parallel
        if expert_parallel is not None:
            for name, mod in self.named_modules():
                if isinstance(mod, MoE):
                    mod.set_expert_parallel(expert_parallel, name)

    # ---- construction helpers ---------------------------------------------------------------------------------
    @classmethod
    def from_parameters(cls, config: DeepseekV4Config, tensors: dict, dtype: torch.dtype = torch.float32,
                        gemm: str = "auto", device: torch.device | str | None = None,
                        expert_parallel=None) -> "DeepseekV4ForCausalLM":
        """Build and load ``tensors`` (native names; float tensors or ``deepinfer.quantization.QuantizedWeight``)
        strictly: every expected name, no extra. The model is built on the meta device and takes the tensors over
        (see :meth:`load_native`: cast / converted to its format where needed, on ``device`` or where they are), so
        no second copy of the weights is ever allocated."""
        with torch.device("meta"):
            model = cls(config, dtype, gemm, expert_parallel)
        model.load_native(tensors, device=device)
        return model

    @classmethod
    def from_checkpoint(cls, path=None, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                        gemm: str = "auto", expert_parallel=None) -> "DeepseekV4ForCausalLM":
        """Load a native checkpoint folder (``None`` = the built-in tiny one) with :mod:`deepinfer.checkpoint` onto
        ``device``. Path ``"dequant"``: quantised weights dequantised exactly, then cast to ``dtype``; path ``"fp8"``
        (``gemm="auto"`` on CUDA): read in their stored format and converted on ``device`` (``docs/deepseek_v4.md``).
        ``expert_parallel``: only this rank's routed experts are read (``deepinfer.parallel.sharding``).
        Raises CheckpointError naming the tensor/file."""
        from deepinfer.checkpoint import load_checkpoint

        skip = expert_parallel.skip if expert_parallel is not None else None
        if resolve_gemm(gemm, device) == "fp8":
            ckpt = load_checkpoint(path, dequantize=False, dtype=dtype, device="cpu", skip=skip)
            return cls.from_parameters(ckpt.config, ckpt.params, dtype, "fp8", device=device,
                                       expert_parallel=expert_parallel)
        ckpt = load_checkpoint(path, dtype=dtype, device=device, skip=skip)
        return cls.from_parameters(ckpt.config, ckpt.params, dtype, "dequant",
                                   expert_parallel=expert_parallel).to(device)


    def load_native(self, tensors: dict, device: torch.device | str | None = None) -> None:
        """Take over native tensors as the parameters of this freshly built model (see :func:`.loading.load_native`).
        Raises ValueError naming the tensor for missing / unexpected names and shape mismatches."""
        load_native(self, tensors, device)
    def allocate_cache(self, num_blocks: int, device: torch.device | str | None = None,
                       window_blocks: int | None = None, kv_cache_dtype: str = "auto") -> DeepseekV4Cache:
        """:func:`.cache.allocate_cache` for this model's config and dtype (``window_blocks`` default
        ``num_blocks``: one block table serves both cache groups)."""
        return allocate_cache(self.config, num_blocks, device or self.embed.weight.device, self.dtype, window_blocks,
                              kv_cache_dtype)

    # ---- rope ---------------------------------------------------------------------------------------------------
    def _rope(self, kind: str, max_pos: int, device: torch.device) -> torch.Tensor:
        key = (kind, device)
        t = self._rope_tables.get(key)
        if t is None or t.shape[0] <= max_pos:
            n = 1 << max(12, int(max_pos).bit_length())
            t = deepinfer_ops.rope_cos_sin_cache(self._inv_freq[kind].to(device), n)
            self._rope_tables[key] = t
        return t

    # ---- mHC ------------------------------------------------------------------------------------------------------
    def batch_invariant_rows(self, device: torch.device) -> int:
        """Rows per fixed-shape GEMM call in batch-invariant mode on ``device`` for the model's GEMM path."""
        kind = torch.device(device).type
        if self.gemm == "fp8" and kind in self.BI_GEMM_ROWS_FP8:
            return self.BI_GEMM_ROWS_FP8[kind]
        return self.BI_GEMM_ROWS.get(kind, self.BI_GEMM_ROWS_DEFAULT)

    def plan_builder(self, cache: DeepseekV4Cache) -> PlanBuilder:
        """The :class:`PlanBuilder` of ``cache``'s geometry (one per cache size and device, reused)."""
        key = (cache.block_size, cache.num_blocks, cache.window_blocks, cache.device)
        b = self._plan_builders.get(key)
        if b is None:
            b = self._plan_builders[key] = PlanBuilder(self.config, cache.block_size, cache.num_blocks, cache.device,
                                                       cache.window_blocks)
        return b

    def step_pad(self, batch_invariant: bool, device: torch.device | str) -> int:
        """Rows the step's token dimension is padded to a multiple of: batch-invariant mode on path ``"dequant"``
        pads to whole GEMM chunks (every GEMM then takes them without a copy); else 0."""
        return self.batch_invariant_rows(device) if batch_invariant and self.gemm != "fp8" else 0

    @property
    def last_indexer_boundary_ties(self) -> int:
        """Indexer rows of the last forward whose k-th and (k+1)-th best visible scores tie (synchronises)."""
        return sum(int(t) for t in self._ties)

    def _head_rows(self, rows: int, device: torch.device) -> int:
        """Rows per LM-head GEMM call: 0 with the mode off, else ``BI_GEMM_ROWS`` for ``device`` on either GEMM path
        (see ``BI_GEMM_ROWS_FP8``)."""
        return self.BI_GEMM_ROWS.get(torch.device(device).type, self.BI_GEMM_ROWS_DEFAULT) if rows else 0

    def _plan(self, batch, cache: DeepseekV4Cache) -> StepPlan:
        if isinstance(batch, StepPlan):
            return batch
        if not isinstance(batch, ForwardBatch):
            raise TypeError(f"forward: expected a StepPlan or a ForwardBatch, got {type(batch).__name__}")
        return self.plan_builder(cache).from_forward_batch(batch, self.step_pad(batch.batch_invariant, cache.device))

    def _rope_for(self, plan: StepPlan, device: torch.device) -> dict[str, torch.Tensor]:
        return {k: self._rope(k, plan.max_len, device) for k in ("main", "compress")}

    def _idle_moe(self, blocks, device: torch.device, batch_invariant: bool) -> None:
        """An empty step under expert parallelism: every MoE layer of ``blocks`` still joins its dispatch and
        combine with no tokens of its own (its experts serve the other ranks' tokens), so no rank waits forever.
        The experts run in the step's mode (batch-invariant chunks or not): the mode is the computing rank's, so
        every EP rank must run its steps in the same mode."""
        if self.expert_parallel is None:
            return
        rows = self.batch_invariant_rows(device) if batch_invariant else 0
        x = torch.empty(0, self.config.hidden_size, dtype=self.dtype, device=device)
        ids = torch.empty(0, dtype=torch.int64, device=device)
        for blk in blocks:
            blk.ffn(x, ids, rows)

    # ---- public forward --------------------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, batch: StepPlan | ForwardBatch, cache: DeepseekV4Cache, return_hidden: bool = False):
        """One engine step.

        Args:
            batch: the step's :class:`StepPlan` (from :meth:`plan_builder`), or a :class:`ForwardBatch` (its plan is
                built first: host validation and one copy).
            cache: from :func:`allocate_cache` for this config; mutated (the new tokens' entries are written).
            return_hidden: also return the final mHC streams ``[num_tokens, hc_mult, hidden]`` (MTP input).
        Returns:
            logits ``[num_logit_rows, vocab]`` float32 for ``plan.logits_indices`` (and the streams if asked).
        Raises:
            ValueError naming the ForwardBatch field at fault (shapes, positions, block ids), when given one.
        """
        plan = self._plan(batch, cache)
        if not plan.derived:  # graph mode: the captured forward derives the index lists
            plan.finalize(self.config)
        cfg = self.config
        dev = self.embed.weight.device
        self._ties = []
        if plan.num_tokens == 0:  # an empty step: nothing to write, no logits
            self._idle_moe(self.layers, dev, plan.batch_invariant)
            logits = torch.empty(0, cfg.vocab_size, dtype=torch.float32, device=dev)
            streams = torch.empty(0, cfg.hc_mult, cfg.hidden_size, dtype=self.dtype, device=dev)
            return (logits, streams) if return_hidden else logits
        rows = self.batch_invariant_rows(dev) if plan.batch_invariant else 0
        pad = plan.num_rows > plan.num_tokens and not plan.graph
        tables = self._rope_for(plan, dev)
        emb = self.embed(plan.input_ids)
        streams = emb.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        for i, blk in enumerate(self.layers):
            streams = blk(streams, plan, cache.layers[i], tables[blk.attn.rope_kind], self._ties, rows, pad)
        sel = streams[plan.logits_indices]
        x = self.norm(hc_head(cfg, sel, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, rows))
        logits = self.head(x, self._head_rows(rows, x.device)).float()
        return (logits, streams[:plan.num_tokens]) if return_hidden else logits

    @torch.no_grad()
    def forward_mtp(self, batch: StepPlan | ForwardBatch, cache: DeepseekV4Cache, hidden_streams: torch.Tensor,
                    mtp_idx: int = 0, return_hidden: bool = False):
        """Run MTP layer ``mtp_idx``: token at row r of the step is the NEXT token ``t+1`` of the main model's
        position ``t = positions[r]``, ``hidden_streams[r]`` the main model's final mHC streams at ``t``
        (``forward(..., return_hidden=True)``). Uses cache layer ``num_hidden_layers + mtp_idx``.
        Returns logits ``[num_logits, vocab]`` float32 (the prediction of token ``t+2``), and with ``return_hidden``
        the MTP block's output streams ``[num_tokens, hc_mult, hidden]`` (the next draft step's ``hidden_streams``).
        Source: the public V4 MTP ports (sglang ``deepseek_v4_nextn``, vLLM ``deepseek_v4_mtp``): e_proj on the
        embedding broadcast over the streams, h_proj per stream; transformers 5.23 does not implement MTP."""
        if not 0 <= mtp_idx < len(self.mtp):
            raise ValueError(f"mtp_idx: {mtp_idx} outside [0, {len(self.mtp)})")
        cfg = self.config
        T = batch.num_tokens
        if tuple(hidden_streams.shape) != (T, cfg.hc_mult, cfg.hidden_size):
            raise ValueError(f"hidden_streams: expected {(T, cfg.hc_mult, cfg.hidden_size)}, "
                             f"got {tuple(hidden_streams.shape)}")
        plan = self._plan(batch, cache)
        if not plan.derived:
            plan.finalize(cfg)
        self._ties = []
        if T == 0:
            self._idle_moe([self.mtp[mtp_idx]], hidden_streams.device, plan.batch_invariant)
            logits = torch.empty(0, cfg.vocab_size, dtype=torch.float32, device=hidden_streams.device)
            return (logits, hidden_streams[:0].to(self.dtype)) if return_hidden else logits
        blk = self.mtp[mtp_idx]
        dev = hidden_streams.device
        rows = self.batch_invariant_rows(dev) if plan.batch_invariant else 0
        pad = plan.num_rows > plan.num_tokens and not plan.graph
        hidden = hidden_streams.to(self.dtype).contiguous()
        if plan.num_rows > T:
            hidden = torch.cat([hidden, hidden.new_zeros(plan.num_rows - T, *hidden.shape[1:])])
        e = blk.e_proj(blk.enorm(self.embed(plan.input_ids)), rows)
        h = blk.h_proj(blk.hnorm(hidden), rows)
        streams = e.unsqueeze(1) + h
        tables = self._rope_for(plan, dev)
        streams = blk(streams, plan, cache.layers[cfg.num_hidden_layers + mtp_idx], tables[blk.attn.rope_kind],
                      self._ties, rows, pad)
        sel = streams[plan.logits_indices]
        x = blk.norm(hc_head(cfg, sel, blk.hc_head_fn, blk.hc_head_base, blk.hc_head_scale, rows))
        logits = self.head(x, self._head_rows(rows, x.device)).float()
        return (logits, streams[:T]) if return_hidden else logits

    @torch.no_grad()
    def forward_full(self, input_ids: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
        """Whole-sequence forward with a temporary cache: ``input_ids [S]`` or ``[B, S]`` -> logits ``[S, vocab]`` or
        ``[B, S, vocab]`` float32 (every position). Same code path as :meth:`forward` (``batch_invariant``: see
        ``ForwardBatch``)."""
        squeeze = input_ids.dim() == 1
        ids = input_ids.view(1, -1) if squeeze else input_ids
        Bsz, S = ids.shape
        if S == 0:
            raise ValueError("input_ids: empty sequence")
        nb = (S + BLOCK_SIZE - 1) // BLOCK_SIZE
        cache = self.allocate_cache(Bsz * nb, ids.device)
        batch = ForwardBatch(
            input_ids=ids.reshape(-1),
            positions=torch.arange(S, device=ids.device).repeat(Bsz),
            query_lens=[S] * Bsz,
            context_lens=[S] * Bsz,
            block_tables=torch.arange(Bsz * nb, dtype=torch.int32, device=ids.device).view(Bsz, nb),
            logits_indices=torch.arange(Bsz * S, device=ids.device),
            batch_invariant=batch_invariant,
        )
        logits = self.forward(batch, cache)
        return logits.view(S, -1) if squeeze else logits.view(Bsz, S, -1)
