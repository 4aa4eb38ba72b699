"""``kv_cache_dtype``: bf16 and FP8 (MODEL1 entries, FP8 indexer keys) caches against the model-dtype cache, and
refusals that name the field.

The FP8 entries need head_dim 512 with 64 RoPE dims, so these tests use the tiny preset at V4's head shape
(``TINY_512``: head_dim 512, qk_rope_head_dim 64, index_head_dim 64; everything else tiny), random weights, fp32.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.block_manager import FULL_GROUP, WINDOW_GROUP
from deepinfer.config import EngineConfig
from deepinfer.models import TINY_CONFIG, DeepseekV4Config, allocate_cache, init_parameters
from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM, SeqStep
from deepinfer.models.deepseek_v4.cache import FP8_ENTRY_BYTES, CacheSpec
from deepinfer_ops.testing.compare import calc_diff
from fake_model import FakeModel

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

TINY_512 = {**TINY_CONFIG, "head_dim": 512, "qk_rope_head_dim": 64, "index_head_dim": 64}
# logits calc_diff against the fp32 cache over a chunked prefill and decodes (measured: bf16 2.5e-6, fp8 2.9e-4)
CACHE_DIFF = {"bf16": 2e-5, "fp8": 1.5e-3}


@pytest.fixture(scope="module")
def model():
    c = DeepseekV4Config.from_dict(TINY_512)
    return DeepseekV4ForCausalLM.from_parameters(c, init_parameters(c, 0)).eval()


def _ids(n, seed):
    return torch.randint(0, TINY_512["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _run(model, kv_cache_dtype, ids, steps):
    """Logits of every step's rows, the sequence's blocks 0..2 in both groups."""
    cache = model.allocate_cache(3, kv_cache_dtype=kv_cache_dtype)
    b = model.plan_builder(cache)
    out = []
    for c0, q in steps:
        out.append(model.forward(b.build([SeqStep(c0, q, (0, 1, 2))], ids[c0:c0 + q], list(range(q))), cache))
    return torch.cat(out), cache


def test_pools_take_the_fp8_layouts(model):
    spec = CacheSpec.from_config(model.config, torch.float32, kv_cache_dtype="fp8")
    auto = CacheSpec.from_config(model.config, torch.float32)
    csa = next(layer for layer in spec.layers if "idx" in layer.pools)
    assert csa.pools["kv"].shape == (128, FP8_ENTRY_BYTES) and csa.pools["kv"].dtype == torch.uint8
    assert csa.pools["comp"].shape == (32, FP8_ENTRY_BYTES) and csa.pools["idx"].shape == (32, 64 + 4)
    assert csa.pools["state_kv"].dtype == torch.float32  # the compressor state stays in the model dtype
    per_block, auto_block = spec.group_bytes_per_block(), auto.group_bytes_per_block()
    # full group: entries 584 B instead of 512 fp32 (2048 B), indexer keys 68 B instead of 256 B
    assert per_block[FULL_GROUP] * 3 < auto_block[FULL_GROUP]
    assert spec.report(10, 4)["groups"][WINDOW_GROUP]["pools_bytes_per_token"]["kv"] == 5 * FP8_ENTRY_BYTES


@pytest.mark.parametrize("kv_cache_dtype", ["bf16", "fp8"])
def test_cache_dtype_logits_stay_close_to_the_model_dtype_cache(model, kv_cache_dtype):
    ids = _ids(300, 1)
    steps = [(0, 200), (200, 99), (299, 1)]  # chunked prefill across a block end, then a decode
    ref, _ = _run(model, "auto", ids, steps)
    got, cache = _run(model, kv_cache_dtype, ids, steps)
    assert cache.layers[0]["kv"].dtype == (torch.uint8 if kv_cache_dtype == "fp8" else torch.bfloat16)
    assert torch.isfinite(got).all()
    diff = calc_diff(got, ref)
    assert diff <= CACHE_DIFF[kv_cache_dtype], diff
    assert diff > 0  # the cache really is stored in the other format


def test_fp8_cache_keeps_the_greedy_tokens(model):
    """Eight greedy steps after a 290-token prompt (seed 0): the fp32 path's top-2 margins are 0.025 .. 0.89 logits
    and the fp8 cache keeps every token. At each step where the margin exceeds twice the fp8 error on those two
    logits the order cannot flip; the test checks that and the tokens themselves."""
    ids = _ids(290, 0)
    toks, margins = {}, []
    for kvd in ("auto", "fp8"):
        cache = model.allocate_cache(3, kv_cache_dtype=kvd)
        b = model.plan_builder(cache)
        ctx, c0, toks[kvd] = list(ids), 0, []
        logits = []
        for _ in range(8):
            q = len(ctx) - c0
            lg = model.forward(b.build([SeqStep(c0, q, (0, 1, 2))], ctx[c0:], [q - 1]), cache)[0]
            logits.append(lg)
            c0 = len(ctx)
            ctx.append(int(lg.argmax()))
            toks[kvd].append(ctx[-1])
        if kvd == "auto":
            ref_logits = logits
    for ref, got in zip(ref_logits, logits):
        top = ref.topk(2)
        margin = float(top.values[0] - top.values[1])
        err = float((got[top.indices] - ref[top.indices]).abs().max())
        margins.append(margin)
        if margin > 2 * err:
            assert int(got.argmax()) == int(top.indices[0])
    assert min(margins) > 0.02
    assert toks["fp8"] == toks["auto"]


def test_llm_runs_an_fp8_cache_and_reports_it(model):
    llm = LLM(model, kv_cache_dtype="fp8", max_model_len=1024, max_num_seqs=2)
    rep = llm.startup["cache"]
    assert rep["kv_cache_dtype"] == "fp8" and rep["tokens"] == llm.block_manager.num_blocks * 128
    auto = LLM(model, max_model_len=1024, max_num_seqs=2).startup["cache"]
    assert rep["groups"][FULL_GROUP]["bytes_per_token"] < auto["groups"][FULL_GROUP]["bytes_per_token"] / 3
    out = llm.generate([_ids(200, 2)], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert out[0].error is None and len(out[0].token_ids) == 4


def test_bad_kv_cache_dtype_is_refused_naming_the_field(model):
    with pytest.raises(ValueError, match="EngineConfig.kv_cache_dtype must be 'auto', 'bf16' or 'fp8'"):
        EngineConfig(kv_cache_dtype="fp16").validate()
    with pytest.raises(ValueError, match="kv_cache_dtype: must be one of"):
        allocate_cache(model.config, 2, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_cache_dtype: 'fp8' stores MODEL1 entries of head_dim 512.*head_dim 64"):
        LLM("tiny", kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="EngineConfig.kv_cache_dtype: FakeModel has no cache spec"):
        LLM(FakeModel(), kv_cache_dtype="bf16")


def test_cli_flag_is_checked(capsys, tmp_path):
    from deepinfer.cli import build_parser, run_generate

    assert build_parser().parse_args(["generate", "--input", "-", "--output", "-",
                                      "--kv-cache-dtype", "fp8"]).kv_cache_dtype == "fp8"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--input", "-", "--output", "-", "--kv-cache-dtype", "fp16"])
    assert "--kv-cache-dtype" in capsys.readouterr().err
    (tmp_path / "in.jsonl").write_text("")
    args = build_parser().parse_args(["generate", "--input", str(tmp_path / "in.jsonl"), "--output",
                                      str(tmp_path / "out.jsonl"), "--kv-cache-dtype", "bf16"])
    with pytest.raises(ValueError, match="EngineConfig.kv_cache_dtype"):  # the flag reaches the engine config
        run_generate(args, FakeModel())
