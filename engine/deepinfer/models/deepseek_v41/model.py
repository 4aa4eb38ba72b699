"""DeepSeek-V4.1 forward: backbone (prefill chunks and decode steps) and the DSpark draft head, CPU or GPU.

``DeepseekV41ForCausalLM(cfg, weights, token_map)`` holds the loaded weights (:mod:`.loading`). Two ways to run it:

* one sequence: ``new_state()`` makes its dense cache (:class:`SeqState`), ``forward(ids, state)`` runs its next
  chunk and returns the logits; ``dspark(state, token, main_hidden)`` drafts;
* the engine contract (``docs/engine.md``): ``allocate_cache`` (paged pools in two cache groups, :mod:`.cache`),
  ``plan_builder(cache)`` (:mod:`.plan`), ``forward(plan, cache)`` for a step of many sequences, ``step_pad``.

Both run the same backbone code (the cache is behind one interface), on the CPU or a GPU (every entry point runs
under ``torch.device(model.device)``, so the tensors it makes land there). Design: ``docs/deepseek_v41.md``.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .cache import BLOCK_SIZE, PagedSeqView, allocate_cache
from .config import DeepseekV41Config
from .engram import EngramHasher
from .layers import (BF16, gather_rows, linear_f32, hc_collapse, hc_expand, hc_mixes, linear, rms_norm, rope_, rope_table, route,
                     select_candidate_blocks, sparse_attention, swiglu_expert, topk_stable, window_positions)
from .quant import fp4_qdq_, fp8_qdq_


@dataclass
class SeqState:
    """One sequence's decoding state (the whole history; a sliding-window layer reads only its last window).

    ``kv[L]`` bf16 ``[max_len, head_dim]`` window K=V after RoPE and the FP8 round trip; ``comp[L]`` bf16
    ``[max_len // r, head_dim]`` compressed KV of a KV source (RoPE'd, FP4 round trip); ``idx_k[L]`` its index keys
    ``[max_len // r, index_head_dim]``; ``carry[L]`` a ratio-2 source's open group (float32 kv and gate rows);
    ``engram`` the compressed ids so far; ``dspark_kv[j]`` DSpark stage j's window ring ``[window, head_dim]``.
    """

    pos: int
    max_len: int = 0
    kv: dict = field(default_factory=dict)
    comp: dict = field(default_factory=dict)
    idx_k: dict = field(default_factory=dict)
    carry: dict = field(default_factory=dict)
    engram: torch.Tensor | None = None
    dspark_kv: dict = field(default_factory=dict)
    dspark_seeded: bool = False

    # ---- the backbone's cache interface (``cache.PagedSeqView`` has the same methods over the paged pools) ----
    def write_kv(self, L: int, start: int, rows: torch.Tensor) -> None:
        self.kv[L][start:start + rows.shape[0]] = rows

    def window(self, L: int, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return gather_rows(self.kv[L], idx)

    def write_comp(self, L: int, first: int, rows: torch.Tensor) -> None:
        self.comp[L][first:first + rows.shape[0]] = rows

    def comp_rows(self, src: int, sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return gather_rows(self.comp[src], sel)

    def write_idx(self, L: int, first: int, rows: torch.Tensor) -> None:
        self.idx_k[L][first:first + rows.shape[0]] = rows

    def idx_keys(self, src: int, n: int) -> torch.Tensor:
        return self.idx_k[src][:n]

    def carry_rows(self, L: int, start: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.carry[L]

    def put_carry(self, L: int, end: int, kv: torch.Tensor, gate: torch.Tensor) -> None:
        self.carry[L] = (kv.clone(), gate.clone())

    def engram_history(self, start: int, ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        self.engram[start:start + ids.numel()] = ids
        return self.engram[:start + ids.numel()], 0


def _on_model_device(fn):
    """Run a model method under :meth:`DeepseekV41ForCausalLM._here`."""
    @functools.wraps(fn)
    def run(self, *args, **kwargs):
        with self._here():
            return fn(self, *args, **kwargs)
    return run


@dataclass
class _Seg:
    """One sequence's rows in a step: ``n`` tokens from position ``start``, its cache (a :class:`SeqState` or a
    ``cache.PagedSeqView``) and the step's per-sequence shared selections (top-k, candidate blocks)."""

    start: int
    n: int
    cache: object
    shared: dict = field(default_factory=dict)


class DeepseekV41ForCausalLM:
    """The V4.1 model over a loaded state dict (``weights``: name -> tensor or :class:`QWeight`).

    Engine attributes: ``config`` (= ``cfg``), ``dtype`` (bfloat16: the activations between ops),
    ``gemm`` (``"exact"``: the block-scaled GEMMs of ``quant.py``, the CPU default; ``"dequant"``: bf16 weights
    dequantised at load, bf16 GEMMs, the GPU default; no CUDA graphs either way), ``device``,
    ``config_block_size`` (the cache block size the engine must use), ``batch_invariant_devices`` (where
    batch-invariant mode holds: the CPU, whose ops compute a row alike whatever the row count).
    """

    dtype = torch.bfloat16
    gemm = "exact"
    config_block_size = BLOCK_SIZE
    batch_invariant_devices = ("cpu",)

    def __init__(self, cfg: DeepseekV41Config, weights: dict, token_map: torch.Tensor | None = None,
                 device: torch.device | str = "cpu", gemm: str = "exact"):
        """``weights`` as :func:`.loading.load_weights` returns them for ``device`` (already there) and ``gemm``."""
        self.cfg = cfg
        self.w = weights
        self.device = torch.device(device)
        self.gemm = gemm
        self._plan_builders: dict = {}
        c = cfg
        self.rot0 = rope_table(c.rope_head_dim, c.max_seq_len, 0, c.rope_theta, c.rope_factor, c.beta_fast,
                               c.beta_slow).to(self.device)
        self.rotc = rope_table(c.rope_head_dim, c.max_seq_len, c.original_seq_len, c.compress_rope_theta,
                               c.rope_factor, c.beta_fast, c.beta_slow).to(self.device)
        self.hasher = None
        if c.engram_layer_ids:
            if token_map is None:
                raise ValueError("engram: the config has engram layers but no token map was given (build it from "
                                 "the tokenizer with engram.compressed_token_map)")
            self.hasher = EngramHasher(c, token_map).to(self.device)

    def _here(self):
        """The context every entry point runs in: tensors made without a device go to the model's."""
        return contextlib.nullcontext() if self.device.type == "cpu" else self.device

    # ---- state ----------------------------------------------------------------------------------------------
    @_on_model_device
    def new_state(self, max_len: int | None = None) -> SeqState:
        c = self.cfg
        n = max_len or c.max_seq_len
        if n > c.max_seq_len:
            raise ValueError(f"max_len {n} exceeds max_seq_len {c.max_seq_len}")
        st = SeqState(pos=0, max_len=n)
        for L in range(c.n_layers):
            st.kv[L] = torch.zeros(n, c.head_dim, dtype=BF16)
            if L in c.kv_source_layers:
                r = c.ratio(L)
                st.comp[L] = torch.zeros(n // r, c.head_dim, dtype=BF16)
                if L in c.index_source_layers:
                    st.idx_k[L] = torch.zeros(n // r, c.index_head_dim, dtype=BF16)
                if r > 1:
                    st.carry[L] = (torch.zeros(0, c.head_dim), torch.zeros(0, c.head_dim))
        st.engram = torch.zeros(n, dtype=torch.int64)
        for j in range(c.num_dspark_layers):
            st.dspark_kv[j] = torch.zeros(c.window_size, c.head_dim, dtype=BF16)
        return st

    # ---- the engine contract -----------------------------------------------------------------------------------
    @property
    def config(self) -> DeepseekV41Config:
        return self.cfg

    @classmethod
    def from_checkpoint(cls, path, device: torch.device | str = "cpu", gemm: str = "auto") -> "DeepseekV41ForCausalLM":
        """Load a native V4.1 checkpoint folder (:func:`.loading.load_model`) on ``device``.

        ``gemm``: ``"exact"`` (the 32x32 block-scaled GEMMs, the reference's numerics; the CPU default),
        ``"dequant"`` (bf16 weights dequantised at load, bf16 GEMMs; the CUDA default) or ``"auto"``.

        Raises:
            ValueError: ``device`` is neither the CPU nor CUDA; ``gemm`` is none of those (``"fp8"``: no FP8 GEMM
                with 32x32 scales yet); the weights do not fit the GPU's free memory.
            CheckpointError naming the tensor and file for a bad checkpoint.
        """
        from .loading import load_model

        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(f"device: {device!r} is not a torch device") from None
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"device: DeepSeek-V4.1 runs on the CPU or CUDA, got {str(device)!r}")
        if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
            raise ValueError(f"device: {str(device)!r} names no visible CUDA device ({torch.cuda.device_count()} "
                             "visible)")
        if gemm not in ("auto", "exact", "dequant"):
            raise ValueError(f"gemm: DeepSeek-V4.1 takes 'auto', 'exact' or 'dequant' (no FP8 GEMM with 32x32 "
                             f"scales yet), got {gemm!r}")
        return load_model(path, dev, gemm)

    def eval(self) -> "DeepseekV41ForCausalLM":
        return self

    def allocate_cache(self, num_blocks: int, window_blocks: int | None = None, kv_cache_dtype: str = "auto"):
        """:func:`.cache.allocate_cache` (blocks of :data:`.cache.BLOCK_SIZE` positions)."""
        return allocate_cache(self.cfg, num_blocks, window_blocks, BLOCK_SIZE, kv_cache_dtype, self.device)

    def plan_builder(self, cache):
        """The :class:`.plan.PlanBuilder` of ``cache``'s geometry (one per cache size, reused)."""
        from .plan import PlanBuilder

        key = (cache.block_size, cache.num_blocks, cache.window_blocks)
        b = self._plan_builders.get(key)
        if b is None:
            b = self._plan_builders[key] = PlanBuilder(self.cfg, cache.block_size, cache.num_blocks, self.device,
                                                       cache.window_blocks)
        return b

    def step_pad(self, batch_invariant: bool, device) -> int:
        """0: no padded rows (every op computes a row the same way whatever the step's row count)."""
        return 0

    @_on_model_device
    def forward_step(self, plan, cache) -> torch.Tensor:
        """One engine step over the paged ``cache`` (mutated: the new tokens' entries are written).

        ``plan``: a :class:`.plan.StepPlan` (or a ``ForwardBatch``, planned first). Returns float32
        ``[num_logits, vocab]`` for ``plan.logits_indices``. Raises ValueError naming the field of a bad
        ``ForwardBatch``.
        """
        from deepinfer.forward_batch import ForwardBatch

        if isinstance(plan, ForwardBatch):
            plan = self.plan_builder(cache).from_forward_batch(plan)
        if plan.num_tokens == 0:
            return torch.empty(0, self.cfg.vocab_size, dtype=torch.float32)
        segs = [_Seg(sp.start, sp.n, PagedSeqView(self.cfg, cache, sp.full_row, sp.window_row, sp.start,
                                                  sp.start + sp.n, sp.shared_len, sp.floor))
                for sp in plan.seqs]
        x, _ = self._backbone(plan.input_ids.to(self.device), segs)
        return linear_f32(x[plan.logits_indices].float(), self.w["head.weight"])

    # ---- backbone ---------------------------------------------------------------------------------------------
    def forward(self, input_ids, state, all_logits: bool = True):
        """One sequence (``state`` a :class:`SeqState`): :meth:`forward_seq`. An engine step (``input_ids`` a
        ``plan.StepPlan`` or a ``ForwardBatch``, ``state`` the paged cache): :meth:`forward_step`."""
        if isinstance(state, SeqState):
            return self.forward_seq(input_ids, state, all_logits)
        return self.forward_step(input_ids, state)

    @_on_model_device
    def forward_seq(self, input_ids: torch.Tensor, state: SeqState, all_logits: bool = True):
        """Run ``input_ids [S]`` at positions ``state.pos ..`` and advance the state.

        Returns (logits float32 ``[S, vocab]`` (or ``[1, vocab]`` for the last position when not ``all_logits``),
        main_hidden bf16 ``[S, taps * dim]`` (DSpark input; None without DSpark taps)).
        """
        c = self.cfg
        ids = torch.as_tensor(input_ids, dtype=torch.int64).reshape(-1).to(self.device)
        s_len = ids.numel()
        start, end = state.pos, state.pos + s_len
        if s_len == 0:
            raise ValueError("input_ids: empty chunk")
        if end > state.max_len:
            raise ValueError(f"input_ids: positions up to {end} exceed the state's max_len {state.max_len}")
        if int(ids.min()) < 0 or int(ids.max()) >= c.vocab_size:
            raise ValueError(f"input_ids: ids must lie in [0, {c.vocab_size})")
        x, taps = self._backbone(ids, [_Seg(start, s_len, state)])
        if not all_logits:
            x = x[-1:]
        logits = linear_f32(x.float(), self.w["head.weight"])
        state.pos = end
        return logits, taps

    def _backbone(self, ids: torch.Tensor, segs: list[_Seg]):
        """The backbone over the step's rows (``segs`` in row order; token-wise ops run on all rows at once, the
        attention per sequence). Returns (final-norm output bf16 ``[T, dim]``, main_hidden or None)."""
        c = self.cfg
        hashes = None
        if self.hasher is not None:
            parts, o = [], 0
            for sg in segs:
                hist, base = sg.cache.engram_history(sg.start, self.hasher.compress(ids[o:o + sg.n]))
                parts.append(self.hasher(hist, sg.start, base))
                o += sg.n
            hashes = parts[0] if len(parts) == 1 else torch.cat(parts)
        h = F.embedding(ids, self.w["embed.weight"]).unsqueeze(1).repeat(1, c.hc_mult, 1)
        pre = torch.zeros(ids.numel(), c.hc_mult)
        pre[:, 0] = 1.0
        taps = []
        for L in range(c.n_layers):
            if L in c.engram_layer_ids:
                h = self._engram(L, h, hashes[:, c.engram_layer_ids.index(L)])
            if L in c.dspark_target_layer_ids:
                taps.append(h.mean(dim=1))
            h, pre = self._block(f"layers.{L}.", L, h, pre, segs)
        x = rms_norm(hc_collapse(h, pre), self.w["norm.weight"], c.norm_eps)
        return x, (torch.cat(taps, -1) if taps else None)

    def forward_full(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits at every position of one prefill of ``input_ids`` (a fresh state)."""
        ids = torch.as_tensor(input_ids).reshape(-1)
        return self.forward(ids, self.new_state(max(ids.numel(), 1)))[0]

    def _engram(self, L: int, h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        c, p = self.cfg, f"layers.{L}.engram."
        table, tscale = self.w[p + "embed.weight"], self.w[p + "embed.scale"]
        vals = table[rows].float().unflatten(-1, (-1, 32)) * tscale[rows].unsqueeze(-1)
        kv = linear(vals.flatten(-2).to(BF16).flatten(-2), self.w[p + "wkv.weight"])
        key, value = kv.split([c.hc_mult * c.dim, c.dim], dim=-1)
        key = key.float().unflatten(-1, (c.hc_mult, c.dim))
        wgt = self.w[p + "q_weight"].float() * self.w[p + "k_weight"].float()
        hf, eps = h.float(), c.norm_eps
        rstd = torch.rsqrt(hf.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
        dot = (hf * wgt * key).sum(-1) * rstd * c.dim ** -0.5
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
        return (hf + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(h.dtype)

    def _block(self, p: str, L: int, h, pre, segs: list[_Seg], main_x=None):
        c, w = self.cfg, self.w
        res = h
        a_pre, a_post, a_comb = hc_mixes(h, w[p + "hc_attn_fn"], w[p + "hc_attn_scale"], w[p + "hc_attn_base"],
                                         c.hc_mult, c.hc_sinkhorn_iters, c.norm_eps, c.hc_eps)
        x = rms_norm(hc_collapse(h, pre), w[p + "attn_norm.weight"], c.norm_eps)
        if main_x is None:
            outs, o = [], 0
            for sg in segs:
                outs.append(self._attention(p + "attn.", L, x[o:o + sg.n], sg.start, sg.cache, sg.shared))
                o += sg.n
            x = outs[0] if len(outs) == 1 else torch.cat(outs)
        else:
            x = self._dspark_attention(p + "attn.", L - c.n_layers, x, segs[0].start, segs[0].cache, main_x)
        h = hc_expand(x, res, a_post, a_comb)
        res = h
        f_pre, f_post, f_comb = hc_mixes(h, w[p + "hc_ffn_fn"], w[p + "hc_ffn_scale"], w[p + "hc_ffn_base"],
                                         c.hc_mult, c.hc_sinkhorn_iters, c.norm_eps, c.hc_eps)
        x = rms_norm(hc_collapse(h, a_pre), w[p + "ffn_norm.weight"], c.norm_eps)
        x = self._moe(p + "ffn.", L, x)
        return hc_expand(x, res, f_post, f_comb), f_pre

    # ---- attention ------------------------------------------------------------------------------------------
    def _q(self, p: str, x: torch.Tensor, rot: torch.Tensor):
        c, w = self.cfg, self.w
        qr = rms_norm(linear(x, w[p + "wq_a.weight"]), w[p + "q_norm.weight"], c.norm_eps)
        q = linear(qr, w[p + "wq_b.weight"]).unflatten(-1, (c.n_heads, c.head_dim))
        rope_(q[..., -c.rope_head_dim:], rot)
        return qr, q

    def _kv(self, p: str, x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        c, w = self.cfg, self.w
        kv = rms_norm(linear(x, w[p + "wkv.weight"]), w[p + "kv_norm.weight"], c.norm_eps)
        rope_(kv[..., -c.rope_head_dim:], rot)
        return fp8_qdq_(kv)

    def _out(self, p: str, o: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        c, w = self.cfg, self.w
        rope_(o[..., -c.rope_head_dim:], rot, inverse=True)
        o = o.reshape(o.shape[0], c.o_groups, -1)
        wo_a = w[p + "wo_a.weight"].view(c.o_groups, c.o_lora_rank, -1)
        if o.device.type == "cpu":  # float64 sums: rows independent of the row count (layers.exact_linear)
            o = torch.einsum("sgd,grd->sgr", o.double(), wo_a.double()).float().to(o.dtype)
        else:
            o = torch.einsum("bsgd,grd->bsgr", o.unsqueeze(0), wo_a)[0]
        return linear(o.flatten(1), w[p + "wo_b.weight"])

    def _attention(self, p: str, L: int, x, start: int, state, shared: dict):
        c = self.cfg
        s_len, end = x.shape[0], start + x.shape[0]
        r = c.ratio(L)
        rot_t = (self.rotc if r else self.rot0)
        rot = rot_t[start:end]
        qr, q = self._q(p, x, rot)
        state.write_kv(L, start, self._kv(p, x, rot))
        kv_rows, valid = state.window(L, window_positions(start, end, c.window_size))
        if r:
            src = c.kv_source_of(L)
            latent, first = (self._compress(p + "compressor.", L, x, start, state) if src == L else (None, 0))
            n_comp = end // r
            if L in c.index_source_layers:
                if n_comp == 0:
                    sel = torch.zeros(s_len, 0, dtype=torch.int64)
                else:
                    sel = self._indexer(p + "indexer.", L, x, qr, latent, first, start, state, shared)
                shared[("topk", L)] = sel
            sel = shared[("topk", c.index_source_of(L))]
            if latent is not None:
                rope_(latent[..., -c.rope_head_dim:], rot_t[first * r:(first + latent.shape[0]) * r:r])
                state.write_comp(L, first, fp4_qdq_(latent, 16, True))
            c_rows, c_valid = state.comp_rows(src, sel)
            kv_rows, valid = torch.cat([kv_rows, c_rows], 1), torch.cat([valid, c_valid], 1)
        o = sparse_attention(q, kv_rows, valid, self.w[p + "attn_sink"], c.head_dim ** -0.5)
        return self._out(p, o, rot)

    def _compress(self, p: str, L: int, x, start: int, state):
        """A KV source's new latents (pre-RoPE, bf16 ``[G, head_dim]``) and the index of the first, or (None, 0)."""
        c, w = self.cfg, self.w
        r = c.ratio(L)
        if r == 1:
            return rms_norm(linear(x, w[p + "wkv.weight"]), w[p + "norm.weight"], c.norm_eps), start
        xf = x.float()
        kv, sc = linear_f32(xf, w[p + "wkv.weight"]), linear_f32(xf, w[p + "wgate.weight"])
        ck, cs = state.carry_rows(L, start, r)
        kv, sc = torch.cat([ck, kv]), torch.cat([cs, sc])
        first = (start - ck.shape[0]) // r
        g = kv.shape[0] // r
        state.put_carry(L, start + x.shape[0], kv[g * r:], sc[g * r:])
        if g == 0:
            return None, 0
        kv = kv[:g * r].unflatten(0, (g, r))
        sc = sc[:g * r].unflatten(0, (g, r))
        pooled = (kv * sc.softmax(dim=1)).sum(dim=1)
        return rms_norm(pooled.to(BF16), w[p + "norm.weight"], c.norm_eps), first

    def _indexer(self, p: str, L: int, x, qr, latent, first: int, start: int, state, shared: dict):
        """Compressed positions each query attends to: int64 ``[S, min(index_topk, end // r)]``, ascending, -1 =
        unreachable. Publishes (or applies) the candidate-block mask."""
        c, w = self.cfg, self.w
        r = c.ratio(L)
        s_len, end = x.shape[0], start + x.shape[0]
        rot_t = self.rotc
        if latent is not None and L in c.kv_source_layers:
            k = rms_norm(linear(latent, w[p + "wk.weight"]), w[p + "k_norm.weight"], c.norm_eps)
            rope_(k[..., -c.rope_head_dim:], rot_t[first * r:(first + k.shape[0]) * r:r])
            state.write_idx(L, first, fp4_qdq_(k, 32, False))
        q = linear(qr, w[p + "wq_b.weight"]).unflatten(-1, (c.index_n_heads, c.index_head_dim))
        rope_(q[..., -c.rope_head_dim:], rot_t[start:end])
        fp4_qdq_(q, 32, False)
        n_comp = end // r
        keys = state.idx_keys(c.kv_source_of(L), n_comp)
        wts = linear(x, w[p + "weights_proj.weight"]) * (c.index_head_dim ** -0.5 * c.index_n_heads ** -0.5)
        score = torch.einsum("bshd,btd->bsht", q.unsqueeze(0), keys.unsqueeze(0))[0]
        score = (score.relu_() * wts.unsqueeze(-1)).sum(dim=1)
        lens = (torch.arange(start + 1, end + 1) // r).unsqueeze(-1)
        score = score.masked_fill(torch.arange(n_comp) >= lens, -torch.inf)
        if L == c.candidate_source_layer:
            shared["candidates"] = select_candidate_blocks(score, lens, c.candidate_topk_blocks,
                                                           c.candidate_block_size)
        elif c.uses_candidates(L):
            score = score.masked_fill(~shared["candidates"], -torch.inf)
        idx = topk_stable(score, min(c.index_topk, n_comp))[1].sort(dim=-1).values
        return torch.where(idx < lens, idx, -1)

    # ---- MoE ------------------------------------------------------------------------------------------------
    def _moe(self, p: str, L: int, x: torch.Tensor) -> torch.Tensor:
        c, w = self.cfg, self.w
        n_exp, k = c.moe_experts(L)
        wts, ids = route(x, w[p + "gate.weight"], w[p + "gate.bias"], k, c.score_func, c.gate_temp,
                         c.norm_topk_prob, c.route_scale)
        y = torch.zeros(x.shape, dtype=torch.float32)
        for e in range(n_exp):
            rows, slot = torch.where(ids == e)
            if rows.numel() == 0:
                continue
            q = f"{p}experts.{e}."
            y[rows] += swiglu_expert(x[rows], w[q + "w1.weight"], w[q + "w2.weight"], w[q + "w3.weight"],
                                     c.swiglu_limit, wts[rows, slot, None])
        q = p + "shared_experts."
        y += swiglu_expert(x, w[q + "w1.weight"], w[q + "w2.weight"], w[q + "w3.weight"], c.swiglu_limit)
        return y.to(x.dtype)

    # ---- DSpark ---------------------------------------------------------------------------------------------
    def _dspark_attention(self, p: str, j: int, x, start: int, state: SeqState, main_x):
        """Draft-block attention of stage j: queries at positions start+1 .. start+B see the stage's window ring
        (main-model KV, slots in slot order) and every block position (no causal mask inside the block)."""
        c = self.cfg
        win = c.window_size
        b = x.shape[0]
        state.dspark_kv[j][start % win] = self._kv(p, main_x, self.rot0[start:start + 1])[0]
        rot = self.rot0[start + 1:start + 1 + b]
        _, q = self._q(p, x, rot)
        kv = self._kv(p, x, rot)
        n_win = min(win, start + 1)
        keys = torch.cat([state.dspark_kv[j][:n_win], kv]).unsqueeze(0).expand(b, -1, -1)
        valid = torch.ones(b, n_win + b, dtype=torch.bool)
        o = sparse_attention(q, keys, valid, self.w[p + "attn_sink"], c.head_dim ** -0.5)
        return self._out(p, o, rot)

    @_on_model_device
    def dspark_seed(self, state: SeqState, main_hidden: torch.Tensor) -> None:
        """The DSpark call at position 0 after a prefill: fills every stage's window ring from the prompt's
        ``main_hidden [S, taps * dim]`` (positions 0..S-1)."""
        c, w = self.cfg, self.w
        mx = rms_norm(linear(main_hidden, w["mtp.0.main_proj.weight"]), w["mtp.0.main_norm.weight"], c.norm_eps)
        s_len, win = mx.shape[0], c.window_size
        for j in range(c.num_dspark_layers):
            kv = self._kv(f"mtp.{j}.attn.", mx, self.rot0[:s_len])
            slots = torch.arange(max(0, s_len - win), s_len)
            state.dspark_kv[j][slots % win] = kv[slots]
        state.dspark_seeded = True

    @_on_model_device
    def dspark(self, state: SeqState, token: int, main_hidden: torch.Tensor):
        """Draft after a decode step at position ``start = state.pos - 1``.

        ``token`` the greedy next token, ``main_hidden [1, taps * dim]`` that step's DSpark input. Returns
        (ids int64 ``[B + 1]``: token then B drafts, logits float32 ``[B, vocab]`` (Markov bias included),
        confidence float32 ``[B]``, a raw score).
        """
        c, w = self.cfg, self.w
        if not c.num_dspark_layers:
            raise ValueError("dspark: this model has no DSpark head (dspark_block_size 0)")
        if not state.dspark_seeded:
            raise ValueError("dspark: seed the window with dspark_seed(state, main_hidden) after the prefill")
        start, b = state.pos - 1, c.dspark_block_size
        if start + 1 + b > c.max_seq_len:
            raise ValueError(f"dspark: draft positions up to {start + b} exceed max_seq_len {c.max_seq_len}")
        mx = rms_norm(linear(main_hidden, w["mtp.0.main_proj.weight"]), w["mtp.0.main_norm.weight"], c.norm_eps)
        ids = torch.full((b,), c.dspark_noise_token_id, dtype=torch.int64)
        ids[0] = token
        h = F.embedding(ids, w["embed.weight"]).unsqueeze(1).repeat(1, c.hc_mult, 1)
        pre = torch.zeros(b, c.hc_mult)
        pre[:, 0] = 1.0
        for j in range(c.num_dspark_layers):
            h, pre = self._block(f"mtp.{j}.", c.n_layers + j, h, pre, [_Seg(start, b, state)], main_x=mx)
        last = f"mtp.{c.num_dspark_layers - 1}."
        x = hc_collapse(h, pre)
        logits = linear_f32(rms_norm(x, w[last + "norm.weight"], c.norm_eps).float(), w["head.weight"])
        out = torch.empty(b + 1, dtype=torch.int64)
        out[0] = token
        embeds = []
        for i in range(b):
            e = F.embedding(out[i:i + 1], w[last + "markov_head.embed.weight"])
            logits[i] += F.linear(e.float(), w[last + "markov_head.head.weight"])[0]
            embeds.append(e[0])
            out[i + 1] = logits[i].argmax()
        conf = F.linear(torch.cat([x, torch.stack(embeds)], -1).float(), w[last + "confidence_head.proj.weight"])
        return out, logits, conf.squeeze(-1)
