"""DeepSeek-V4.1 model configuration, read from a checkpoint's ``config.json``.

Two layouts are accepted (``docs/deepseek_v41.md``, "Config"):

* the inference layout: every key of the reference's ``ModelArgs`` at the top level (``dim``, ``n_layers``,
  ``compress_ratios``, ``kv_source_layers``, ...), as the golden checkpoints ship it;
* the released layout: ``{"model_type": "deepseek_v41", "text_config": {...}, "vision_config": {...}}``, where
  ``text_config`` holds either the same keys or their transformers-style names (:data:`HF_NAMES`).

A missing required key or a bad value raises ``ValueError`` naming the key. Sizes are bounded before anything is
built from them.
"""

from __future__ import annotations

import math
import reprlib
from dataclasses import asdict, dataclass
from typing import Any

MODEL_TYPE = "deepseek_v41"
SCORE_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")

#: transformers-style ``text_config`` names -> the reference's ``ModelArgs`` names.
HF_NAMES = {
    "hidden_size": "dim", "num_hidden_layers": "n_layers", "num_attention_heads": "n_heads",
    "moe_intermediate_size": "moe_inter_dim", "num_experts_per_tok": "n_activated_experts",
    "scoring_func": "score_func", "routed_scaling_factor": "route_scale", "rms_norm_eps": "norm_eps",
    "sliding_window": "window_size", "kv_source_layer_ids": "kv_source_layers",
    "index_source_layer_ids": "index_source_layers", "candidate_source_layer_id": "candidate_source_layer",
    "qk_rope_head_dim": "rope_head_dim", "num_nextn_predict_layers": "n_mtp_layers",
    "engram_pad_token_id": "engram_pad_id", "dspark_num_experts_per_tok": "dspark_n_activated_experts",
    "max_position_embeddings": "max_seq_len",
}

#: ``[min, max]`` of each integer field: far above V4.1-Flash (in the comments), far below what exhausts memory.
INT_LIMITS: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 1 << 20),  # 129,280
    "dim": (32, 65536),  # 5120; a multiple of 32 (activation quantisation groups)
    "moe_inter_dim": (32, 65536),  # 2304
    "n_layers": (1, 256),  # 40
    "n_mtp_layers": (0, 16),  # 3
    "n_heads": (1, 1024),  # 64
    "n_routed_experts": (1, 4096),  # 384
    "n_shared_experts": (1, 1),  # the reference supports exactly one
    "n_activated_experts": (1, 2048),  # 6
    "q_lora_rank": (32, 65536),  # 1280
    "head_dim": (32, 1024),  # 512
    "rope_head_dim": (2, 1024),  # 64
    "o_groups": (1, 1024),  # 8
    "o_lora_rank": (1, 65536),  # 1024
    "window_size": (1, 4096),  # 128
    "index_n_heads": (1, 128),  # 32
    "index_head_dim": (32, 1024),  # 128
    "index_topk": (1, 1 << 16),  # 512
    "candidate_topk_blocks": (0, 1 << 20),  # 2048
    "candidate_block_size": (0, 4096),  # 8
    "hc_mult": (1, 8),  # 4
    "hc_sinkhorn_iters": (1, 1000),  # 20
    "max_seq_len": (1, 1 << 24),
    "original_seq_len": (0, 1 << 24),
    "engram_max_ngram_size": (1, 16),  # 4
    "engram_vocab_size": (0, 1 << 40),  # 16,000,000
    "engram_n_heads": (0, 256),  # 8
    "engram_head_dim": (0, 4096),  # 256
    "engram_pad_id": (0, 1 << 20),
    "engram_compressed_vocab_size": (0, 1 << 20),  # 99,092
    "dspark_block_size": (0, 64),  # 5
    "dspark_noise_token_id": (0, 1 << 20),
    "dspark_markov_rank": (1, 65536),  # 256
    "dspark_n_routed_experts": (0, 4096),  # 128
    "dspark_n_activated_experts": (0, 2048),  # 3
    "vision_n_layers": (0, 1024),
    "image_token_id": (0, 1 << 20),
    "beta_fast": (0, 1 << 20),
    "beta_slow": (0, 1 << 20),
    "bos_token_id": (0, 1 << 20),  # 0 (the V4 tokenizer's)
    "eos_token_id": (0, 1 << 20),  # 1
}
#: ``(min, max]`` of each float field.
FLOAT_LIMITS: dict[str, tuple[float, float]] = {
    "norm_eps": (0.0, 1.0), "hc_eps": (0.0, 1.0), "gate_temp": (0.0, 1e6), "route_scale": (0.0, 1e6),
    "swiglu_limit": (-1.0, 1e6), "rope_theta": (1.0, 1e30), "compress_rope_theta": (1.0, 1e30),
    "rope_factor": (0.0, 1e6), "temperature": (-1.0, 1e6),
}
_DEFAULTS: dict[str, Any] = {
    "max_batch_size": 1, "max_seq_len": 4096, "temperature": 0.0, "dtype": "fp8", "expert_dtype": "fp4",
    "n_mtp_layers": 0, "n_shared_experts": 1, "score_func": "sqrtsoftplus", "gate_temp": 1.0, "norm_topk_prob": True,
    "route_scale": 1.0, "swiglu_limit": 0.0, "norm_eps": 1e-20, "compress_rope_theta": 40000.0,
    "original_seq_len": 0, "rope_theta": 10000.0, "rope_factor": 40.0, "beta_fast": 32, "beta_slow": 1,
    "candidate_source_layer": -1, "candidate_topk_blocks": 0, "candidate_block_size": 0, "hc_mult": 4,
    "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "engram_layer_ids": (), "engram_num_embeddings": (),
    "engram_max_ngram_size": 1, "engram_vocab_size": 0, "engram_n_heads": 0, "engram_head_dim": 0,
    "engram_pad_id": 2, "engram_compressed_vocab_size": 0, "vision_n_layers": 0, "image_token_id": 129264,
    "dspark_block_size": 0, "dspark_noise_token_id": 0, "dspark_target_layer_ids": (), "dspark_markov_rank": 256,
    "dspark_n_routed_experts": 0, "dspark_n_activated_experts": 0, "bos_token_id": 0, "eos_token_id": 1,
}
_REQUIRED = ("vocab_size", "dim", "moe_inter_dim", "n_layers", "n_heads", "n_routed_experts", "n_activated_experts",
             "q_lora_rank", "head_dim", "rope_head_dim", "o_groups", "o_lora_rank", "window_size", "compress_ratios",
             "kv_source_layers", "index_source_layers", "index_n_heads", "index_head_dim", "index_topk")
_LISTS = ("compress_ratios", "kv_source_layers", "index_source_layers", "engram_layer_ids", "engram_num_embeddings",
          "dspark_target_layer_ids")


#: The built-in ``tiny-v41`` preset (inference layout): one backbone layer of each V4.1 block type (the golden
#: data's six: swa_only, kv_index_source (ratio 2), consumer_ratio2, candidate_source (ratio 1), consumer_ratio1,
#: candidate_index_source), Engram on layers 0 and 1 over the real tokenizer's compressed vocabulary (99,092 ids),
#: one DSpark stage tapping layers 4 and 5, the real vocabulary (129,280) and hidden 64.
TINY_CONFIG: dict[str, Any] = {
    "vocab_size": 129280, "dim": 64, "moe_inter_dim": 64, "n_layers": 6, "n_mtp_layers": 1, "n_heads": 2,
    "n_routed_experts": 4, "n_shared_experts": 1, "n_activated_experts": 2, "score_func": "sqrtsoftplus",
    "gate_temp": 1.0, "norm_topk_prob": True, "route_scale": 1.5, "swiglu_limit": 10.0, "q_lora_rank": 64,
    "head_dim": 64, "rope_head_dim": 16, "norm_eps": 1e-20, "o_groups": 2, "o_lora_rank": 32, "window_size": 32,
    "compress_ratios": [0, 2, 2, 1, 1, 1, 0], "kv_source_layers": [1, 3], "index_source_layers": [1, 3, 5],
    "compress_rope_theta": 160000.0, "original_seq_len": 1024, "rope_theta": 10000.0, "rope_factor": 4,
    "beta_fast": 32, "beta_slow": 1, "index_n_heads": 2, "index_head_dim": 32, "index_topk": 16,
    "candidate_source_layer": 3, "candidate_topk_blocks": 5, "candidate_block_size": 4, "hc_mult": 4,
    "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "engram_layer_ids": [0, 1], "engram_num_embeddings": None,
    "engram_max_ngram_size": 3, "engram_vocab_size": 1000, "engram_n_heads": 2, "engram_head_dim": 32,
    "engram_pad_id": 2, "engram_compressed_vocab_size": 99092, "dspark_block_size": 3,
    "dspark_noise_token_id": 128799, "dspark_target_layer_ids": [4, 5], "dspark_markov_rank": 32,
    "dspark_n_routed_experts": 4, "dspark_n_activated_experts": 2, "max_seq_len": 4096, "dtype": "fp8",
    "expert_dtype": "fp4", "bos_token_id": 0, "eos_token_id": 1,
}


def engram_rows_floor(max_ngram: int, n_heads: int, vocab: int) -> int:
    """Fewest table rows an Engram layer can have: ``(max_ngram - 1) * n_heads`` bucket primes, each at least
    ``vocab`` (``engram.bucket_primes``)."""
    return (max_ngram - 1) * n_heads * max(vocab, 2)


def _bad(key: str, value: Any, why: str) -> ValueError:
    return ValueError(f"config.json: {key} = {reprlib.repr(value)} {why}")


@dataclass(frozen=True)
class DeepseekV41Config:
    """Resolved DeepSeek-V4.1 hyper-parameters (the reference's ``ModelArgs`` names; dims in elements).

    ``compress_ratios`` has one entry per layer, backbone then DSpark stages (missing DSpark entries are 0):
    0 = sliding window only, 1 or 2 = compressed KV. Only ``kv_source_layers`` compress; every other compressed
    layer reads the latest KV source above it, and the latest index source's top-k (``kv_source_of`` /
    ``index_source_of``).
    """

    vocab_size: int
    dim: int
    moe_inter_dim: int
    n_layers: int
    n_mtp_layers: int
    n_heads: int
    n_routed_experts: int
    n_shared_experts: int
    n_activated_experts: int
    score_func: str
    gate_temp: float
    norm_topk_prob: bool
    route_scale: float
    swiglu_limit: float
    q_lora_rank: int
    head_dim: int
    rope_head_dim: int
    norm_eps: float
    o_groups: int
    o_lora_rank: int
    window_size: int
    compress_ratios: tuple[int, ...]
    kv_source_layers: tuple[int, ...]
    index_source_layers: tuple[int, ...]
    compress_rope_theta: float
    original_seq_len: int
    rope_theta: float
    rope_factor: float
    beta_fast: int
    beta_slow: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    candidate_source_layer: int
    candidate_topk_blocks: int
    candidate_block_size: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    engram_layer_ids: tuple[int, ...]
    engram_num_embeddings: tuple[int, ...]
    engram_max_ngram_size: int
    engram_vocab_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_pad_id: int
    engram_compressed_vocab_size: int
    dspark_block_size: int
    dspark_noise_token_id: int
    dspark_target_layer_ids: tuple[int, ...]
    dspark_markov_rank: int
    dspark_n_routed_experts: int
    dspark_n_activated_experts: int
    max_seq_len: int
    dtype: str
    expert_dtype: str | None
    vision_n_layers: int
    image_token_id: int
    bos_token_id: int
    eos_token_id: int

    # ---- what the engine reads (``LLM``: context limit, EOS, family) ------------------------------------------
    @property
    def max_position_embeddings(self) -> int:
        return self.max_seq_len

    @property
    def num_hidden_layers(self) -> int:
        return self.n_layers

    @property
    def hidden_size(self) -> int:
        return self.dim

    @property
    def extra(self) -> dict:
        return {"model_type": MODEL_TYPE}

    # ---- derived topology ---------------------------------------------------------------------------------------
    @property
    def num_dspark_layers(self) -> int:
        return self.n_mtp_layers if self.dspark_block_size else 0

    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer] if layer < len(self.compress_ratios) else 0

    def kv_source_of(self, layer: int) -> int | None:
        """The KV-source layer whose compressed KV ``layer`` attends to (None for a ratio-0 or DSpark layer)."""
        if layer >= self.n_layers or self.ratio(layer) == 0:
            return None
        srcs = [s for s in self.kv_source_layers if s <= layer]
        return srcs[-1] if srcs else None

    def index_source_of(self, layer: int) -> int | None:
        """The index-source layer whose top-k ``layer`` uses (itself for an index source)."""
        if layer >= self.n_layers or self.ratio(layer) == 0:
            return None
        srcs = [s for s in self.index_source_layers if s <= layer]
        return srcs[-1] if srcs else None

    def uses_candidates(self, layer: int) -> bool:
        return layer in self.index_source_layers and 0 <= self.candidate_source_layer < layer

    def moe_experts(self, layer: int) -> tuple[int, int]:
        """(routed experts, activated) of a backbone layer or a DSpark stage."""
        if layer < self.n_layers:
            return self.n_routed_experts, self.n_activated_experts
        return (self.dspark_n_routed_experts or self.n_routed_experts,
                self.dspark_n_activated_experts or self.n_activated_experts)

    def block_type(self, layer: int) -> str:
        """The golden data's block-type names (``extra.json`` ``layers[].block_type``)."""
        if layer >= self.n_layers:
            return "dspark"
        if self.ratio(layer) == 0:
            return "swa_only"
        if layer in self.kv_source_layers:
            if layer == self.candidate_source_layer:
                return "candidate_source"
            return "kv_index_source"
        if layer in self.index_source_layers:
            return "candidate_index_source" if self.uses_candidates(layer) else "index_source"
        return f"consumer_ratio{self.ratio(layer)}"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["model_type"] = MODEL_TYPE
        return d

    # ---- parsing ------------------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: Any) -> "DeepseekV41Config":
        """Parse either layout. Raises ValueError naming the bad key."""
        if not isinstance(raw, dict):
            raise ValueError(f"config.json: expected a JSON object, got {type(raw).__name__}")
        mt = raw.get("model_type", MODEL_TYPE)
        if mt not in (MODEL_TYPE, "deepseek_v41_text"):
            raise _bad("model_type", mt, f"is not {MODEL_TYPE!r}")
        src = raw
        if "text_config" in raw:
            src = raw["text_config"]
            if not isinstance(src, dict):
                raise _bad("text_config", src, "must be a JSON object")
        d: dict[str, Any] = {}
        for k, v in src.items():
            d[HF_NAMES.get(k, k)] = v
        for k in ("bos_token_id", "eos_token_id"):  # the released layout may keep them at the top level
            if k not in d and k in raw:
                d[k] = raw[k]
        rs = d.pop("rope_scaling", None)
        if isinstance(rs, dict):
            for hf, ours in (("factor", "rope_factor"), ("original_max_position_embeddings", "original_seq_len"),
                             ("beta_fast", "beta_fast"), ("beta_slow", "beta_slow")):
                if hf in rs and ours not in d:
                    d[ours] = rs[hf]
        elif rs is not None:
            raise _bad("rope_scaling", rs, "must be a JSON object")
        if "routed_scaling_factor" in src and "route_scale" not in src:
            d["route_scale"] = src["routed_scaling_factor"]
        for k in _REQUIRED:
            if k not in d:
                raise ValueError(f"config.json: required key {k!r} is missing")
        vals: dict[str, Any] = {}
        for f in cls.__dataclass_fields__:
            vals[f] = d.get(f, _DEFAULTS.get(f))
        for k in INT_LIMITS:
            if k in vals:
                vals[k] = _int(k, vals[k])
        for k in FLOAT_LIMITS:
            if k in vals:
                vals[k] = _float(k, vals[k])
        for k in _LISTS:
            vals[k] = _int_list(k, vals[k])
        if vals["candidate_source_layer"] is None:
            vals["candidate_source_layer"] = -1
        vals["candidate_source_layer"] = _int("candidate_source_layer", vals["candidate_source_layer"], lo=-1)
        if not isinstance(vals["norm_topk_prob"], bool):
            raise _bad("norm_topk_prob", vals["norm_topk_prob"], "must be true or false")
        cfg = cls(**vals)
        cfg._validate()
        return cfg

    def _validate(self) -> None:
        c = self
        if c.score_func not in SCORE_FUNCS:
            raise _bad("score_func", c.score_func, f"is not one of {SCORE_FUNCS}")
        for k in ("bos_token_id", "eos_token_id"):
            if getattr(c, k) >= c.vocab_size:
                raise _bad(k, getattr(c, k), f"is not a token id (vocab {c.vocab_size})")
        if c.dtype not in ("fp8", "bf16"):
            raise _bad("dtype", c.dtype, "must be 'fp8' or 'bf16'")
        if c.expert_dtype not in ("fp4", None):
            raise _bad("expert_dtype", c.expert_dtype, "must be 'fp4' or null")
        for k in ("dim", "moe_inter_dim", "q_lora_rank", "head_dim", "index_head_dim"):
            if getattr(c, k) % 32:
                raise _bad(k, getattr(c, k), "must be a multiple of 32 (the quantisation group)")
        if c.rope_head_dim % 2 or c.rope_head_dim > min(c.head_dim, c.index_head_dim):
            raise _bad("rope_head_dim", c.rope_head_dim, "must be even and <= head_dim and index_head_dim")
        if c.n_heads % c.o_groups:
            raise _bad("o_groups", c.o_groups, f"must divide n_heads = {c.n_heads}")
        if (c.o_groups * c.o_lora_rank) % 32:
            raise _bad("o_lora_rank", c.o_lora_rank, f"times o_groups ({c.o_groups}) must be a multiple of 32 (the "
                       "input width of the FP8 wo_b)")
        if c.n_activated_experts > c.n_routed_experts:
            raise _bad("n_activated_experts", c.n_activated_experts, f"exceeds n_routed_experts = {c.n_routed_experts}")
        total = c.n_layers + c.n_mtp_layers
        if len(c.compress_ratios) not in (c.n_layers, total):
            raise _bad("compress_ratios", c.compress_ratios, f"must have n_layers ({c.n_layers}) or n_layers + "
                       f"n_mtp_layers ({total}) entries")
        for i, r in enumerate(c.compress_ratios):
            if r not in (0, 1, 2):
                raise _bad(f"compress_ratios[{i}]", r, "must be 0, 1 or 2")
            if i >= c.n_layers and r:
                raise _bad(f"compress_ratios[{i}]", r, "must be 0 for a DSpark stage (window-only attention)")
        for key in ("kv_source_layers", "index_source_layers"):
            srcs = getattr(c, key)
            if list(srcs) != sorted(set(srcs)):
                raise _bad(key, srcs, "must be strictly increasing")
            for s in srcs:
                if not 0 <= s < c.n_layers or c.compress_ratios[s] == 0:
                    raise _bad(key, srcs, f"names layer {s}, which is not a compressed backbone layer")
        for L in range(c.n_layers):
            if c.ratio(L) == 0:
                continue
            for key, src in (("kv_source_layers", c.kv_source_of(L)), ("index_source_layers", c.index_source_of(L))):
                if src is None:
                    raise _bad(key, getattr(c, key), f"has no source at or before compressed layer {L}")
                if c.ratio(src) != c.ratio(L):
                    raise _bad(key, getattr(c, key), f"gives layer {L} (ratio {c.ratio(L)}) the source {src} "
                               f"(ratio {c.ratio(src)})")
        for M in c.index_source_layers:
            if c.kv_source_of(M) not in c.index_source_layers:
                raise _bad("index_source_layers", c.index_source_layers, f"has layer {M}, whose KV source "
                           f"{c.kv_source_of(M)} runs no indexer and so owns no index keys")
        if c.index_topk > c.max_seq_len:
            raise _bad("index_topk", c.index_topk, f"exceeds max_seq_len = {c.max_seq_len}")
        if c.candidate_source_layer >= 0:
            L = c.candidate_source_layer
            if L not in c.index_source_layers or L not in c.kv_source_layers:
                raise _bad("candidate_source_layer", L, "must be both a KV source and an index source")
            if c.candidate_topk_blocks < 1 or c.candidate_block_size < 1:
                raise _bad("candidate_topk_blocks", c.candidate_topk_blocks,
                           "and candidate_block_size must be >= 1 with a candidate source")
            for M in c.index_source_layers:
                if M > L and c.ratio(M) != c.ratio(L):
                    raise _bad("candidate_source_layer", L, f"has ratio {c.ratio(L)} but index source {M} uses "
                               f"its candidates at ratio {c.ratio(M)}")
        if c.engram_layer_ids:
            if len(c.engram_num_embeddings) != len(c.engram_layer_ids):
                raise _bad("engram_num_embeddings", c.engram_num_embeddings,
                           f"must have one entry per engram layer ({len(c.engram_layer_ids)})")
            for L in c.engram_layer_ids:
                if not 0 <= L < c.n_layers:
                    raise _bad("engram_layer_ids", c.engram_layer_ids, f"names layer {L} outside the backbone")
            for k in ("engram_n_heads", "engram_head_dim", "engram_compressed_vocab_size"):
                if getattr(c, k) < 1:
                    raise _bad(k, getattr(c, k), "must be >= 1 with engram layers")
            if c.engram_max_ngram_size < 2:
                raise _bad("engram_max_ngram_size", c.engram_max_ngram_size, "must be >= 2 with engram layers")
            if c.engram_head_dim % 32:
                raise _bad("engram_head_dim", c.engram_head_dim, "must be a multiple of 32 (its FP8 scale group)")
            if not 0 <= c.engram_pad_id < c.vocab_size:
                raise _bad("engram_pad_id", c.engram_pad_id, f"is not a token id (vocab {c.vocab_size})")
            least = engram_rows_floor(c.engram_max_ngram_size, c.engram_n_heads, c.engram_vocab_size)
            for i, rows in enumerate(c.engram_num_embeddings):  # every bucket prime is >= engram_vocab_size
                if rows < least:
                    raise _bad(f"engram_num_embeddings[{i}]", rows, f"is below (engram_max_ngram_size - 1) * "
                               f"engram_n_heads * engram_vocab_size = {least}: the bucket primes cannot fit")
        if c.dspark_block_size:
            if c.n_mtp_layers < 1:
                raise _bad("n_mtp_layers", c.n_mtp_layers, "must be >= 1 with a DSpark head")
            if not c.dspark_target_layer_ids:
                raise _bad("dspark_target_layer_ids", c.dspark_target_layer_ids, "is empty with a DSpark head")
            for L in c.dspark_target_layer_ids:
                if not 0 <= L < c.n_layers:
                    raise _bad("dspark_target_layer_ids", c.dspark_target_layer_ids, f"names layer {L} outside "
                               "the backbone")
            if not 0 <= c.dspark_noise_token_id < c.vocab_size:
                raise _bad("dspark_noise_token_id", c.dspark_noise_token_id, f"is not a token id ({c.vocab_size})")
            e, k = c.moe_experts(c.n_layers)
            if k > e:
                raise _bad("dspark_n_activated_experts", k, f"exceeds the DSpark expert count {e}")


def _int(key: str, v: Any, lo: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not v.is_integer()):
        raise _bad(key, v, "must be an integer")
    v = int(v)
    a, b = INT_LIMITS.get(key, (lo if lo is not None else 0, 1 << 24))
    if lo is not None:
        a = lo
    if not a <= v <= b:
        raise _bad(key, v, f"is outside [{a}, {b}]")
    return v


def _float(key: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise _bad(key, v, "must be a finite number")
    a, b = FLOAT_LIMITS[key]
    if not a < v <= b:
        raise _bad(key, v, f"is outside ({a}, {b}]")
    return float(v)


def _int_list(key: str, v: Any) -> tuple[int, ...]:
    if v is None:
        return ()
    if not isinstance(v, (list, tuple)) or len(v) > 4096:
        raise _bad(key, v, "must be a list of at most 4096 integers")
    out = []
    for i, x in enumerate(v):
        if isinstance(x, bool) or not isinstance(x, int) or not 0 <= x < (1 << 40):
            raise _bad(f"{key}[{i}]", x, "must be a non-negative integer")
        out.append(x)
    return tuple(out)
