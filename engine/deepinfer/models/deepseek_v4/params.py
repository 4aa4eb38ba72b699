"""DeepSeek-V4 parameter inventory in the NATIVE DeepSeek checkpoint names, and a deterministic random init.

Interface for the checkpoint code (loader / writer):

* ``expected_parameters(config) -> dict[name, (shape, kind)]``: every tensor of a native checkpoint (main model and
  MTP layers), in a fixed order. ``kind`` is one of

  - ``"dense_linear"``: 2-D ``[out, in]`` weight eligible for FP8 e4m3 with 128x128 block scales (``name`` ends in
    ``.weight``; a quantised checkpoint adds ``<prefix>.scale``);
  - ``"expert_linear"``: routed-expert ``[out, in]`` weight eligible for FP4 e2m1 (packed int8 ``[out, in/2]``) with
    UE8M0 per-32 scales, or FP8;
  - ``"fp32"``: stored float32 in real checkpoints (mHC ``hc_*`` params, ``attn_sink``, compressor ``ape``,
    ``ffn.gate.bias``);
  - ``"other"``: stored bf16 (norm weights, embeddings, LM head, router gate weight, the compressor/indexer BF16
    projections that real V4-Flash checkpoints never quantise) or int (``ffn.gate.tid2eid``, int64 ``[vocab, top_k]``).

* ``init_parameters(config, seed) -> dict[name, tensor]`` float32 (tid2eid int64), deterministic for a seed, with
  scales that keep activations O(1) through the depth. Nothing the reference leaves at zero stays zero: sinks,
  compressor ``ape``, HC ``base``, router ``bias`` are random; ``tid2eid`` rows hold ``top_k`` distinct valid experts.

Native names (DeepSeek's own checkpoint layout): ``embed.weight``, ``head.weight``, ``norm.weight``,
``hc_head_{fn,base,scale}``, ``layers.N.{attn_norm,ffn_norm}.weight``, ``layers.N.hc_{attn,ffn}_{fn,base,scale}``,
``layers.N.attn.{wq_a,q_norm,wq_b,wkv,kv_norm,wo_a,wo_b}.weight``, ``layers.N.attn.attn_sink``,
``layers.N.attn.compressor.{wkv,wgate,norm}.weight`` + ``.ape`` (CSA/HCA layers),
``layers.N.attn.indexer.{wq_b,weights_proj}.weight`` + ``layers.N.attn.indexer.compressor.*`` (CSA layers),
``layers.N.ffn.gate.weight`` + ``.bias`` (score routed) or ``.tid2eid`` (hash routed),
``layers.N.ffn.shared_experts.w{1,2,3}.weight``, ``layers.N.ffn.experts.E.w{1,2,3}.weight`` (w1 gate, w2 down, w3 up),
``mtp.J.{e_proj,h_proj}.weight``, ``mtp.J.{enorm,hnorm,norm}.weight``, ``mtp.J.hc_head_{fn,base,scale}`` and the MTP
block's own ``mtp.J.attn.* / ffn.* / attn_norm / ffn_norm / hc_*`` (its MoE is score routed).

Source: DeepSeek-V4 technical report and checkpoint layout; transformers 5.23 ``conversion_mapping.py`` (deepseek_v4
renames).
"""

from __future__ import annotations

import math

import torch

from .config import CSA, HASH_MOE, HCA, SLIDING, DeepseekV4Config

KINDS = ("dense_linear", "expert_linear", "fp32", "other")

Shape = tuple[int, ...]


def _block_params(cfg: DeepseekV4Config, prefix: str, ratio: int, mlp_type: str) -> dict[str, tuple[Shape, str]]:
    """One decoder block (``prefix`` = ``layers.N.`` or ``mtp.J.``)."""
    D, H, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    hc = cfg.hc_mult
    mix = (2 + hc) * hc
    p: dict[str, tuple[Shape, str]] = {}
    p[prefix + "attn_norm.weight"] = ((D,), "other")
    p[prefix + "ffn_norm.weight"] = ((D,), "other")
    for sub in ("attn", "ffn"):
        p[f"{prefix}hc_{sub}_fn"] = ((mix, hc * D), "fp32")
        p[f"{prefix}hc_{sub}_base"] = ((mix,), "fp32")
        p[f"{prefix}hc_{sub}_scale"] = ((3,), "fp32")
    a = prefix + "attn."
    p[a + "wq_a.weight"] = ((cfg.q_lora_rank, D), "dense_linear")
    p[a + "q_norm.weight"] = ((cfg.q_lora_rank,), "other")
    p[a + "wq_b.weight"] = ((H * hd, cfg.q_lora_rank), "dense_linear")
    p[a + "wkv.weight"] = ((hd, D), "dense_linear")
    p[a + "kv_norm.weight"] = ((hd,), "other")
    p[a + "wo_a.weight"] = ((cfg.o_groups * cfg.o_lora_rank, H * hd // cfg.o_groups), "dense_linear")
    p[a + "wo_b.weight"] = ((D, cfg.o_groups * cfg.o_lora_rank), "dense_linear")
    p[a + "attn_sink"] = ((H,), "fp32")
    lt = cfg.layer_type_of_ratio(ratio)
    if lt != SLIDING:
        coff = 2 if lt == CSA else 1  # CSA: overlapped windows, two series (Ca | Cb) per token
        c = a + "compressor."
        p[c + "wkv.weight"] = ((coff * hd, D), "other")
        p[c + "wgate.weight"] = ((coff * hd, D), "other")
        p[c + "ape"] = ((ratio, coff * hd), "fp32")
        p[c + "norm.weight"] = ((hd,), "other")
    if lt == CSA:
        ih, ihd = cfg.index_n_heads, cfg.index_head_dim
        i = a + "indexer."
        p[i + "wq_b.weight"] = ((ih * ihd, cfg.q_lora_rank), "dense_linear")
        p[i + "weights_proj.weight"] = ((ih, D), "other")
        p[i + "compressor.wkv.weight"] = ((2 * ihd, D), "other")
        p[i + "compressor.wgate.weight"] = ((2 * ihd, D), "other")
        p[i + "compressor.ape"] = ((ratio, 2 * ihd), "fp32")
        p[i + "compressor.norm.weight"] = ((ihd,), "other")
    f = prefix + "ffn."
    E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
    p[f + "gate.weight"] = ((E, D), "other")
    if mlp_type == HASH_MOE:
        p[f + "gate.tid2eid"] = ((cfg.vocab_size, cfg.num_experts_per_tok), "other")
    else:
        p[f + "gate.bias"] = ((E,), "fp32")
    for e in range(E):
        p[f"{f}experts.{e}.w1.weight"] = ((I, D), "expert_linear")
        p[f"{f}experts.{e}.w2.weight"] = ((D, I), "expert_linear")
        p[f"{f}experts.{e}.w3.weight"] = ((I, D), "expert_linear")
    Is = cfg.moe_intermediate_shared
    p[f + "shared_experts.w1.weight"] = ((Is, D), "dense_linear")
    p[f + "shared_experts.w2.weight"] = ((D, Is), "dense_linear")
    p[f + "shared_experts.w3.weight"] = ((Is, D), "dense_linear")
    return p


def expected_parameters(config: DeepseekV4Config) -> dict[str, tuple[Shape, str]]:
    """Every tensor of a native DeepSeek-V4 checkpoint for ``config``: ``{name: (shape, kind)}`` in a fixed order
    (embedding, layers 0..L-1, final norm / hc_head / head, then MTP layers). See the module docstring for kinds."""
    cfg = config
    D, hc = cfg.hidden_size, cfg.hc_mult
    p: dict[str, tuple[Shape, str]] = {"embed.weight": ((cfg.vocab_size, D), "other")}
    for n in range(cfg.num_hidden_layers):
        p.update(_block_params(cfg, f"layers.{n}.", cfg.compress_ratios[n], cfg.mlp_layer_types[n]))
    p["norm.weight"] = ((D,), "other")
    p["hc_head_fn"] = ((hc, hc * D), "fp32")
    p["hc_head_base"] = ((hc,), "fp32")
    p["hc_head_scale"] = ((1,), "fp32")
    p["head.weight"] = ((cfg.vocab_size, D), "other")
    for j in range(cfg.num_nextn_predict_layers):
        m = f"mtp.{j}."
        p[m + "e_proj.weight"] = ((D, D), "dense_linear")
        p[m + "h_proj.weight"] = ((D, D), "dense_linear")
        p[m + "enorm.weight"] = ((D,), "other")
        p[m + "hnorm.weight"] = ((D,), "other")
        p.update(_block_params(cfg, m, cfg.mtp_compress_ratios[j], "moe"))
        p[m + "norm.weight"] = ((D,), "other")
        p[m + "hc_head_fn"] = ((hc, hc * D), "fp32")
        p[m + "hc_head_base"] = ((hc,), "fp32")
        p[m + "hc_head_scale"] = ((1,), "fp32")
    return p


def init_parameters(config: DeepseekV4Config, seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic random parameters for :func:`expected_parameters` (float32 on CPU; ``tid2eid`` int64).

    Scales: linear ``[out, in]`` weights ~ N(0, 1/in) (variance preserving; output projections wo_b / w2 x0.5),
    embedding ~ N(0, 1), norm weights 1 + N(0, 0.1), mHC fn ~ N(0, 1/in) so the mixing logits are O(1), mHC base
    ~ N(0, 0.5), mHC scale ~ U(0.5, 1), sinks ~ N(0, 1), compressor ape ~ N(0, 0.5), router bias ~ N(0, 0.1),
    tid2eid rows = ``top_k`` distinct experts drawn uniformly. Each tensor is drawn from its own generator seeded by
    (seed, name), so adding tensors never changes the others.
    """
    out: dict[str, torch.Tensor] = {}
    for name, (shape, kind) in expected_parameters(config).items():
        g = torch.Generator().manual_seed(_name_seed(seed, name))
        leaf = name.rsplit(".", 1)[-1] if not name.endswith(".weight") else name[: -len(".weight")].rsplit(".", 1)[-1]
        if name.endswith("tid2eid"):
            r = torch.rand(shape[0], config.n_routed_experts, generator=g)
            t = r.argsort(dim=-1)[:, : shape[1]].to(torch.int64)
        elif name == "embed.weight":
            t = torch.randn(shape, generator=g)
        elif len(shape) == 1 and (leaf.endswith("norm")):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif "hc_" in name and name.endswith("_fn"):
            t = torch.randn(shape, generator=g) / math.sqrt(shape[1])
        elif "hc_" in name and name.endswith("_base"):
            t = 0.5 * torch.randn(shape, generator=g)
        elif "hc_" in name and name.endswith("_scale"):
            t = 0.5 + 0.5 * torch.rand(shape, generator=g)
        elif name.endswith("attn_sink"):
            t = torch.randn(shape, generator=g)
        elif name.endswith(".ape"):
            t = 0.5 * torch.randn(shape, generator=g)
        elif name.endswith("gate.bias"):
            t = 0.1 * torch.randn(shape, generator=g)
        elif len(shape) == 2:
            t = torch.randn(shape, generator=g) / math.sqrt(shape[1])
            if leaf in ("wo_b", "w2"):
                t *= 0.5
        else:
            raise AssertionError(f"init_parameters: no rule for {name}")
        out[name] = t.contiguous()
    return out


def _name_seed(seed: int, name: str) -> int:
    h = 1469598103934665603
    for b in f"{seed}:{name}".encode():
        h = ((h ^ b) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return h & 0x7FFFFFFFFFFFFFFF
