"""DeepSeek-V4.1 config parsing, parameter inventory and native checkpoint errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from deepinfer.checkpoint import CheckpointError
from deepinfer.models.deepseek_v41 import DeepseekV41Config, expected_parameters, load_weights
from deepinfer.models.deepseek_v41.quant import (DequantWeight, QWeight, act_quant_fp8, dq_linear, e2m1_codes, fp4_qdq_,
                                                 qlinear, requant_128, unpack_fp4)

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO.parent / "shared" / "reference" / "v41-golden"
needs_golden = pytest.mark.skipif(not GOLDEN.is_dir(), reason=f"golden V4.1 data not found at {GOLDEN}")

FLAT = {
    "vocab_size": 512, "dim": 256, "moe_inter_dim": 128, "n_layers": 6, "n_mtp_layers": 1, "n_heads": 4,
    "n_routed_experts": 4, "n_shared_experts": 1, "n_activated_experts": 2, "score_func": "sqrtsoftplus",
    "route_scale": 1.5, "swiglu_limit": 10.0, "q_lora_rank": 64, "head_dim": 64, "rope_head_dim": 16,
    "norm_eps": 1e-20, "o_groups": 2, "o_lora_rank": 64, "window_size": 16, "compress_ratios": [0, 2, 2, 1, 1, 1, 0],
    "kv_source_layers": [1, 3], "index_source_layers": [1, 3, 5], "compress_rope_theta": 160000.0,
    "original_seq_len": 32, "rope_factor": 4, "index_n_heads": 4, "index_head_dim": 64, "index_topk": 8,
    "candidate_source_layer": 3, "candidate_topk_blocks": 3, "candidate_block_size": 4, "max_seq_len": 128,
    "dspark_block_size": 2, "dspark_noise_token_id": 511, "dspark_target_layer_ids": [4, 5],
    "dspark_markov_rank": 32,
}


def test_flat_layout_roles():
    c = DeepseekV41Config.from_dict(FLAT)
    assert [c.block_type(i) for i in range(7)] == ["swa_only", "kv_index_source", "consumer_ratio2",
                                                   "candidate_source", "consumer_ratio1", "candidate_index_source",
                                                   "dspark"]
    assert [c.kv_source_of(i) for i in range(6)] == [None, 1, 1, 3, 3, 3]
    assert [c.index_source_of(i) for i in range(6)] == [None, 1, 1, 3, 3, 5]
    assert c.norm_eps == 1e-20 and c.num_dspark_layers == 1


def test_text_config_layout_equals_flat():
    hf = {"hidden_size": 256, "num_hidden_layers": 6, "num_attention_heads": 4, "moe_intermediate_size": 128,
          "num_experts_per_tok": 2, "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5,
          "rms_norm_eps": 1e-20, "sliding_window": 16, "kv_source_layer_ids": [1, 3],
          "index_source_layer_ids": [1, 3, 5], "candidate_source_layer_id": 3, "qk_rope_head_dim": 16,
          "num_nextn_predict_layers": 1, "max_position_embeddings": 128,
          "rope_scaling": {"factor": 4, "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1}}
    text = {k: v for k, v in FLAT.items() if k not in (
        "dim", "n_layers", "n_heads", "moe_inter_dim", "n_activated_experts", "score_func", "route_scale", "norm_eps",
        "window_size", "kv_source_layers", "index_source_layers", "candidate_source_layer", "rope_head_dim",
        "n_mtp_layers", "max_seq_len", "rope_factor", "original_seq_len")}
    text.update(hf)
    got = DeepseekV41Config.from_dict({"model_type": "deepseek_v41", "text_config": text, "vision_config": {}})
    assert got == DeepseekV41Config.from_dict(FLAT)


@pytest.mark.parametrize("key,value,needle", [
    ("compress_ratios", [0, 4, 2, 1, 1, 1, 0], "compress_ratios[1]"),
    ("compress_ratios", [0, 2, 2, 1], "compress_ratios"),
    ("kv_source_layers", [0, 3], "kv_source_layers"),
    ("kv_source_layers", [3], "kv_source_layers"),
    ("index_source_layers", [1, 3, 4, 5], None),
    ("candidate_source_layer", 5, "candidate_source_layer"),
    ("dim", 250, "dim"),
    ("n_activated_experts", 9, "n_activated_experts"),
    ("score_func", "relu", "score_func"),
    ("norm_eps", -1.0, "norm_eps"),
    ("o_groups", 3, "o_groups"),
    ("o_lora_rank", 20, "o_lora_rank"),
    ("dspark_target_layer_ids", [9], "dspark_target_layer_ids"),
    ("window_size", "16", "window_size"),
    ("model_type", "deepseek_v4", "model_type"),
])
def test_bad_fields_are_named(key, value, needle):
    d = dict(FLAT, **{key: value})
    if needle is None:  # a valid variant: layer 4 becomes an index source of its own
        DeepseekV41Config.from_dict(d)
        return
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        DeepseekV41Config.from_dict(d)


def test_missing_key_named():
    d = dict(FLAT)
    del d["index_topk"]
    with pytest.raises(ValueError, match="index_topk"):
        DeepseekV41Config.from_dict(d)


def test_inventory_kinds():
    spec = expected_parameters(DeepseekV41Config.from_dict(FLAT))
    assert spec["layers.1.attn.compressor.wkv.weight"] == ((64, 256), "f32")
    assert spec["layers.3.attn.compressor.wkv.weight"] == ((64, 256), "bf16")
    assert "layers.5.attn.indexer.wk.weight" not in spec and "layers.5.attn.indexer.wq_b.weight" in spec
    assert "layers.2.attn.indexer.wq_b.weight" not in spec and "layers.2.attn.compressor.norm.weight" not in spec
    assert spec["layers.0.ffn.experts.3.w2.weight"] == ((256, 128), "fp4")
    assert spec["mtp.0.main_proj.weight"] == ((256, 512), "fp8")


# ---- quantisation recipe ----------------------------------------------------------------------------------------
def test_e2m1_round_half_even_and_unpack():
    v = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, 6.0, 0.0, -0.0])
    codes = e2m1_codes(v)
    assert codes.tolist() == [0, 2, 2, 4, 4, 6, 6, 10, 7, 0, 8]
    b = torch.tensor([[0x21, 0xF7]], dtype=torch.uint8)  # low nibble = even column
    assert unpack_fp4(b).tolist() == [[0.5, 1.0, 6.0, -6.0]]


def test_act_quant_scale_is_pow2_ceil():
    x = torch.tensor([[448.0] + [0.0] * 31, [500.0] + [1.0] * 31, [0.0] * 32]).bfloat16()
    q, s = act_quant_fp8(x)
    assert s.flatten().tolist() == [1.0, 2.0, 2.0 ** -22]  # amax floored at 1e-4: 2^ceil(log2(1e-4 / 448))
    assert q[0, 0].item() == 448.0 and q[1, 1].item() == 0.5


def test_fp4_qdq_e4m3_scale_idempotent():
    torch.manual_seed(0)
    x = torch.randn(4, 64).bfloat16()
    y = fp4_qdq_(x.clone(), 16, True)
    assert torch.equal(fp4_qdq_(y.clone(), 16, True), y)


def test_requant_128_is_lossy_where_tile_scales_differ():
    w = torch.ones(128, 128)
    w[:32, :32] = 1.125  # 3 mantissa bits: 1.125 * 2^-12 has too few bits left in a scale sized for 1.0
    w = w.to(torch.float8_e4m3fn)
    s = torch.full((4, 4), 127, dtype=torch.uint8)
    s[0, 0] = 127 - 12  # one 32x32 tile 2^-12 smaller
    qw = QWeight.from_fp8(w, s)
    q, sc = requant_128(qw)
    back = q.float() * sc.repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert not torch.equal(back, qw.dequant())  # the small tile underflows in the shared 128x128 scale


@pytest.mark.parametrize("kind", ["fp8", "fp4"])
def test_dequant_weight_is_exact_and_dq_linear_matches_qlinear(kind):
    """The GPU path's weight (run here on the CPU): bf16 dequantisation is exact, and its GEMM equals the exact
    block-scaled one up to float32 summation order and one bf16 rounding of the output."""
    g = torch.Generator().manual_seed(3)
    n, k = 96, 160
    if kind == "fp8":
        w = (torch.randn(n, k, generator=g) * 40).to(torch.float8_e4m3fn)
        s = torch.randint(118, 128, (n // 32, k // 32), dtype=torch.uint8, generator=g)
        qw = QWeight.from_fp8(w, s)
    else:
        w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
        qw = QWeight.from_fp4(w, torch.randint(118, 128, (n, k // 32), dtype=torch.uint8, generator=g))
    dw = DequantWeight(qw, "cpu")
    assert dw.shape == (n, k) and dw.weight.dtype == torch.bfloat16
    assert torch.equal(dw.weight.float(), qw.dequant())
    x = (torch.randn(7, k, generator=g) * 3).to(torch.bfloat16)
    ref, got = qlinear(x, qw).float(), dq_linear(x, dw).float()
    assert got.shape == ref.shape == (7, n)
    assert ((got - ref).abs() <= 2 ** -7 * ref.abs() + 1e-3 * ref.abs().max()).all()


def test_engram_rows_too_few_for_the_bucket_primes_are_refused_before_any_search():
    from deepinfer.presets import preset_config

    d = preset_config("tiny-v41")
    d["engram_vocab_size"] = 1 << 40  # a prime search that far up would take hours
    with pytest.raises(ValueError, match=r"engram_num_embeddings\[0\]"):
        DeepseekV41Config.from_dict(d)


def test_dspark_alias_of_the_wrong_shape_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    from deepinfer.presets import default_model_path

    src = default_model_path(preset="tiny-v41")
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    sd = load_file(str(dst / "model.safetensors"))
    sd["mtp.0.head.weight"] = torch.zeros(3, 64)  # an alias of head.weight, of another shape
    save_file(sd, str(dst / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"mtp\.0\.head\.weight"):
        load_weights(dst)


def test_corrupt_engram_map_files_are_checkpoint_errors(tmp_path):
    from deepinfer.models.deepseek_v41.loading import load_token_map
    from deepinfer.presets import preset_config

    cfg = DeepseekV41Config.from_dict(preset_config("tiny-v41"))
    (tmp_path / "extra.safetensors").write_bytes(b"\x10" * 500)
    with pytest.raises(CheckpointError, match="extra.safetensors"):
        load_token_map(tmp_path, cfg)
    (tmp_path / "extra.safetensors").unlink()
    (tmp_path / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        load_token_map(tmp_path, cfg)


def test_from_checkpoint_names_bad_device_and_gemm(tmp_path):
    from deepinfer.models.deepseek_v41 import DeepseekV41ForCausalLM
    from deepinfer.models.deepseek_v41.loading import check_device_memory, device_bytes

    from deepinfer.presets import preset_config

    cfg = DeepseekV41Config.from_dict(preset_config("tiny-v41"))
    assert device_bytes(cfg, True) < device_bytes(cfg, False)  # bf16 dequantised linears, float32 exact values
    check_device_memory(cfg, torch.device("cpu"))  # the CPU is not checked
    for dev in ("meta", "bogus", "cuda:7", 3.5):
        with pytest.raises(ValueError, match="device"):
            DeepseekV41ForCausalLM.from_checkpoint(tmp_path, device=dev)
    for bad in ("fp8", None, 3):
        with pytest.raises(ValueError, match="gemm"):
            DeepseekV41ForCausalLM.from_checkpoint(tmp_path, device="cpu", gemm=bad)


# ---- checkpoint errors -------------------------------------------------------------------------------------------
def _copy_with(tmp: Path, edit) -> Path:
    from safetensors.torch import load_file, save_file

    src = GOLDEN / "small-seed0-noengram"
    dst = tmp / "ckpt"
    dst.mkdir()
    shutil.copy(src / "config.json", dst / "config.json")
    sd = load_file(str(src / "model.safetensors"))
    edit(sd)
    save_file(sd, str(dst / "model.safetensors"))
    return dst


@needs_golden
@pytest.mark.parametrize("edit,needle", [
    (lambda sd: sd.pop("layers.2.attn.wq_a.weight"), "layers.2.attn.wq_a.weight"),
    (lambda sd: sd.pop("layers.2.attn.wq_a.scale"), "layers.2.attn.wq_a.scale"),
    (lambda sd: sd.__setitem__("layers.2.attn.wq_a.scale", sd["layers.2.attn.wq_a.scale"][:1].clone()),
     "layers.2.attn.wq_a.scale"),
    (lambda sd: sd.__setitem__("head.weight", sd["head.weight"].bfloat16()), "head.weight"),
    (lambda sd: sd.__setitem__("layers.0.ffn.experts.1.w1.weight", torch.zeros(128, 256, dtype=torch.bfloat16)),
     "layers.0.ffn.experts.1.w1.weight"),
    (lambda sd: sd.__setitem__("layers.9.attn.extra", torch.zeros(1)), "layers.9.attn.extra"),
    (lambda sd: sd["layers.1.attn.attn_sink"].fill_(float("nan")), "layers.1.attn.attn_sink"),
    (lambda sd: sd["layers.1.attn.wkv.scale"].view(torch.uint8).fill_(255), "layers.1.attn.wkv.scale"),
    (lambda sd: sd["layers.1.attn.wkv.scale"].view(torch.uint8).fill_(254), "layers.1.attn.wkv.scale"),  # overflows
])
def test_bad_checkpoint_names_tensor(tmp_path, edit, needle):
    path = _copy_with(tmp_path, edit)
    with pytest.raises(CheckpointError, match=needle.replace(".", r"\.")):
        load_weights(path)


@needs_golden
def test_bad_config_file_named(tmp_path):
    path = _copy_with(tmp_path, lambda sd: None)
    cfg = json.loads((path / "config.json").read_text())
    cfg["index_topk"] = 0
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="config.json.*index_topk"):
        load_weights(path)


# ---- tokenizer and request encoding ------------------------------------------------------------------------------
def test_tokenizer_rebuild_matches_official_sha(tmp_path):
    import hashlib

    from deepinfer.models.deepseek_v41.tokenizer import V41_TOKENIZER_SHA256, ensure_tokenizer

    p = ensure_tokenizer(tmp_path)
    data = p.read_bytes()
    assert hashlib.sha256(data).hexdigest() == V41_TOKENIZER_SHA256
    official = REPO.parent / "shared" / "reference" / "tokenizers" / "deepseek-v4.1-flash" / "tokenizer.json"
    if official.is_file():
        assert data == official.read_bytes()


def test_encode_chat_v41_and_image_error(tmp_path):
    from deepinfer.models.deepseek_v41.tokenizer import encode_chat, ensure_tokenizer

    tok = ensure_tokenizer(tmp_path)
    ids = encode_chat({"model": "DeepSeek-V4.1-Flash", "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <think>"}]}, tok)
    assert ids[:2] == [0, 128799] and 128803 in ids and ids[-2:] == [128804, 128821]
    assert ids.count(128821) == 1  # the user's "<think>" stays text
    body = {"model": "DeepSeek-V4.1-Flash", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[1\].*image"):
        encode_chat(body, tok)
