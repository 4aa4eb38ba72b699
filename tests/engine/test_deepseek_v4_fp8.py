"""The FP8 GEMM path of DeepSeek-V4 (``gemm="fp8"``) on the CPU: what the load keeps (the checkpoint's FP8 bytes,
FP4 experts converted, experts stacked, nothing dequantised next to it), the building blocks against their recipe,
and the tiny model's logits against the dequantised path within the tolerances stated in fp8_check.py.

The CPU FP8 ops are reference implementations (row by row), so these tests stay small; the same comparison runs on
CUDA in test_deepseek_v4_cuda.py and batch invariance of both paths in test_batch_invariant.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

import deepinfer_ops
from deepinfer import quantization as Q
from deepinfer.checkpoint import QuantizedWeight, load_checkpoint
from deepinfer.presets import default_model_path
from deepinfer.config import EngineConfig
from deepinfer.models.deepseek_v4.config import TINY_CONFIG, DeepseekV4Config
from deepinfer.models.deepseek_v4 import (
    DeepseekV4ForCausalLM,
    Linear,
    expected_parameters,
    fp8_block_weight,
    fp8_linear,
    init_parameters,
    resolve_gemm,
)
from deepinfer_ops.testing.compare import calc_diff
from fp8_check import check_fp8_close, per_position, record_routes

PROMPT_LENS = (1, 37, 160)  # 160: a block boundary, HCA / CSA windows close, the window slides


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


@pytest.fixture(scope="module")
def pair():
    deq = DeepseekV4ForCausalLM.from_checkpoint(None, dtype=torch.float32, device="cpu")
    fp8 = DeepseekV4ForCausalLM.from_checkpoint(None, dtype=torch.float32, device="cpu", gemm="fp8")
    return deq, fp8


def _ids(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 129280, (n,), generator=torch.Generator().manual_seed(seed))


def _dq(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return Q.dequantize_fp8_block(weight, scale)


# ---------------------------------------------------------------------------------------------------------- choice
def test_gemm_choice_resolution_and_errors():
    assert resolve_gemm("auto", "cpu") == "dequant"
    assert resolve_gemm("auto", "cuda") == "fp8"
    assert resolve_gemm("auto", None) == "dequant"
    assert resolve_gemm("fp8", "cpu") == "fp8" and resolve_gemm("dequant", "cuda") == "dequant"
    with pytest.raises(ValueError, match="gemm"):
        resolve_gemm("int4", "cpu")
    cfg = DeepseekV4Config.from_dict(copy.deepcopy(TINY_CONFIG))
    with torch.device("meta"):
        with pytest.raises(ValueError, match="gemm"):
            DeepseekV4ForCausalLM(cfg, gemm="fp4")
        assert DeepseekV4ForCausalLM(cfg).gemm == "dequant"  # nothing loaded yet
    with pytest.raises(ValueError, match="EngineConfig.gemm"):
        EngineConfig(gemm="bf16").validate()
    from deepinfer.cli import build_parser

    args = build_parser().parse_args(["generate", "--input", "a", "--output", "b", "--gemm", "fp8"])
    assert args.gemm == "fp8"
    assert build_parser().parse_args(["determinism-check"]).gemm == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--input", "a", "--output", "b", "--gemm", "fp16"])


# ------------------------------------------------------------------------------------------------------------ load
def test_fp8_load_keeps_the_checkpoint_format(pair):
    deq, fp8 = pair
    assert deq.gemm == "dequant" and fp8.gemm == "fp8"
    cfg = fp8.config
    stored = load_checkpoint(default_model_path(), dequantize=False).params
    spec = expected_parameters(cfg)
    for name, (shape, kind) in spec.items():
        if kind != "dense_linear":
            continue
        lin = fp8.get_submodule(name.rpartition(".")[0])
        assert isinstance(lin, Linear) and lin.is_fp8, name
        assert lin.weight.dtype == torch.float8_e4m3fn and tuple(lin.weight.shape) == tuple(shape), name
        qw = stored[name]
        assert isinstance(qw, QuantizedWeight) and qw.fmt == "fp8"
        assert torch.equal(lin.weight.view(torch.uint8), qw.data.view(torch.uint8)), f"{name}: FP8 bytes changed"
        assert lin.scale.dtype == torch.float32 and torch.equal(lin.scale, Q.scale_to_float(qw.scale)), name
        ref = deq.get_submodule(name.rpartition(".")[0]).weight
        assert torch.equal(_dq(lin.weight, lin.scale), ref), f"{name}: not the dequant path's values"
    # "other" weights keep their dtype and torch GEMMs
    attn = fp8.layers[1].attn
    for mod in (fp8.head, fp8.layers[1].ffn.gate, attn.compressor.wkv, attn.indexer.weights_proj):
        assert mod.weight.dtype == torch.float32
        assert not getattr(mod, "is_fp8", False)
    # routed experts: stacked, FP4 converted exactly (the tiny checkpoint's per-32 exponents lie within 14 binades),
    # I = 32 padded to 128 with zero rows / columns; no per-expert modules, no float expert copy
    E, I, D = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    moes = [blk.ffn for blk in list(fp8.layers) + list(fp8.mtp)]
    ref_moes = [blk.ffn for blk in list(deq.layers) + list(deq.mtp)]
    for moe, ref in zip(moes, ref_moes):
        assert moe.is_fp8 and len(moe.experts) == 0
        assert tuple(moe.w13.shape) == (E, 256, D) and moe.w13.dtype == torch.float8_e4m3fn
        assert tuple(moe.w2.shape) == (E, D, 128) and moe.w2.dtype == torch.float8_e4m3fn
        assert tuple(moe.w13_scale.shape) == (E, 2, 1) and tuple(moe.w2_scale.shape) == (E, 1, 1)
        for e in range(E):
            w13 = _dq(moe.w13[e], moe.w13_scale[e])
            assert torch.equal(w13[:I], ref.experts[e].w1.weight)
            assert torch.equal(w13[128:128 + I], ref.experts[e].w3.weight)
            assert torch.equal(_dq(moe.w2[e], moe.w2_scale[e])[:, :I], ref.experts[e].w2.weight)
        assert not moe.w13[:, I:128].float().any() and not moe.w13[:, 128 + I:].float().any()
        assert not moe.w2[:, :, I:].float().any()
    names = fp8.state_dict().keys()
    assert not any(".experts." in n for n in names)
    assert "layers.0.ffn.w13" in names and "layers.0.attn.wq_a.scale" in names
    floats = {n for n, p in fp8.named_parameters() if p.dtype != torch.float8_e4m3fn}
    assert not floats & {n for n, (_, k) in spec.items() if k in ("dense_linear", "expert_linear")}
    with pytest.raises(ValueError, match="already holds FP8"):
        fp8.load_native(stored)


# -------------------------------------------------------------------------------------------------- building blocks
def test_fp8_block_weight_formats():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(200, 72, generator=g) / 8  # partial 128-blocks in both dims
    q8, s8 = Q.quantize_fp8_block(w)  # UE8M0 128x128 (the checkpoint format): kept byte for byte
    q, s = fp8_block_weight(QuantizedWeight("fp8", q8, s8, (128, 128)))
    assert torch.equal(q.view(torch.uint8), q8.view(torch.uint8)) and torch.equal(s, s8.float())
    q4, s4 = Q.quantize_fp4(w)  # FP4 experts: the conversion op
    q, s = fp8_block_weight(QuantizedWeight("fp4", q4, s4, (1, 32)))
    eq, es = deepinfer_ops.fp4_to_fp8_blockscaled(q4, s4)
    assert torch.equal(q.view(torch.uint8), eq.view(torch.uint8)) and torch.equal(s, es)
    assert torch.equal(_dq(q, s), Q.dequantize_fp4(q4, s4))
    # other block sizes and float weights are quantised with fp32 amax / 448 128x128 scales: the e4m3 bound
    # |w - dq| <= 2^-4 |w| + 2^-10 s (half an ulp of 3 mantissa bits; subnormal step 2^-9 s)
    q64, s64 = Q.quantize_fp8_block(w, (64, 64))
    for src, vals in ((QuantizedWeight("fp8", q64, s64, (64, 64)), Q.dequantize_fp8_block(q64, s64, (64, 64))),
                      (w, w), (w.to(torch.bfloat16), w.to(torch.bfloat16).float())):
        q, s = fp8_block_weight(src)
        assert q.dtype == torch.float8_e4m3fn and tuple(q.shape) == (200, 72) and tuple(s.shape) == (2, 1)
        assert s.dtype == torch.float32
        s_full = s.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :72]
        err = (_dq(q, s) - vals).abs()
        assert bool((err <= 2 ** -4 * vals.abs() + 2 ** -10 * s_full).all())
        assert err.max() > 0  # re-quantised, not passed through
    with pytest.raises(ValueError, match="NaN"):
        fp8_block_weight(torch.full((4, 4), float("nan")))


@pytest.mark.parametrize("shape", [(7, 200), (2, 3, 200), (0, 200)])
def test_fp8_linear_is_the_recipe(shape):
    """``fp8_linear`` = 1x128 activation quantisation then the block-scaled GEMM: equal to the float64 product of
    the dequantised operands up to float32 accumulation."""
    g = torch.Generator().manual_seed(len(shape))
    x = torch.randn(*shape, generator=g)
    q, s = Q.quantize_fp8_block(torch.randn(72, 200, generator=g) / 16, scale_fmt="float")
    y = fp8_linear(x, q, s)
    assert y.shape == (*shape[:-1], 72) and y.dtype == torch.float32
    xq, xs = deepinfer_ops.per_token_group_quant_fp8(x.reshape(-1, 200), 128)
    xd = (xq.double() * xs.double().repeat_interleave(128, 1)[:, :200])
    ref = (xd @ _dq(q, s).double().t()).view(*shape[:-1], 72)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    assert fp8_linear(x.to(torch.bfloat16), q, s).dtype == torch.bfloat16


def test_linear_fp8_rows_follow_the_scale_blocks():
    lin = Linear(384, 128, torch.float32)
    w = torch.randn(384, 128, generator=torch.Generator().manual_seed(1))
    lin.set_fp8(*fp8_block_weight(w))
    wr, sr = lin.fp8_rows(128, 384)  # block aligned
    assert torch.equal(_dq(wr, sr), _dq(lin.weight, lin.scale)[128:384])
    wr, sr = lin.fp8_rows(160, 192)  # inside one block
    assert torch.equal(_dq(wr, sr), _dq(lin.weight, lin.scale)[160:192])
    with pytest.raises(ValueError, match="straddle"):
        lin.fp8_rows(96, 160)
    with pytest.raises(ValueError, match="scale"):
        lin.set_fp8(lin.weight, torch.ones(3, 2))
    with pytest.raises(ValueError, match="weight"):
        lin.set_fp8(torch.zeros(384, 128), lin.scale)


def test_fused_experts_equal_the_per_expert_fp8_recipe_bitwise(pair):
    """The stacked, 128-padded experts through ``fused_moe_fp8`` give bitwise the per-expert recipe on the
    unpadded weights (quantise x, gate / up GEMMs, fused SwiGLU + quantisation, down GEMM, combine in slot order):
    the zero padding changes nothing."""
    deq, fp8 = pair
    moe = fp8.layers[3].ffn
    stored = load_checkpoint(default_model_path(), dequantize=False).params
    x = torch.randn(23, fp8.config.hidden_size, generator=torch.Generator().manual_seed(2))
    w, idx = moe.route(x, torch.zeros(23, dtype=torch.long))
    got = deepinfer_ops.fused_moe_fp8(x, idx, w, moe.w13, moe.w13_scale, moe.w2, moe.w2_scale, 10.0)
    xq, xs = deepinfer_ops.per_token_group_quant_fp8(x, 128)
    acc = torch.zeros_like(x)
    for j in range(idx.shape[1]):
        for t in range(23):
            p = f"layers.3.ffn.experts.{int(idx[t, j])}."
            w1, w2, w3 = (fp8_block_weight(stored[p + k + ".weight"]) for k in ("w1", "w2", "w3"))
            gu = torch.cat([deepinfer_ops.fp8_gemm_nt(xq[t:t + 1], xs[t:t + 1], *w1),
                            deepinfer_ops.fp8_gemm_nt(xq[t:t + 1], xs[t:t + 1], *w3)], dim=1)
            hq, hs = deepinfer_ops.swiglu_clamp_quant_fp8(gu, 10.0)
            acc[t] += w[t, j] * deepinfer_ops.fp8_gemm_nt(hq, hs, *w2)[0].float()
    assert torch.equal(got, acc)


# ----------------------------------------------------------------------------------------------------------- model
@pytest.mark.parametrize("n", PROMPT_LENS)
def test_fp8_logits_match_dequant(pair, n):
    deq, fp8 = pair
    ids = _ids(n, 100 + n)
    L = deq.config.num_hidden_layers
    with record_routes(deq) as rc:
        ref = deq.forward_full(ids)
    with record_routes(fp8) as gc:
        got = fp8.forward_full(ids)
    assert got.dtype == torch.float32
    m = check_fp8_close(got, ref, per_position(gc, L), per_position(rc, L), f"{n} tokens, CPU fp8 vs dequant")
    assert m["calc_diff"] > 0  # the activations really were quantised


def test_fp8_wo_a_groups_straddling_scale_blocks_stay_dequantised():
    """o_lora_rank 48 x 4 groups: group 2's rows [96, 144) straddle two 128-row scale blocks, so wo_a stays in the
    model dtype (torch GEMMs); the float weights of the other linears are quantised at load."""
    d = copy.deepcopy(TINY_CONFIG)
    d.update(o_groups=4, o_lora_rank=48, num_hidden_layers=2, compress_ratios=[0, 4, 0], num_hash_layers=1)
    cfg = DeepseekV4Config.from_dict(d)
    params = init_parameters(cfg, 0)
    fp8 = DeepseekV4ForCausalLM.from_parameters(cfg, params, gemm="fp8")
    deq = DeepseekV4ForCausalLM.from_parameters(cfg, params)
    assert fp8.gemm == "fp8" and deq.gemm == "dequant"
    assert not fp8.layers[0].attn.wo_a.is_fp8 and fp8.layers[0].attn.wo_a.weight.dtype == torch.float32
    assert fp8.layers[0].attn.wo_b.is_fp8 and fp8.layers[0].ffn.is_fp8
    ids = _ids(40, 7)
    diff = calc_diff(fp8.forward_full(ids), deq.forward_full(ids))
    assert 0 < diff <= 1e-2


def test_llm_on_cpu_fp8_and_default():
    from deepinfer import LLM, SamplingParams

    llm = LLM("tiny", device="cpu", gemm="fp8", num_blocks=8, max_num_batched_tokens=64)
    assert llm.model.gemm == "fp8" and llm.config.gemm == "fp8"
    prompt = _ids(20, 3).tolist()
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    ids = list(prompt)
    for t in out.token_ids:  # the paged engine step by step = whole-sequence forwards of the same FP8 model
        assert int(llm.model.forward_full(torch.tensor(ids))[-1].argmax()) == t
        ids.append(t)
    assert LLM("tiny", device="cpu", num_blocks=8).model.gemm == "dequant"


def test_dequant_path_from_quantized_weights_equals_dequantised_load(pair):
    """``load_native`` given the stored formats (``QuantizedWeight``) on path ``"dequant"`` dequantises them itself:
    bitwise the model loaded from already-dequantised tensors."""
    deq, _ = pair
    ck = load_checkpoint(default_model_path(), dequantize=False)
    model = DeepseekV4ForCausalLM.from_parameters(ck.config, ck.params, gemm="dequant")
    assert model.gemm == "dequant" and not model.layers[0].attn.wq_a.is_fp8 and not model.layers[0].ffn.is_fp8
    ids = _ids(20, 11)
    assert torch.equal(model.forward_full(ids), deq.forward_full(ids))


def test_fp8_model_reads_the_cuda_scale_layout_on_cpu(pair, monkeypatch):
    """On CUDA the engine's FP8 paths quantise into padded M-major scales (strides ``(1, round_up(rows, 4))``,
    ``column_major_scales=x.is_cuda``) and then view / slice / feed them to the dense and grouped GEMMs (``fp8_linear``,
    the experts, the fused MoE, wo_a's ``xs.view(G, T, -1)``). Forcing that layout on the CPU must change no bit of the
    logits, at row counts that are and are not multiples of 4."""
    _, fp8 = pair
    ids = _ids(37, 5)
    ref = fp8.forward_full(ids)
    seen = []

    def forced(fn):
        def wrapper(*args, **kwargs):
            kwargs["column_major_scales"] = True
            q, s = fn(*args, **kwargs)
            seen.append((fn.__name__, s.shape[0], s.stride()))
            return q, s
        return wrapper

    for mod in (deepinfer_ops, deepinfer_ops.moe):
        monkeypatch.setattr(mod, "swiglu_clamp_quant_fp8", forced(deepinfer_ops.gemm.swiglu_clamp_quant_fp8))
    monkeypatch.setattr(deepinfer_ops, "per_token_group_quant_fp8",
                        forced(deepinfer_ops.quant.per_token_group_quant_fp8))
    got = fp8.forward_full(ids)
    for name in ("per_token_group_quant_fp8", "swiglu_clamp_quant_fp8"):  # the padded layout was used
        assert any(f == name and r % 4 and st == (1, -(-r // 4) * 4) for f, r, st in seen), (name, set(seen))
    assert torch.equal(got, ref)


@pytest.mark.parametrize("T,G,K", [(5, 8, 256), (33, 4, 200), (1, 2, 128)])
def test_quant_groups_in_place_equals_the_transposed_quant(device, T, G, K):
    from deepinfer.models.deepseek_v4.attention import quant_groups_fp8

    g = torch.Generator().manual_seed(T * G + K)
    x = (torch.randn(T, G * K, generator=g) * 3).bfloat16().to(device).view(T, G, K)
    q0, s0 = quant_groups_fp8(x, min_rows=T + 1)  # transposed copy, then one quantisation
    q1, s1 = quant_groups_fp8(x, min_rows=1)  # each group's strided rows in place
    assert torch.equal(q0.view(torch.uint8), q1.view(torch.uint8))
    assert s0.stride() == s1.stride() and torch.equal(s0, s1)
