"""DeepSeek-V4 (V4-Flash architecture) model configuration, read from a checkpoint's ``config.json``.

Accepts both spellings found in the wild:

* the legacy keys real DeepSeek checkpoints ship: ``compress_ratios`` (one int per layer, 0 = sliding window,
  4 = CSA, 128 = HCA; an optional trailing entry per MTP layer), ``num_hash_layers``, ``qk_rope_head_dim`` and a flat
  ``rope_scaling`` dict (YaRN for the compressed layers);
* transformers 5.23 names: ``layer_types`` / ``mlp_layer_types`` / ``partial_rotary_factor`` / ``rope_parameters``
  (flat or nested ``{"main": ..., "compress": ...}``) / ``compress_rates``.

Unknown keys (``architectures``, ``quantization_config``, ``torch_dtype``, ...) are ignored. A missing required key or
an invalid value raises ``ValueError`` naming the key.

Source: transformers 5.23 ``configuration_deepseek_v4.py`` (key names, defaults, legacy folding).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
HASH_MOE = "hash_moe"
MOE = "moe"

_DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")


@dataclass(frozen=True)
class DeepseekV4Config:
    """Resolved DeepSeek-V4 hyper-parameters (all dims in elements).

    ``compress_ratios[i]`` is layer i's compression ratio (0 sliding, ``compress_rates[CSA]`` CSA,
    ``compress_rates[HCA]`` HCA); ``mtp_compress_ratios[j]`` the same for MTP layer j (0 unless the config says).
    ``rope_scaling`` is None or a YaRN dict ``{factor, original_max_position_embeddings, beta_fast, beta_slow}``
    applied to the compressed layers' rope (theta ``compress_rope_theta``); sliding layers use plain rope with
    ``rope_theta``.
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    compress_ratios: tuple[int, ...]
    mlp_layer_types: tuple[str, ...]
    mtp_compress_ratios: tuple[int, ...] = ()
    compress_rate_csa: int = 4
    compress_rate_hca: int = 128
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1.0e-6
    rms_norm_eps: float = 1.0e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 1048576
    num_nextn_predict_layers: int = 1
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- derived -------------------------------------------------------------------------------------------------
    @property
    def layer_types(self) -> tuple[str, ...]:
        return tuple(self.layer_type_of_ratio(r) for r in self.compress_ratios)

    def layer_type_of_ratio(self, ratio: int) -> str:
        if ratio == 0:
            return SLIDING
        if ratio == self.compress_rate_csa:
            return CSA
        if ratio == self.compress_rate_hca:
            return HCA
        raise ValueError(f"compress_ratios: ratio {ratio} is neither 0, {self.compress_rate_csa} nor {self.compress_rate_hca}")

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.qk_rope_head_dim

    @property
    def num_mtp_layers(self) -> int:
        return self.num_nextn_predict_layers

    @property
    def moe_intermediate_shared(self) -> int:
        return self.n_shared_experts * self.moe_intermediate_size

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("extra")
        return d

    def to_config_json(self) -> dict:
        """A ``config.json`` dict in the legacy format real checkpoints ship; transformers 5.23 accepts it."""
        d = {
            "architectures": ["DeepseekV4ForCausalLM"],
            "model_type": "deepseek_v4",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": 1,
            "head_dim": self.head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "q_lora_rank": self.q_lora_rank,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "compress_ratios": list(self.compress_ratios) + list(self.mtp_compress_ratios),
            "num_hash_layers": sum(t == HASH_MOE for t in self.mlp_layer_types),
            "scoring_func": self.scoring_func,
            "norm_topk_prob": True,
            "routed_scaling_factor": self.routed_scaling_factor,
            "swiglu_limit": self.swiglu_limit,
            "sliding_window": self.sliding_window,
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "hc_eps": self.hc_eps,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "compress_rope_theta": self.compress_rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
        }
        if self.rope_scaling is not None:
            d["rope_scaling"] = {"type": "yarn", **self.rope_scaling}
        return d

    # ---- construction ---------------------------------------------------------------------------------------------
    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> "DeepseekV4Config":
        """Read ``path`` (a ``config.json`` or a checkpoint folder holding one). Raises ValueError on bad content."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        try:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
        except FileNotFoundError as e:
            raise ValueError(f"config.json not found: {path}") from e
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from e
        if not isinstance(d, dict):
            raise ValueError(f"{path}: top level must be a JSON object")
        return cls.from_dict(d)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DeepseekV4Config":
        """Build from a ``config.json`` dict (legacy or transformers keys). Raises ValueError naming the bad key."""
        if not isinstance(d, dict):
            raise ValueError("config must be a dict")
        d = dict(d)
        if "text_config" in d or d.get("model_type") == "deepseek_v41":
            raise ValueError("model_type: DeepSeek-V4.1 (deepseek_v41) configs are a different architecture, not supported here")
        mt = d.get("model_type", "deepseek_v4")
        if mt not in ("deepseek_v4", "deepseek_v3"):
            raise ValueError(f"model_type: expected 'deepseek_v4', got {mt!r}")

        def req_int(key: str, minimum: int = 1, aliases: tuple[str, ...] = ()) -> int:
            for k in (key, *aliases):
                if k in d:
                    return _as_int(k, d[k], minimum)
            raise ValueError(f"config key {key!r} is missing")

        def opt_int(key: str, default: int, minimum: int = 1) -> int:
            return _as_int(key, d[key], minimum) if key in d and d[key] is not None else default

        def opt_float(key: str, default: float, positive: bool = True) -> float:
            if key not in d or d[key] is None:
                return default
            return _as_float(key, d[key], positive)

        vocab_size = req_int("vocab_size")
        hidden_size = req_int("hidden_size", aliases=("dim",))
        n_layers = req_int("num_hidden_layers", aliases=("n_layers",))
        n_heads = req_int("num_attention_heads", aliases=("n_heads",))
        head_dim = req_int("head_dim")
        if "num_key_value_heads" in d and d["num_key_value_heads"] not in (1, None):
            raise ValueError(f"num_key_value_heads: DeepSeek-V4 uses one shared K=V head, got {d['num_key_value_heads']!r}")

        # rope dims: legacy qk_rope_head_dim, else partial_rotary_factor, else V4 default 64/512
        if d.get("qk_rope_head_dim") is not None:
            rope_dim = _as_int("qk_rope_head_dim", d["qk_rope_head_dim"], 2)
        elif d.get("partial_rotary_factor") is not None:
            prf = _as_float("partial_rotary_factor", d["partial_rotary_factor"], True)
            rope_dim = int(head_dim * prf)
        else:
            rope_dim = int(head_dim * 64 / 512)
        if rope_dim % 2 or rope_dim <= 0 or rope_dim > head_dim:
            raise ValueError(f"qk_rope_head_dim: {rope_dim} must be even and in (0, head_dim={head_dim}]")

        # compression rates
        rates = dict(_DEFAULT_COMPRESS_RATES)
        if isinstance(d.get("compress_rates"), dict):
            for k, v in d["compress_rates"].items():
                if k not in rates:
                    raise ValueError(f"compress_rates: unknown layer type {k!r}")
                rates[k] = _as_int(f"compress_rates.{k}", v, 1)
        elif d.get("compress_rates") is not None:
            raise ValueError("compress_rates: must be a dict {layer_type: rate}")
        for k, lt in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
            if d.get(k) is not None:
                rates[lt] = _as_int(k, d[k], 1)
        ratio_of = {SLIDING: 0, CSA: rates[CSA], HCA: rates[HCA]}

        n_mtp = opt_int("num_nextn_predict_layers", 1, 0)

        # per-layer attention types
        if d.get("layer_types") is not None:
            lts = d["layer_types"]
            if not isinstance(lts, (list, tuple)) or any(t not in ratio_of for t in lts):
                raise ValueError(f"layer_types: entries must be one of {tuple(ratio_of)}, got {lts!r}")
            if len(lts) < n_layers:
                raise ValueError(f"layer_types: {len(lts)} entries for num_hidden_layers={n_layers}")
            ratios = [ratio_of[t] for t in lts]
        elif d.get("compress_ratios") is not None:
            ratios = d["compress_ratios"]
            if not isinstance(ratios, (list, tuple)):
                raise ValueError("compress_ratios: must be a list of ints")
            ratios = [_as_int("compress_ratios", r, 0) for r in ratios]
            if len(ratios) < n_layers:
                raise ValueError(f"compress_ratios: {len(ratios)} entries for num_hidden_layers={n_layers}")
            bad = [r for r in ratios if r not in ratio_of.values()]
            if bad:
                raise ValueError(f"compress_ratios: values must be 0, {rates[CSA]} or {rates[HCA]}, got {bad}")
        else:
            raise ValueError("config key 'compress_ratios' (or 'layer_types') is missing")
        layer_ratios = tuple(ratios[:n_layers])
        extra_ratios = list(ratios[n_layers:])
        mtp_ratios = tuple((extra_ratios + [0] * n_mtp)[:n_mtp])

        # MoE layer types
        if d.get("mlp_layer_types") is not None:
            mts = d["mlp_layer_types"]
            if not isinstance(mts, (list, tuple)) or any(t not in (HASH_MOE, MOE) for t in mts) or len(mts) < n_layers:
                raise ValueError(f"mlp_layer_types: need {n_layers} entries from ('hash_moe', 'moe'), got {mts!r}")
            mlp_types = tuple(mts[:n_layers])
        else:
            n_hash = opt_int("num_hash_layers", 3, 0)
            mlp_types = tuple([HASH_MOE] * min(n_layers, n_hash) + [MOE] * max(0, n_layers - n_hash))

        # rope thetas + YaRN
        rope_theta = opt_float("rope_theta", 10000.0)
        compress_rope_theta = opt_float("compress_rope_theta", 160000.0)
        rope_scaling = None
        rp = d.get("rope_parameters")
        if isinstance(rp, dict) and isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
            if rp["main"].get("rope_theta") is not None:
                rope_theta = _as_float("rope_parameters.main.rope_theta", rp["main"]["rope_theta"], True)
            if rp["main"].get("rope_type", "default") != "default":
                raise ValueError(f"rope_parameters.main.rope_type: only 'default' is supported, got {rp['main'].get('rope_type')!r}")
            comp = dict(rp["compress"])
            if comp.get("rope_theta") is not None:
                compress_rope_theta = _as_float("rope_parameters.compress.rope_theta", comp["rope_theta"], True)
            rope_scaling = _parse_yarn("rope_parameters.compress", comp)
        else:
            src = d.get("rope_scaling")
            key = "rope_scaling"
            if src is None and isinstance(rp, dict):
                src, key = rp, "rope_parameters"
            if src is not None:
                if not isinstance(src, dict):
                    raise ValueError(f"{key}: must be a dict")
                rope_scaling = _parse_yarn(key, dict(src))

        scoring = d.get("scoring_func", "sqrtsoftplus")
        if scoring not in SCORING_FUNCS:
            raise ValueError(f"scoring_func: expected one of {SCORING_FUNCS}, got {scoring!r}")
        if d.get("norm_topk_prob", True) is not True:
            raise ValueError("norm_topk_prob: only true is supported (the reference always renormalises)")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act: only 'silu' is supported, got {act!r}")
        if d.get("tie_word_embeddings", False):
            raise ValueError("tie_word_embeddings: DeepSeek-V4 has an untied head; true is not supported")

        cfg = cls(
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            head_dim=head_dim,
            qk_rope_head_dim=rope_dim,
            q_lora_rank=req_int("q_lora_rank"),
            o_groups=opt_int("o_groups", 8),
            o_lora_rank=opt_int("o_lora_rank", 1024),
            n_routed_experts=req_int("n_routed_experts"),
            n_shared_experts=opt_int("n_shared_experts", 1),
            num_experts_per_tok=req_int("num_experts_per_tok"),
            moe_intermediate_size=req_int("moe_intermediate_size"),
            compress_ratios=layer_ratios,
            mlp_layer_types=mlp_types,
            mtp_compress_ratios=mtp_ratios,
            compress_rate_csa=rates[CSA],
            compress_rate_hca=rates[HCA],
            scoring_func=scoring,
            routed_scaling_factor=opt_float("routed_scaling_factor", 1.5),
            swiglu_limit=opt_float("swiglu_limit", 10.0),
            sliding_window=opt_int("sliding_window", 128),
            index_n_heads=opt_int("index_n_heads", 64),
            index_head_dim=opt_int("index_head_dim", 128),
            index_topk=opt_int("index_topk", 512),
            hc_mult=opt_int("hc_mult", 4),
            hc_sinkhorn_iters=opt_int("hc_sinkhorn_iters", 20),
            hc_eps=opt_float("hc_eps", 1.0e-6),
            rms_norm_eps=opt_float("rms_norm_eps", 1.0e-6),
            rope_theta=rope_theta,
            compress_rope_theta=compress_rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=opt_int("max_position_embeddings", 1048576),
            num_nextn_predict_layers=n_mtp,
            bos_token_id=d.get("bos_token_id", 0),
            eos_token_id=d.get("eos_token_id", 1),
            extra={k: v for k, v in d.items()},
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Cross-field checks. Raises ValueError naming the key."""
        if self.o_groups <= 0 or self.num_attention_heads % self.o_groups:
            raise ValueError(f"o_groups: {self.o_groups} must divide num_attention_heads={self.num_attention_heads}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(f"num_experts_per_tok: {self.num_experts_per_tok} > n_routed_experts={self.n_routed_experts}")
        if self.qk_rope_head_dim > self.index_head_dim:
            raise ValueError(f"index_head_dim: {self.index_head_dim} is smaller than qk_rope_head_dim={self.qk_rope_head_dim}")
        for r in self.compress_ratios + self.mtp_compress_ratios:
            self.layer_type_of_ratio(r)
        if len(self.mlp_layer_types) != self.num_hidden_layers:
            raise ValueError("mlp_layer_types: length must equal num_hidden_layers")
        if self.compress_rate_hca % self.compress_rate_csa:
            raise ValueError("compress_rates: the HCA rate must be a multiple of the CSA rate")
        if self.sliding_window < 1:
            raise ValueError("sliding_window: must be >= 1")


def _as_int(key: str, v: Any, minimum: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        raise ValueError(f"config key {key!r}: expected an integer, got {v!r}")
    v = int(v)
    if v < minimum:
        raise ValueError(f"config key {key!r}: {v} is below the minimum {minimum}")
    return v


def _as_float(key: str, v: Any, positive: bool) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"config key {key!r}: expected a finite number, got {v!r}")
    if positive and v <= 0:
        raise ValueError(f"config key {key!r}: must be > 0, got {v!r}")
    return float(v)


def _parse_yarn(key: str, rs: dict) -> dict | None:
    """Normalise a rope-scaling dict; returns None for plain rope, a YaRN dict otherwise."""
    rtype = rs.get("rope_type", rs.get("type", "default"))
    if rtype in (None, "default"):
        return None
    if rtype != "yarn":
        raise ValueError(f"{key}.type: only 'yarn' (or default) is supported, got {rtype!r}")
    if rs.get("attention_factor") not in (None, 1, 1.0):
        raise ValueError(f"{key}.attention_factor: the V4 reference uses 1.0, got {rs.get('attention_factor')!r}")
    for k in ("factor", "original_max_position_embeddings"):
        if rs.get(k) is None:
            raise ValueError(f"config key '{key}.{k}' is missing")
    return {
        "factor": _as_float(f"{key}.factor", rs["factor"], True),
        "original_max_position_embeddings": _as_int(
            f"{key}.original_max_position_embeddings", rs["original_max_position_embeddings"], 1
        ),
        "beta_fast": _as_float(f"{key}.beta_fast", rs.get("beta_fast") or 32, True),
        "beta_slow": _as_float(f"{key}.beta_slow", rs.get("beta_slow") or 1, True),
    }


# The built-in `tiny` preset (legacy config.json keys, as real checkpoints ship them). Every layer type (sliding, CSA
# ratio 4, HCA ratio 128), hash and score-routed MoE, one MTP layer, the real window 128 and the real V4 tokenizer's
# vocabulary (129,280). Small enough for CPU fp32 tests in seconds.
TINY_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 129280,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "qk_rope_head_dim": 32,
    "q_lora_rank": 48,
    "o_groups": 2,
    "o_lora_rank": 32,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "compress_ratios": [0, 4, 128, 4, 0],
    "num_hash_layers": 2,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "sliding_window": 128,
    "index_n_heads": 16,
    "index_head_dim": 48,
    "index_topk": 16,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1.0e-6,
    "rms_norm_eps": 1.0e-6,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 1048576,
    "num_nextn_predict_layers": 1,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
}
