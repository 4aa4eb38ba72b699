"""DeepSeek-V4 (V4-Flash architecture) model configuration, read from a checkpoint's ``config.json``.

Accepts both spellings found in the wild:

* the legacy keys real DeepSeek checkpoints ship: ``compress_ratios`` (one int per layer, 0 = sliding window,
  4 = CSA, 128 = HCA; an optional trailing entry per MTP layer), ``num_hash_layers``, ``qk_rope_head_dim`` and a flat
  ``rope_scaling`` dict (YaRN for the compressed layers);
* transformers 5.23 names: ``layer_types`` / ``mlp_layer_types`` / ``partial_rotary_factor`` / ``rope_parameters``
  (flat or nested ``{"main": ..., "compress": ...}``) / ``compress_rates``.

Unknown keys (``architectures``, ``quantization_config``, ``torch_dtype``, ...) are ignored here (the checkpoint
loader checks the dtype keys: ``checkpoint.parse_config``). A missing required key or
an invalid value raises ``ValueError`` naming the key, the value and the limit. Every size is bounded (:data:`INT_LIMITS`,
:data:`FLOAT_LIMITS`, the head dims the ops take, :data:`MAX_TENSORS` / :data:`MAX_PARAMETERS`) before anything is
built from it, so a hostile ``config.json`` cannot make the engine allocate without bound or hang.

Source: transformers 5.23 ``configuration_deepseek_v4.py`` (key names, defaults, legacy folding).
"""

from __future__ import annotations

import dataclasses
import math
import os
import reprlib
from dataclasses import asdict, dataclass, field
from typing import Any

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
HASH_MOE = "hash_moe"
MOE = "moe"

_DEFAULT_COMPRESS_RATES = {CSA: 4, HCA: 128}
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")

# ---- limits -----------------------------------------------------------------------------------------------------
# Head dims the attention ops take: sparse_mqa_* (csrc/common/attention_checks.h, check_sparse_mqa) and the lightning
# indexer's mqa_logits and key caches (is_indexer_head_dim).
SPARSE_MQA_HEAD_DIMS = (64, 128, 256, 512)
INDEXER_HEAD_DIMS = (48, 64, 128)
FP32_MAX = 3.4028234663852886e38

#: ``[min, max]`` of each integer field. Kernel limits where the ops have one, else sane maxima: far above any
#: DeepSeek model (V4-Flash figures in the comments), far below what would exhaust memory or time.
INT_LIMITS: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 1 << 20),  # 8x V4's 129,280
    "hidden_size": (1, 65536),  # 16x V4-Flash's 4096
    "num_hidden_layers": (1, 256),  # 6x V4-Flash's 43
    "num_attention_heads": (1, 1024),  # 16x V4-Flash's 64
    "head_dim": (1, max(SPARSE_MQA_HEAD_DIMS)),  # and one of SPARSE_MQA_HEAD_DIMS
    "qk_rope_head_dim": (2, max(SPARSE_MQA_HEAD_DIMS)),  # even, <= head_dim and <= index_head_dim
    "q_lora_rank": (1, 65536),  # 64x V4-Flash's 1024
    "o_groups": (1, 1024),  # and a divisor of num_attention_heads
    "o_lora_rank": (1, 65536),  # 64x V4-Flash's 1024
    "n_routed_experts": (1, 4096),  # 16x V4-Flash's 256 (moe_permute's CUDA limit is 25,000)
    "n_shared_experts": (1, 64),  # V4: 1
    "num_experts_per_tok": (1, 2048),  # topk_rows' CUDA limit (kTopkMaxK); and <= n_routed_experts
    "moe_intermediate_size": (1, 65536),  # 32x V4-Flash's 2048
    "compress_rate_csa": (1, 128),  # and a divisor of the 128-token cache block (cache.BLOCK_SIZE)
    "compress_rate_hca": (1, 128),
    "sliding_window": (1, 4096),  # 32x V4's 128: every step builds [tokens, window] index lists
    "index_n_heads": (1, 128),  # mqa_logits' CUDA limit
    "index_head_dim": (1, max(INDEXER_HEAD_DIMS)),  # and one of INDEXER_HEAD_DIMS
    "index_topk": (1, 2048),  # topk_rows' CUDA limit (kTopkMaxK); V4-Flash: 512
    "hc_mult": (1, 4),  # hc_mix takes at most 32 mixes per token (kHcMixMaxM): (2 + hc) * hc <= 32
    "hc_sinkhorn_iters": (1, 1000),  # 50x V4's 20; each iteration is a pass over every token's hc x hc matrix
    "max_position_embeddings": (1, 1 << 24),  # 16x V4's 1,048,576
    "num_nextn_predict_layers": (0, 16),  # V4: 1 MTP layer
    "num_hash_layers": (0, 256),  # V4: 3 (clamped to num_hidden_layers)
    "original_max_position_embeddings": (1, 1 << 24),  # YaRN's pre-extension length (V4: 65,536)
}
#: ``(min, max]`` of each float field (the model computes in float32).
FLOAT_LIMITS: dict[str, tuple[float, float]] = {
    "rms_norm_eps": (0.0, 1.0),  # a guard far below the mean square (V4: 1e-6)
    "hc_eps": (0.0, 1.0),
    "rope_theta": (1.0, FP32_MAX),  # > 1: YaRN divides by log(theta); V4: 10,000 / 160,000
    "compress_rope_theta": (1.0, FP32_MAX),
    "partial_rotary_factor": (0.0, 1.0),  # rope dims / head_dim
    "routed_scaling_factor": (0.0, FP32_MAX),
    "swiglu_limit": (0.0, FP32_MAX),
    "factor": (0.0, FP32_MAX),  # YaRN context extension (V4: 16)
    "beta_fast": (1e-3, 1e3),  # YaRN rotation counts (V4: 32 and 1); the ramp takes log(length / beta)
    "beta_slow": (1e-3, 1e3),
}
#: Budget of the whole inventory (``expected_parameters``), checked before it is built. V4-Flash (43 layers + 1 MTP
#: layer): 35,020 tensors, ~291e9 parameters. 4e12 parameters are 2 TB of weights even at FP4: no machine this
#: engine runs on loads that.
MAX_TENSORS = 1_000_000
MAX_PARAMETERS = 4 * 10**12
#: Deepest nesting of any config value (real configs nest 3 levels: rope_parameters.compress.factor).
MAX_NESTING = 32
_RATE_KEYS = "compress_rates / compress_rate_csa / compress_rate_hca"


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

    def inventory_size(self) -> tuple[int, int]:
        """``(tensors, parameters)`` of ``expected_parameters(self)``, without building its per-expert entries: both
        are affine in ``n_routed_experts``, so the inventories for 1 and 2 experts give them exactly."""
        from .params import expected_parameters

        def size(experts: int) -> tuple[int, int]:
            spec = expected_parameters(dataclasses.replace(self, n_routed_experts=experts))
            return len(spec), sum(math.prod(shape) for shape, _ in spec.values())

        (t1, p1), (t2, p2) = size(1), size(2)
        more = self.n_routed_experts - 1
        return t1 + more * (t2 - t1), p1 + more * (p2 - p1)

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
        """Read ``path`` (a ``config.json`` or a checkpoint folder holding one). Raises ValueError naming the file
        (missing, unreadable, not JSON, nested too deeply) or the key."""
        from deepinfer.checkpoint import read_json

        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        d = read_json(path)
        if not isinstance(d, dict):
            raise ValueError(f"{path}: top level must be a JSON object")
        try:
            return cls.from_dict(d)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DeepseekV4Config":
        """Build from a ``config.json`` dict (legacy or transformers keys). Raises ValueError naming the bad key."""
        if not isinstance(d, dict):
            raise ValueError("config must be a dict")
        d = dict(d)
        _check_nesting(d)
        if "text_config" in d or d.get("model_type") == "deepseek_v41":
            raise ValueError("model_type: DeepSeek-V4.1 configs (deepseek_v41, with a text_config) are a different "
                             "architecture, not supported here")
        mt = d.get("model_type", "deepseek_v4")
        if mt not in ("deepseek_v4", "deepseek_v3"):
            raise ValueError(f"model_type: expected 'deepseek_v4', got {_brief(mt)}")

        def req_int(key: str, aliases: tuple[str, ...] = ()) -> int:
            for k in (key, *aliases):
                if k in d:
                    return _as_int(k, d[k], INT_LIMITS[key])
            also = "".join(f" (or {a!r})" for a in aliases)
            raise ValueError(f"config key {key!r}{also} is missing")

        def opt_int(key: str, default: int) -> int:
            return _as_int(key, d[key], INT_LIMITS[key]) if key in d and d[key] is not None else default

        def opt_float(key: str, default: float) -> float:
            if key not in d or d[key] is None:
                return default
            return _as_float(key, d[key], FLOAT_LIMITS[key])

        vocab_size = req_int("vocab_size")
        hidden_size = req_int("hidden_size", aliases=("dim",))
        n_layers = req_int("num_hidden_layers", aliases=("n_layers",))
        n_heads = req_int("num_attention_heads", aliases=("n_heads",))
        head_dim = req_int("head_dim")
        if "num_key_value_heads" in d and d["num_key_value_heads"] not in (1, None):
            raise ValueError(f"num_key_value_heads: DeepSeek-V4 uses one shared K=V head, got {_brief(d['num_key_value_heads'])}")

        # rope dims: legacy qk_rope_head_dim, else partial_rotary_factor, else V4 default 64/512
        if d.get("qk_rope_head_dim") is not None:
            rope_dim = req_int("qk_rope_head_dim")
        elif d.get("partial_rotary_factor") is not None:
            rope_dim = int(head_dim * opt_float("partial_rotary_factor", 0.0))
        else:
            rope_dim = int(head_dim * 64 / 512)
        if rope_dim % 2 or rope_dim <= 0 or rope_dim > head_dim:
            raise ValueError(f"qk_rope_head_dim (or partial_rotary_factor): {rope_dim} must be even and in "
                             f"(0, head_dim={head_dim}]")

        # compression rates
        rates = dict(_DEFAULT_COMPRESS_RATES)
        rate_key = {CSA: "compress_rate_csa", HCA: "compress_rate_hca"}
        if isinstance(d.get("compress_rates"), dict):
            for k, v in d["compress_rates"].items():
                if k not in rates:
                    raise ValueError(f"compress_rates: unknown layer type {_brief(k)}")
                rates[k] = _as_int(f"compress_rates.{k}", v, INT_LIMITS[rate_key[k]])
        elif d.get("compress_rates") is not None:
            raise ValueError("compress_rates: must be a dict {layer_type: rate}")
        for lt, k in rate_key.items():
            if d.get(k) is not None:
                rates[lt] = opt_int(k, 0)
        ratio_of = {SLIDING: 0, CSA: rates[CSA], HCA: rates[HCA]}

        n_mtp = opt_int("num_nextn_predict_layers", 1)

        # per-layer attention types
        if d.get("layer_types") is not None:
            lts = d["layer_types"]
            if not isinstance(lts, (list, tuple)) or any(not isinstance(t, str) or t not in ratio_of for t in lts):
                raise ValueError(f"layer_types: entries must be one of {tuple(ratio_of)}, got {_brief(lts)}")
            if len(lts) < n_layers:
                raise ValueError(f"layer_types: {len(lts)} entries for num_hidden_layers={n_layers}")
            ratios = [ratio_of[t] for t in lts]
        elif d.get("compress_ratios") is not None:
            ratios = d["compress_ratios"]
            if not isinstance(ratios, (list, tuple)):
                raise ValueError("compress_ratios: must be a list of ints")
            ratios = [_as_int("compress_ratios", r, (0, INT_LIMITS["compress_rate_hca"][1])) for r in ratios]
            if len(ratios) < n_layers:
                raise ValueError(f"compress_ratios: {len(ratios)} entries for num_hidden_layers={n_layers}")
            bad = [r for r in ratios if r not in ratio_of.values()]
            if bad:
                raise ValueError(f"compress_ratios: values must be 0, {rates[CSA]} or {rates[HCA]} (the rates of "
                                 f"{_RATE_KEYS}), got {_brief(bad)}")
        else:
            raise ValueError("config key 'compress_ratios' (or 'layer_types') is missing")
        layer_ratios = tuple(ratios[:n_layers])
        extra_ratios = list(ratios[n_layers:])
        mtp_ratios = tuple((extra_ratios + [0] * n_mtp)[:n_mtp])

        # MoE layer types
        if d.get("mlp_layer_types") is not None:
            mts = d["mlp_layer_types"]
            if not isinstance(mts, (list, tuple)) or any(t not in (HASH_MOE, MOE) for t in mts) or len(mts) < n_layers:
                raise ValueError(f"mlp_layer_types: need num_hidden_layers={n_layers} entries from ('hash_moe', "
                                 f"'moe'), got {_brief(mts)}")
            mlp_types = tuple(mts[:n_layers])
        else:
            n_hash = opt_int("num_hash_layers", 3)
            mlp_types = tuple([HASH_MOE] * min(n_layers, n_hash) + [MOE] * max(0, n_layers - n_hash))

        # rope thetas + YaRN
        rope_theta = opt_float("rope_theta", 10000.0)
        compress_rope_theta = opt_float("compress_rope_theta", 160000.0)
        rope_scaling = None
        rp = d.get("rope_parameters")
        if rp is not None and (not isinstance(rp, dict) or (("main" in rp or "compress" in rp) and not (
                isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict)))):
            raise ValueError(f"rope_parameters: must be a dict, flat or {{'main': dict, 'compress': dict}}, got "
                             f"{_brief(rp)}")
        if isinstance(rp, dict) and "main" in rp:
            if rp["main"].get("rope_theta") is not None:
                rope_theta = _as_float("rope_parameters.main.rope_theta", rp["main"]["rope_theta"],
                                       FLOAT_LIMITS["rope_theta"])
            if rp["main"].get("rope_type", "default") != "default":
                raise ValueError(f"rope_parameters.main.rope_type: only 'default' is supported, got "
                                 f"{_brief(rp['main'].get('rope_type'))}")
            comp = dict(rp["compress"])
            if comp.get("rope_theta") is not None:
                compress_rope_theta = _as_float("rope_parameters.compress.rope_theta", comp["rope_theta"],
                                                FLOAT_LIMITS["compress_rope_theta"])
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
            raise ValueError(f"scoring_func: expected one of {SCORING_FUNCS}, got {_brief(scoring)}")
        if d.get("norm_topk_prob", True) is not True:
            raise ValueError("norm_topk_prob: only true is supported (the reference always renormalises)")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act: only 'silu' is supported, got {_brief(act)}")
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
            bos_token_id=_token_ids("bos_token_id", d.get("bos_token_id", 0), vocab_size),
            eos_token_id=_token_ids("eos_token_id", d.get("eos_token_id", 1), vocab_size),
            extra={k: v for k, v in d.items()},
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Ranges (:data:`INT_LIMITS`, :data:`FLOAT_LIMITS`), the head dims the ops take, cross-field checks and the
        inventory budget (:data:`MAX_TENSORS`, :data:`MAX_PARAMETERS`). Raises ValueError naming the key."""
        for key, limits in INT_LIMITS.items():
            if hasattr(self, key):
                _as_int(key, getattr(self, key), limits)
        for key, limits in FLOAT_LIMITS.items():
            if hasattr(self, key):
                _as_float(key, getattr(self, key), limits)
        if self.head_dim not in SPARSE_MQA_HEAD_DIMS:
            raise ValueError(f"head_dim: {self.head_dim} is not supported: sparse_mqa takes "
                             f"{_or_list(SPARSE_MQA_HEAD_DIMS)}")
        if self.index_head_dim not in INDEXER_HEAD_DIMS:
            raise ValueError(f"index_head_dim: {self.index_head_dim} is not supported: the indexer's mqa_logits "
                             f"takes {_or_list(INDEXER_HEAD_DIMS)}")
        if self.o_groups <= 0 or self.num_attention_heads % self.o_groups:
            raise ValueError(f"o_groups: {self.o_groups} must divide num_attention_heads={self.num_attention_heads}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(f"num_experts_per_tok: {self.num_experts_per_tok} > n_routed_experts={self.n_routed_experts}")
        if self.qk_rope_head_dim > self.index_head_dim:
            raise ValueError(f"index_head_dim: {self.index_head_dim} is smaller than qk_rope_head_dim="
                             f"{self.qk_rope_head_dim} (or head_dim x partial_rotary_factor)")
        for r in self.compress_ratios + self.mtp_compress_ratios:
            self.layer_type_of_ratio(r)
        if len(self.mlp_layer_types) != self.num_hidden_layers:
            raise ValueError("mlp_layer_types: length must equal num_hidden_layers")
        from .cache import BLOCK_SIZE

        for key in ("compress_rate_csa", "compress_rate_hca"):
            if BLOCK_SIZE % getattr(self, key):
                raise ValueError(f"{key}: {getattr(self, key)} must divide the cache block of {BLOCK_SIZE} tokens "
                                 f"({_RATE_KEYS})")
        csa, hca = self.compress_rate_csa, self.compress_rate_hca
        if hca <= csa or hca % csa:
            raise ValueError(f"{_RATE_KEYS}: the HCA rate {hca} must be a larger multiple of the CSA rate {csa}")
        for key in ("bos_token_id", "eos_token_id"):
            _token_ids(key, getattr(self, key), self.vocab_size)
        self._check_budget()

    def _check_budget(self) -> None:
        tensors, params = self.inventory_size()
        if tensors > MAX_TENSORS:
            raise ValueError(
                f"model size: {tensors} tensors (n_routed_experts={self.n_routed_experts} x 3 per MoE layer, "
                f"num_hidden_layers={self.num_hidden_layers} + num_nextn_predict_layers="
                f"{self.num_nextn_predict_layers}) exceed the limit {MAX_TENSORS} (V4-Flash: ~35,000)")
        if params > MAX_PARAMETERS:
            raise ValueError(
                f"model size: {params} parameters (vocab_size={self.vocab_size}, hidden_size={self.hidden_size}, "
                f"num_hidden_layers={self.num_hidden_layers}, n_routed_experts={self.n_routed_experts}, "
                f"moe_intermediate_size={self.moe_intermediate_size}) exceed the limit {MAX_PARAMETERS} "
                f"(>= {params // 2 // 10**12} TB of weights even at FP4; V4-Flash: ~291e9 with its MTP layer)")


def _as_int(key: str, v: Any, limits: tuple[int, int]) -> int:
    """``v`` as an int in ``[limits[0], limits[1]]`` (integral floats such as 1e9 count). Raises ValueError naming
    ``key``, the value and the limit."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        raise ValueError(f"config key {key!r}: expected an integer, got {_brief(v)}")
    v = int(v)
    if v < limits[0]:
        raise ValueError(f"config key {key!r}: {_brief(v)} is below the minimum {limits[0]}")
    if v > limits[1]:
        raise ValueError(f"config key {key!r}: {_brief(v)} is above the maximum {limits[1]}")
    return v


def _as_float(key: str, v: Any, limits: tuple[float, float]) -> float:
    """``v`` as a float in ``(limits[0], limits[1]]``. Raises ValueError naming ``key``, the value and the limit."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"config key {key!r}: expected a finite number, got {_brief(v)}")
    try:
        f = float(v)
    except OverflowError:  # an int beyond float's range
        f = math.copysign(math.inf, v)
    if not math.isfinite(f) or not limits[0] < f <= limits[1]:
        raise ValueError(f"config key {key!r}: {_brief(v)} is outside ({limits[0]:g}, {limits[1]:g}]")
    return f


def _token_ids(key: str, v: Any, vocab_size: int) -> int | list[int] | None:
    """None, one token id or a list of them, each an int in ``[0, vocab_size)``. Raises ValueError naming ``key``."""
    if v is None:
        return None
    many = isinstance(v, (list, tuple))
    if many and not v:
        raise ValueError(f"config key {key}: an empty list (give at least one token id, or null for none)")
    try:
        ids = [_as_int(key, t, (0, vocab_size - 1)) for t in (v if many else [v])]
    except ValueError as e:
        raise ValueError(f"{e} (token ids are in [0, vocab_size={vocab_size}))") from None
    return type(v)(ids) if many else ids[0]


def _check_nesting(d: dict) -> None:
    """Refuse values nested deeper than :data:`MAX_NESTING` (without recursing), naming the top-level key."""
    for key, value in d.items():
        stack = [(value, 1)]
        while stack:
            v, depth = stack.pop()
            if depth > MAX_NESTING:
                raise ValueError(f"config key {_brief(key)}: nested deeper than {MAX_NESTING} levels")
            if isinstance(v, dict):
                stack.extend((x, depth + 1) for x in v.values())
            elif isinstance(v, (list, tuple)):
                stack.extend((x, depth + 1) for x in v)


class _BriefRepr(reprlib.Repr):
    """reprlib with short strings / containers and huge ints by size (``repr`` refuses ints of > 4300 digits)."""

    def repr_int(self, x: int, level: int) -> str:
        return super().repr_int(x, level) if x.bit_length() <= 256 else f"<an int of {x.bit_length()} bits>"


_BRIEF = _BriefRepr()
_BRIEF.maxlevel, _BRIEF.maxstring, _BRIEF.maxother, _BRIEF.maxlong = 3, 60, 60, 80


def _brief(v: Any) -> str:
    """A bounded repr of a config value for error messages (safe for deep nesting and huge ints)."""
    return _BRIEF.repr(v)


def _or_list(values: tuple[int, ...]) -> str:
    return ", ".join(map(str, values[:-1])) + f" or {values[-1]}"


def _parse_yarn(key: str, rs: dict) -> dict | None:
    """Normalise a rope-scaling dict; returns None for plain rope, a YaRN dict otherwise."""
    rtype = rs.get("rope_type", rs.get("type", "default"))
    if rtype in (None, "default"):
        return None
    if rtype != "yarn":
        raise ValueError(f"{key}.type: only 'yarn' (or default) is supported, got {_brief(rtype)}")
    if rs.get("attention_factor") not in (None, 1, 1.0):
        raise ValueError(f"{key}.attention_factor: the V4 reference uses 1.0, got {_brief(rs.get('attention_factor'))}")
    for k in ("factor", "original_max_position_embeddings"):
        if rs.get(k) is None:
            raise ValueError(f"config key '{key}.{k}' is missing")
    orig = "original_max_position_embeddings"
    return {
        "factor": _as_float(f"{key}.factor", rs["factor"], FLOAT_LIMITS["factor"]),
        orig: _as_int(f"{key}.{orig}", rs[orig], INT_LIMITS[orig]),
        "beta_fast": _as_float(f"{key}.beta_fast", rs.get("beta_fast") or 32, FLOAT_LIMITS["beta_fast"]),
        "beta_slow": _as_float(f"{key}.beta_slow", rs.get("beta_slow") or 1, FLOAT_LIMITS["beta_slow"]),
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
