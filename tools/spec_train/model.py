"""A trainable DeepSeek-V4 with its MTP layer: transformers' ``DeepseekV4ForCausalLM`` for the main model and
:class:`MTPLayer` (transformers' own V4 blocks) for ``mtp.0``, mapped exactly to and from the native checkpoint
names our engine loads.

The MTP math is the engine's ``DeepseekV4ForCausalLM.forward_mtp``: at position ``t`` the MTP block's input streams
are ``e_proj(enorm(embed(x[t+1])))`` (broadcast over the hc streams) ``+ h_proj(hnorm(S[t]))``, ``S`` the main
model's final mHC streams (before ``hc_head``); the block's output streams go through the MTP layer's own
``hc_head`` and ``norm`` and the shared LM head, predicting ``x[t+2]``. Draft step ``j > 1`` (the engine's chain on
its own outputs) takes the previous step's output streams one position earlier as ``S``.
Design: ``docs/train-spec-model.md``.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

IGNORE = -100
#: the native names of an MTP layer that are not a decoder block's, and this module's names for them
MTP_OWN = {"e_proj.weight": "e_proj.weight", "h_proj.weight": "h_proj.weight", "enorm.weight": "enorm.weight",
           "hnorm.weight": "hnorm.weight", "norm.weight": "norm.weight", "hc_head_fn": "hc_head.hc_fn",
           "hc_head_base": "hc_head.hc_base", "hc_head_scale": "hc_head.hc_scale"}
_EXPERT = re.compile(r"\.experts\.(\d+)\.w([123])\.weight$")

#: default model shape: sized so that one H200 trains it in about six minutes (docs/train-spec-model.md). The
#: layer pattern is V4-Flash's (sliding, sliding, then CSA and HCA in turn; the first 3 hash-routed), the MTP layer
#: a sliding-window block; ``index_topk`` 512 makes the CSA layers see every compressed entry up to 2048 tokens.
#: 16 layers: the MTP layer's cost against the target's sets what speculation can win at batch 1
#: (docs/speculative.md, "On the H200").
DEFAULT_SHAPE = {
    "hidden_size": 512, "num_hidden_layers": 16, "num_attention_heads": 8, "head_dim": 128, "qk_rope_head_dim": 64,
    "q_lora_rank": 256, "o_groups": 4, "o_lora_rank": 128, "n_routed_experts": 16, "num_experts_per_tok": 2,
    "moe_intermediate_size": 512, "index_n_heads": 8, "index_head_dim": 64, "index_topk": 512,
}
#: ``--tiny``: the built-in tiny preset's shape (hidden 64, sliding / CSA / HCA / CSA, 8 experts), with an
#: ``index_topk`` that keeps every compressed entry of a 256-token context
TINY_SHAPE = {"index_topk": 64}


def model_config(tiny: bool = False, **overrides) -> dict:
    """The native ``config.json`` dict of the model to train: the V4-Flash layer pattern at
    :data:`DEFAULT_SHAPE` (``tiny``: the ``tiny`` preset at :data:`TINY_SHAPE`), then ``overrides`` (config keys;
    ``num_hidden_layers`` / ``n_routed_experts`` re-derive the layer pattern). Vocabulary: the V4 tokenizer's.
    Raises ValueError (from the engine's config parser) naming the key for a shape the engine cannot run."""
    from deepinfer.checkpoint import parse_config
    from deepinfer.presets import preset_config

    shape = dict(TINY_SHAPE if tiny else DEFAULT_SHAPE)
    shape.update({k: v for k, v in overrides.items() if v is not None})
    layers, experts = shape.pop("num_hidden_layers", None), shape.pop("n_routed_experts", None)
    cfg = preset_config("tiny" if tiny else "v4-flash-shapes", num_layers=layers, num_experts=experts)
    cfg.update(shape)
    if int(cfg.get("num_nextn_predict_layers", 0)) != 1:
        raise ValueError("num_nextn_predict_layers: the trainer builds exactly one MTP layer")
    parse_config(cfg, "model_config")
    return cfg


def dense_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers experts implementation ``"dense"``: every expert on every token, summed with the routing
    weights scattered to ``[tokens, experts]`` (zero for experts not chosen). The same function as ``"eager"``
    with ``num_experts / top_k`` times the expert FLOPs, but no data-dependent shapes, so no host sync (the eager
    loop synchronises several times per expert and layer). ``hidden_states [N, D]``, ``top_k_index`` /
    ``top_k_weights [N, k]`` -> ``[N, D]``."""
    E = self.gate_up_proj.shape[0]
    w = top_k_weights.new_zeros(top_k_index.shape[0], E).scatter_add(1, top_k_index, top_k_weights)
    act = self._apply_gate(torch.einsum("nd,efd->enf", hidden_states, self.gate_up_proj))  # [E, N, I]
    y = torch.einsum("eni,edi->end", act, self.down_proj)  # [E, N, D]
    return torch.einsum("end,ne->nd", y, w.to(y.dtype)).to(hidden_states.dtype)


def _register_dense_experts() -> None:
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register("dense", dense_experts_forward)


def hf_config(cfg: dict, experts_implementation: str = "dense"):
    """transformers' ``DeepseekV4Config`` for the native config dict ``cfg`` (eager attention; experts
    ``"dense"`` (:func:`dense_experts_forward`), ``"eager"`` or another transformers implementation)."""
    import transformers

    _register_dense_experts()
    c = transformers.DeepseekV4Config.from_dict(cfg)
    c._attn_implementation = "eager"
    c._experts_implementation = experts_implementation
    return c


def _mtp_ratio(cfg: dict) -> int:
    ratios = list(cfg.get("compress_ratios", []))
    n = int(cfg["num_hidden_layers"])
    return int(ratios[n]) if len(ratios) > n else 0


class MTPLayer(nn.Module):
    """``mtp.0``: ``e_proj`` / ``h_proj`` ``[D, D]``, ``enorm`` / ``hnorm`` / ``norm`` RMSNorms, ``block`` (a
    transformers V4 decoder block: score-routed MoE, the MTP layer's attention kind) and ``hc_head``."""

    def __init__(self, cfg: dict, experts_implementation: str = "dense"):
        super().__init__()
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as M

        one = dict(cfg, num_hidden_layers=1, compress_ratios=[_mtp_ratio(cfg)], num_hash_layers=0)
        c = hf_config(one, experts_implementation)
        D = c.hidden_size
        self.e_proj = nn.Linear(D, D, bias=False)
        self.h_proj = nn.Linear(D, D, bias=False)
        self.enorm = M.DeepseekV4RMSNorm(D, eps=c.rms_norm_eps)
        self.hnorm = M.DeepseekV4RMSNorm(D, eps=c.rms_norm_eps)
        self.norm = M.DeepseekV4RMSNorm(D, eps=c.rms_norm_eps)
        self.block = M.DeepseekV4DecoderLayer(c, 0)
        self.hc_head = M.DeepseekV4HyperHead(c)

    def forward(self, streams: torch.Tensor, next_emb: torch.Tensor, next_ids: torch.Tensor, layer_kwargs: dict,
                depth: int) -> list[torch.Tensor]:
        """``depth`` chained draft steps over whole sequences.

        Args:
            streams: ``[B, S, hc, D]`` the main model's final mHC streams at each position ``t``.
            next_emb: ``[B, S, D]`` the shared embedding of token ``t+1``; ``next_ids`` ``[B, S]`` those tokens.
            layer_kwargs: the main model's per-layer keyword arguments (rope tables, mask, positions).
        Returns: per step, the normed hidden ``[B, S, D]`` whose LM-head logits predict token ``t+2``. Step ``j > 0``
            takes step ``j-1``'s output streams at ``t-1`` (its input streams at position 0).
        """
        kw = {k: v for k, v in layer_kwargs.items() if k not in ("input_ids", "hidden_states")}
        e = self.e_proj(self.enorm(next_emb)).unsqueeze(2)
        outs = []
        for j in range(depth):
            if j:
                streams = torch.cat([streams[:, :1], out[:, :-1]], dim=1)
            out = self.block(e + self.h_proj(self.hnorm(streams)), input_ids=next_ids, **kw)
            outs.append(self.norm(self.hc_head(out)))
        return outs


class SpecModel(nn.Module):
    """transformers' ``DeepseekV4ForCausalLM`` (``lm``) plus :class:`MTPLayer` (``mtp``), sharing embedding and LM
    head. Initialised with transformers' own init and seeded hash-routing tables ``tid2eid`` (``seed``)."""

    def __init__(self, cfg: dict, seed: int = 0, experts_implementation: str = "dense"):
        super().__init__()
        import transformers

        self.cfg = cfg
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.lm = transformers.DeepseekV4ForCausalLM(hf_config(cfg, experts_implementation))
            self.mtp = MTPLayer(cfg, experts_implementation)
            with torch.no_grad():
                for m in self.mtp.modules():
                    self.lm._init_weights(m)
        g = torch.Generator().manual_seed(seed + 1)
        E = int(cfg["n_routed_experts"])
        for name, buf in self.named_buffers():
            if name.endswith("gate.tid2eid"):
                buf.copy_(torch.rand(buf.shape[0], E, generator=g).argsort(dim=-1)[:, : buf.shape[1]])
        self._captured: dict = {}
        self.lm.model.layers[0].register_forward_pre_hook(self._keep_layer_kwargs, with_kwargs=True)
        self.lm.model.hc_head.register_forward_hook(self._keep_streams)

    def _keep_layer_kwargs(self, module, args, kwargs):
        self._captured["kwargs"] = kwargs

    def _keep_streams(self, module, args, output):
        self._captured["streams"] = args[0]

    @property
    def head_weight(self) -> torch.Tensor:
        return self.lm.lm_head.weight

    def forward(self, ids: torch.Tensor, next_ids: torch.Tensor, mtp_depth: int):
        """``ids`` / ``next_ids`` ``[B, S]`` int64 (``next_ids[:, t]`` the token after ``ids[:, t]``) ->
        ``(main hidden [B, S, D], [MTP step hidden [B, S, D]] * mtp_depth)``; logits are ``hidden @ head_weight.T``."""
        out = self.lm.model(input_ids=ids, use_cache=False)
        streams, kwargs = self._captured.pop("streams"), self._captured.pop("kwargs")
        emb = self.lm.model.embed_tokens(next_ids)
        mtp = self.mtp(streams, emb, next_ids, kwargs, mtp_depth) if mtp_depth else []
        return out.last_hidden_state, mtp


# ---- losses and metrics -------------------------------------------------------------------------------------------


def _ce_sum(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(h, w).float(), y, ignore_index=IGNORE, reduction="sum")


def chunked_ce(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """Token-mean cross entropy of ``h [N, D] @ w.T`` against ``y [N]`` (``IGNORE`` skipped), a 0-d float32
    tensor (no host sync). Each chunk of rows is checkpointed, so at most one ``[chunk, vocab]`` logits block is
    alive at a time."""
    total = h.new_zeros((), dtype=torch.float32)
    for i in range(0, h.shape[0], chunk):
        hi, yi = h[i:i + chunk], y[i:i + chunk]
        total = total + (checkpoint(_ce_sum, hi, w, yi, use_reentrant=False) if torch.is_grad_enabled()
                         else _ce_sum(hi, w, yi))
    return total / (y != IGNORE).sum().clamp_min(1)


def targets(rows: torch.Tensor, mtp_depth: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """From rows ``[B, S + 1]``: ``(ids, next_ids, main targets, [MTP step targets])``, each ``[B, S]``. Step ``j``
    (0-based) at position ``t`` predicts ``rows[t + 2]``; positions ``t < j`` (no chain start) and ``t = S - 1``
    (no token ``t + 2``) are ``IGNORE``."""
    ids, nxt = rows[:, :-1], rows[:, 1:]
    two = torch.full_like(ids, IGNORE)
    two[:, :-1] = rows[:, 2:]
    steps = []
    for j in range(mtp_depth):
        t = two.clone()
        t[:, :j] = IGNORE
        steps.append(t)
    return ids, nxt, nxt, steps


def train_loss(model: SpecModel, rows: torch.Tensor, mtp_depth: int, mtp_weight: float) -> tuple[torch.Tensor, dict]:
    """``LM loss + mtp_weight * mean over steps of the MTP loss`` (token-mean cross entropies) for one batch of rows
    ``[B, S + 1]``; also returns the parts (``lm``, ``mtp1`` ...) as detached 0-d tensors (no host sync)."""
    ids, nxt, y, ys = targets(rows, mtp_depth)
    h, hs = model(ids, nxt, mtp_depth)
    w = model.head_weight
    lm = chunked_ce(h.flatten(0, 1), w, y.flatten())
    mtp = [chunked_ce(hj.flatten(0, 1), w, yj.flatten()) for hj, yj in zip(hs, ys)]
    loss = lm + mtp_weight * torch.stack(mtp).mean() if mtp else lm
    parts = {"lm": lm.detach(), **{f"mtp{j + 1}": m.detach() for j, m in enumerate(mtp)}}
    return loss, parts


@torch.no_grad()
def _logit_stats(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor, chunk: int = 4096):
    """(summed CE, argmax ``[N]``) of ``h [N, D] @ w.T`` against ``y``, chunked."""
    loss, arg = 0.0, []
    for i in range(0, h.shape[0], chunk):
        lg = F.linear(h[i:i + chunk].to(w.dtype), w).float()  # h is bf16 under CUDA autocast, w float32
        loss += float(F.cross_entropy(lg, y[i:i + chunk], ignore_index=IGNORE, reduction="sum"))
        arg.append(lg.argmax(-1))
    return loss, torch.cat(arg)


@torch.no_grad()
def evaluate(model: SpecModel, rows: torch.Tensor, mtp_depth: int, batch_size: int, device, autocast) -> dict:
    """Held-out metrics over ``rows [N, S + 1]``: LM loss / top-1 accuracy; per MTP step ``j`` its loss, top-1
    accuracy against token ``t+2`` (``mtp_acc``) and agreement with the main model's argmax at ``t+1``
    (``mtp_agree``: draft ``j`` accepted under greedy verification, given the text so far); and the teacher-forced
    acceptance proxy over chains of all ``mtp_depth`` drafts: ``accept_len`` = 1 + the mean number of leading
    drafts that agree, ``accept_rate[j]`` = P(draft j agrees | drafts before it agreed)."""
    was = model.training
    model.eval()
    w = model.head_weight
    tot = {"lm": 0.0, "lm_correct": 0, "lm_n": 0}
    per = [{"loss": 0.0, "n": 0, "acc": 0, "agree": 0} for _ in range(mtp_depth)]
    chain = torch.zeros(mtp_depth + 1, dtype=torch.float64)
    for i in range(0, rows.shape[0], batch_size):
        r = rows[i:i + batch_size].to(device)
        ids, nxt, y, ys = targets(r, mtp_depth)
        with autocast():
            h, hs = model(ids, nxt, mtp_depth)
        B, S = ids.shape
        loss, arg = _logit_stats(h.flatten(0, 1), w, y.flatten())
        arg = arg.view(B, S)
        tot["lm"] += loss
        tot["lm_correct"] += int((arg == y).sum())
        tot["lm_n"] += y.numel()
        agrees = []
        for j, (hj, yj) in enumerate(zip(hs, ys)):
            lj, aj = _logit_stats(hj.flatten(0, 1), w, yj.flatten())
            aj = aj.view(B, S)
            valid = yj != IGNORE
            per[j]["loss"] += lj
            per[j]["n"] += int(valid.sum())
            per[j]["acc"] += int(((aj == yj) & valid).sum())
            ag = torch.zeros_like(valid)
            ag[:, :-1] = aj[:, :-1] == arg[:, 1:]
            per[j]["agree"] += int((ag & valid).sum())
            agrees.append(ag)
        if mtp_depth:
            T = S - mtp_depth  # chain starts t = 0 .. T-1: draft j+1 sits at t + j, checked against arg[t + j + 1]
            ok = torch.stack([agrees[j][:, j:j + T] for j in range(mtp_depth)]).cumprod(0)  # [J, B, T]
            chain[0] += B * T
            chain[1:] += ok.sum(dim=(1, 2)).double().cpu()
    model.train(was)
    out = {"lm_loss": tot["lm"] / tot["lm_n"], "lm_acc": tot["lm_correct"] / tot["lm_n"], "tokens": tot["lm_n"],
           "mtp_loss": [p["loss"] / p["n"] for p in per], "mtp_acc": [p["acc"] / p["n"] for p in per],
           "mtp_agree": [p["agree"] / p["n"] for p in per]}
    if mtp_depth:
        out["accept_len"] = float(1 + chain[1:].sum() / chain[0])
        out["accept_rate"] = [float(chain[j + 1] / chain[j]) if chain[j] else 0.0 for j in range(mtp_depth)]
    return out


# ---- native names ---------------------------------------------------------------------------------------------------


def _renamer(lm):
    """``native name -> (HF name, expert converter pattern or None)`` by transformers' own load-time mapping for
    ``deepseek_v4`` (renamings, then the expert merge), without the base-model prefix."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange, WeightConverter, WeightRenaming, rename_source_key

    conv = get_model_conversion_mapping(lm, add_legacy=False)
    ren = [c for c in conv if isinstance(c, WeightRenaming) and not isinstance(c, PrefixChange)]
    cvt = [c for c in conv if isinstance(c, WeightConverter)]
    return lambda name: rename_source_key(name, ren, cvt)


def native_key_map(model: SpecModel) -> dict[str, tuple[str, tuple[int, int] | None]]:
    """Every native tensor name of the model's checkpoint -> ``(SpecModel state-dict key, expert slice)``; the slice
    ``(e, part)`` says the native tensor is expert ``e``'s ``w1`` (part 0: rows ``[:I]`` of ``gate_up_proj[e]``),
    ``w3`` (part 1: rows ``[I:]``) or ``w2`` (part 2: ``down_proj[e]``).
    Raises ValueError when the mapping does not cover the model's state dict exactly (both ways)."""
    from deepinfer.checkpoint import parse_config
    from deepinfer.models.deepseek_v4.params import expected_parameters

    rename = _renamer(model.lm)
    out = {}
    for name in expected_parameters(parse_config(model.cfg, "model.cfg")):
        if name.startswith("mtp."):
            rest = name.split(".", 2)[2]
            if rest in MTP_OWN:
                out[name] = ("mtp." + MTP_OWN[rest], None)
                continue
            hf = "mtp.block." + rename(name)[0].split(".", 2)[2]
        else:
            r = rename(name)[0]
            hf = "lm." + (r if r.startswith("lm_head") else "model." + r)
        m = _EXPERT.search(name)
        part = None
        if m:
            e, k = int(m.group(1)), int(m.group(2))
            part = (e, {1: 0, 3: 1, 2: 2}[k])
        out[name] = (hf, part)
    sd = model.state_dict()
    used = {k for k, _ in out.values()}
    if used != set(sd):
        raise ValueError(f"native_key_map: state-dict keys without a native name {sorted(set(sd) - used)[:5]}, "
                         f"mapped names missing from the model {sorted(used - set(sd))[:5]}")
    return out


def _slice(t: torch.Tensor, part: tuple[int, int] | None) -> torch.Tensor:
    if part is None:
        return t
    e, k = part
    if k == 2:
        return t[e]
    half = t.shape[1] // 2
    return t[e, :half] if k == 0 else t[e, half:]


def to_native(model: SpecModel) -> dict[str, torch.Tensor]:
    """The model's weights under native names: float32 CPU copies (``tid2eid`` int64), shapes checked against the
    engine's inventory (ValueError naming the tensor)."""
    from deepinfer.checkpoint import parse_config
    from deepinfer.models.deepseek_v4.params import expected_parameters

    spec = expected_parameters(parse_config(model.cfg, "model.cfg"))
    sd = model.state_dict()
    out = {}
    for name, (key, part) in native_key_map(model).items():
        t = _slice(sd[key].detach(), part).to("cpu", copy=True)
        t = t if not t.is_floating_point() else t.float()
        if tuple(t.shape) != tuple(spec[name][0]):
            raise ValueError(f"to_native: {name!r} ({key}) has shape {list(t.shape)}, expected {list(spec[name][0])}")
        out[name] = t.contiguous()
    return out


@torch.no_grad()
def load_native(model: SpecModel, native: dict) -> None:
    """Copy native-named tensors (every name of the inventory, no other) into the model in place.
    Raises ValueError naming missing / unexpected names or a shape mismatch."""
    kmap = native_key_map(model)
    missing, extra = set(kmap) - set(native), set(native) - set(kmap)
    if missing or extra:
        raise ValueError(f"load_native: missing {sorted(missing)[:5]}, unexpected {sorted(extra)[:5]}")
    sd = model.state_dict()
    for name, (key, part) in kmap.items():
        dst = _slice(sd[key], part)
        src = native[name]
        if tuple(src.shape) != tuple(dst.shape):
            raise ValueError(f"load_native: {name!r} has shape {list(src.shape)}, expected {list(dst.shape)}")
        dst.copy_(src.to(dst.dtype))


# ---- auxiliary-loss-free load balancing ----------------------------------------------------------------------------


class ExpertBalancer:
    """DeepSeek-V3's auxiliary-loss-free balancing for the score-routed MoE layers: after each optimizer step every
    router's selection bias (``e_score_correction_bias``, the checkpoint's ``ffn.gate.bias``) moves by ``rate``
    towards under-loaded experts: ``bias += rate * sign(mean load - load)``. Loads are counted in training
    forwards only."""

    def __init__(self, model: SpecModel, rate: float):
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4TopKRouter

        self.rate = rate
        self.routers = [m for m in model.modules() if isinstance(m, DeepseekV4TopKRouter)]
        self.loads = [None] * len(self.routers)
        for i, r in enumerate(self.routers):
            r.register_forward_hook(lambda mod, args, out, i=i: self._count(i, mod, out))

    def _count(self, i, mod, out) -> None:
        if mod.training:
            idx = out[2].flatten()
            c = torch.zeros(mod.num_experts, device=idx.device).index_add_(0, idx, torch.ones(idx.shape, device=idx.device))
            self.loads[i] = c if self.loads[i] is None else self.loads[i] + c

    @torch.no_grad()
    def step(self) -> torch.Tensor | None:
        """Apply the update. Returns the worst max-load / mean-load ratio seen since the last step (1.0 = even) as
        a 0-d tensor (no host sync), or None when no score-routed layer ran."""
        worst = None
        for i, r in enumerate(self.routers):
            c = self.loads[i]
            if c is None:
                continue
            r.e_score_correction_bias.add_(self.rate * torch.sign(c.mean() - c))
            ratio = c.max() / c.mean().clamp_min(1e-9)
            worst = ratio if worst is None else torch.maximum(worst, ratio)
            self.loads[i] = None
        return worst
