"""DeepSeek-V4 config parsing (legacy + transformers keys, errors naming the key) and the parameter inventory."""

from __future__ import annotations

import copy

import pytest
import torch

from deepinfer.models import (
    KINDS,
    TINY_CONFIG,
    CacheSpec,
    DeepseekV4Config,
    allocate_cache,
    expected_parameters,
    init_parameters,
)
from deepinfer.models.deepseek_v4.config import CSA, HASH_MOE, HCA, MOE, SLIDING
from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM, rope_inv_freq


def _tiny() -> DeepseekV4Config:
    return DeepseekV4Config.from_dict(TINY_CONFIG)


def test_tiny_has_every_layer_type_and_real_ratios():
    c = _tiny()
    assert set(c.layer_types) == {SLIDING, CSA, HCA}
    assert set(c.mlp_layer_types) == {HASH_MOE, MOE}
    assert (c.compress_rate_csa, c.compress_rate_hca, c.sliding_window) == (4, 128, 128)
    assert c.vocab_size == 129280 and c.num_nextn_predict_layers == 1
    assert c.rope_scaling is not None and c.rope_scaling["factor"] == 16


def test_transformers_keys_equal_legacy_keys():
    legacy = _tiny()
    hf = copy.deepcopy(TINY_CONFIG)
    for k in ("compress_ratios", "num_hash_layers", "qk_rope_head_dim", "rope_scaling"):
        hf.pop(k)
    hf["layer_types"] = list(legacy.layer_types)
    hf["mlp_layer_types"] = list(legacy.mlp_layer_types)
    hf["partial_rotary_factor"] = legacy.qk_rope_head_dim / legacy.head_dim
    hf["rope_parameters"] = {
        "main": {"rope_type": "default", "rope_theta": 10000.0},
        "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 16,
                     "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1,
                     "attention_factor": 1.0},
    }
    parsed = DeepseekV4Config.from_dict(hf)
    # the MTP layer's ratio is only in the legacy list; everything else must agree
    assert parsed.to_dict() | {"mtp_compress_ratios": ()} == legacy.to_dict() | {"mtp_compress_ratios": ()}
    assert parsed.mtp_compress_ratios == (0,)


def test_config_json_round_trip_and_transformers_reads_it():
    c = _tiny()
    assert DeepseekV4Config.from_dict(c.to_config_json()) == c
    transformers = pytest.importorskip("transformers")
    hf = transformers.DeepseekV4Config(**{k: v for k, v in c.to_config_json().items() if k not in ("architectures", "model_type")})
    assert list(hf.layer_types) == list(c.layer_types)
    assert list(hf.mlp_layer_types) == list(c.mlp_layer_types)
    assert hf.qk_rope_head_dim == c.qk_rope_head_dim


@pytest.mark.parametrize(
    "key, value",
    [
        ("hidden_size", None),  # removed -> missing
        ("vocab_size", "many"),
        ("num_hidden_layers", 0),
        ("compress_ratios", [0, 4, 64, 4, 0]),
        ("compress_ratios", [0, 4]),
        ("scoring_func", "relu"),
        ("qk_rope_head_dim", 33),
        ("rope_scaling", {"type": "linear", "factor": 2}),
        ("rope_scaling", {"type": "yarn", "factor": 16}),
        ("o_groups", 3),
        ("num_experts_per_tok", 9),
        ("hidden_act", "gelu"),
        ("num_key_value_heads", 2),
        ("rms_norm_eps", -1.0),
    ],
)
def test_bad_config_names_the_key(key, value):
    d = copy.deepcopy(TINY_CONFIG)
    if value is None:
        d.pop(key)
    else:
        d[key] = value
    with pytest.raises(ValueError) as e:
        DeepseekV4Config.from_dict(d)
    name = {"o_groups": "o_groups", "num_experts_per_tok": "num_experts_per_tok"}.get(key, key)
    assert name in str(e.value)


def test_missing_compress_ratios_named():
    d = copy.deepcopy(TINY_CONFIG)
    d.pop("compress_ratios")
    with pytest.raises(ValueError, match="compress_ratios"):
        DeepseekV4Config.from_dict(d)


def test_expected_parameters_match_model_state_dict_one_to_one():
    c = _tiny()
    spec = expected_parameters(c)
    model = DeepseekV4ForCausalLM(c)
    sd = model.state_dict()
    assert sorted(sd) == sorted(spec), "model names must be exactly the native checkpoint names"
    for name, (shape, kind) in spec.items():
        assert tuple(sd[name].shape) == tuple(shape), name
        assert kind in KINDS
    # a few native names the loader relies on
    for n in ("embed.weight", "head.weight", "hc_head_fn", "layers.1.attn.indexer.compressor.ape",
              "layers.2.attn.compressor.wkv.weight", "layers.0.ffn.gate.tid2eid", "layers.3.ffn.gate.bias",
              "layers.0.ffn.experts.7.w2.weight", "mtp.0.e_proj.weight", "mtp.0.hc_head_scale", "mtp.0.attn.attn_sink"):
        assert n in spec, n
    assert "layers.0.attn.compressor.wkv.weight" not in spec  # sliding layer: no compressor
    assert "layers.2.attn.indexer.wq_b.weight" not in spec  # HCA: no indexer
    assert spec["layers.1.attn.compressor.wkv.weight"][0] == (2 * c.head_dim, c.hidden_size)  # CSA overlap
    assert spec["layers.2.attn.compressor.ape"][0] == (128, c.head_dim)
    assert spec["layers.0.ffn.experts.0.w1.weight"][1] == "expert_linear"
    assert spec["layers.0.attn.wq_a.weight"][1] == "dense_linear"
    assert spec["layers.0.hc_attn_fn"][1] == "fp32" and spec["layers.0.attn.attn_sink"][1] == "fp32"


def test_init_parameters_deterministic_and_nothing_left_at_zero():
    c = _tiny()
    a, b = init_parameters(c, 0), init_parameters(c, 0)
    other = init_parameters(c, 1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["layers.0.attn.wq_a.weight"], other["layers.0.attn.wq_a.weight"])
    for name, t in a.items():
        if t.is_floating_point():
            assert torch.isfinite(t).all(), name
            assert (t != 0).float().mean() > 0.99, f"{name} is (mostly) zero"
    for name in (n for n in a if n.endswith("tid2eid")):
        t = a[name]
        assert t.dtype == torch.int64 and t.min() >= 0 and t.max() < c.n_routed_experts
        assert (t.sort(dim=-1).values.diff(dim=-1) > 0).all(), f"{name}: experts of a row must be distinct"
    assert a["layers.0.attn.attn_sink"].abs().min() > 0
    assert a["layers.1.attn.compressor.ape"].std() > 0.1


def test_model_load_rejects_bad_tensors():
    c = _tiny()
    p = init_parameters(c, 0)
    model = DeepseekV4ForCausalLM(c)
    q = dict(p)
    q.pop("layers.1.attn.indexer.wq_b.weight")
    with pytest.raises(ValueError, match="layers.1.attn.indexer.wq_b.weight"):
        model.load_native(q)
    q = dict(p)
    q["layers.0.attn.wkv.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="layers.0.attn.wkv.weight"):
        model.load_native(q)
    q = dict(p)
    q["layers.0.attn.bogus"] = torch.zeros(1)
    with pytest.raises(ValueError, match="bogus"):
        model.load_native(q)


def test_yarn_inv_freq_matches_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    c = _tiny()
    hf = transformers.DeepseekV4Config(**{k: v for k, v in c.to_config_json().items() if k not in ("architectures", "model_type")})
    ref, factor = ROPE_INIT_FUNCTIONS["yarn"](hf, None, layer_type="compress")
    assert factor == 1.0
    assert torch.equal(rope_inv_freq(c, "compress"), ref)
    main = 1.0 / (c.rope_theta ** (torch.arange(0, c.qk_rope_head_dim, 2, dtype=torch.float) / c.qk_rope_head_dim))
    assert torch.equal(rope_inv_freq(c, "main"), main)
    assert not torch.allclose(rope_inv_freq(c, "compress"), rope_inv_freq(c, "main"))


def test_cache_spec_bytes_per_block():
    c = _tiny()
    spec = CacheSpec.from_config(c, torch.float32)
    hd, ihd = c.head_dim, c.index_head_dim
    sliding = 128 * hd
    csa = 128 * hd + 32 * hd + 2 * (8 * 2 * hd) + 32 * ihd + 2 * (8 * 2 * ihd)
    hca = 128 * hd + 1 * hd + 2 * (128 * hd)
    # layers: sliding, CSA, HCA, CSA + MTP sliding
    assert spec.bytes_per_block == 4 * (sliding + csa + hca + csa + sliding)
    cache = allocate_cache(c, 3, "cpu", torch.float32)
    assert cache.nbytes == 3 * spec.bytes_per_block
    with pytest.raises(ValueError, match="num_blocks"):
        allocate_cache(c, -1)
