"""DeepSeek-V4.1 through the engine: paged cache groups, plan builder, batching, presets, CLI, chat errors.

Consistency tiers (``docs/deepseek_v41.md``, "In the engine"): with one CPU thread every op of the V4.1 CPU path
computes a row the same way whatever the step's row count, so an engine decode is bitwise a full recompute of the
same tokens, and a request's logprobs are bitwise the same alone, inside batches and under any prefill chunking
(batch-invariant mode), and after a prefix-cache hit.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.models.deepseek_v4.plan import StepSeqs

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

REPO = Path(__file__).resolve().parents[2]
GOLDEN = REPO.parent / "shared" / "reference" / "v41-golden"
VOCAB = 129280


def _llm(**kw) -> LLM:
    kw.setdefault("num_blocks", 48)
    return LLM("tiny-v41", **kw)


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def test_engine_decode_equals_full_recompute():
    """Greedy engine decode (prefill, then steps over the paged pools) is bitwise the model's own full forward."""
    llm = _llm()
    prompt = _ids(random.Random(3), 151)  # odd: a ratio-2 group is open when decode starts; crosses block 128
    out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    full = llm.model.forward_full(torch.tensor(prompt + out.token_ids[:-1]))
    rows = full[len(prompt) - 1:]
    assert out.token_ids == rows.argmax(-1).tolist()
    want = torch.log_softmax(rows, -1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(out.logprobs), want, atol=1e-5, rtol=0)


def _runs(batch_invariant: bool):
    rng = random.Random(11)
    target = _ids(rng, 150)  # past the window (32), the 128-token block and every ratio-2 group boundary
    params = SamplingParams(temperature=1.0, max_tokens=4, seed=1234, ignore_eos=True)
    llm = _llm(batch_invariant=batch_invariant, max_num_batched_tokens=256, enable_prefix_caching=False)
    ref = llm.generate([target], params)[0]
    runs = [("rerun", llm.generate([target], params)[0])]
    for b in (2, 5):
        fillers = [_ids(rng, rng.randrange(1, 40)) for _ in range(b - 1)]
        fparams = [SamplingParams(temperature=1.0, max_tokens=rng.randrange(1, 5), seed=rng.randrange(1 << 62),
                                  ignore_eos=True) for _ in fillers]
        at = rng.randrange(b)
        outs = llm.generate(fillers[:at] + [target] + fillers[at:], fparams[:at] + [params] + fparams[at:])
        runs.append((f"batch of {b} at {at}", outs[at]))
    for budget, align in ((48, 16), (64, 2)):
        llm = _llm(batch_invariant=batch_invariant, max_num_batched_tokens=budget, prefill_chunk_align=align,
                   enable_prefix_caching=False)
        runs.append((f"chunks of <= {budget} cut at multiples of {align}", llm.generate([target], params)[0]))
    return ref, runs


def test_engine_bitwise_alone_batched_and_chunked():
    ref, runs = _runs(True)
    assert len(ref.token_ids) == 4
    for label, out in runs:
        assert out.token_ids == ref.token_ids, label
        assert out.logprobs == ref.logprobs, f"{label}: {out.logprobs} vs {ref.logprobs}"


def test_prefix_cache_hit_equals_cold_run():
    """A hit on two shared blocks (replayed from a block boundary, never writing the shared ``full`` blocks) gives
    the cold run's tokens and logprobs bitwise."""
    rng = random.Random(5)
    prompt = _ids(rng, 400)
    params = SamplingParams(temperature=1.0, max_tokens=3, seed=7, ignore_eos=True)
    cold = _llm(batch_invariant=True, enable_prefix_caching=False).generate([prompt], params)[0]
    llm = _llm(batch_invariant=True, enable_prefix_caching=True)
    first = llm.generate([prompt], params)[0]
    second = llm.generate([prompt], params)[0]
    assert second.num_cached_tokens >= 256, second.num_cached_tokens
    for label, out in (("first", first), ("hit", second)):
        assert out.token_ids == cold.token_ids and out.logprobs == cold.logprobs, label


def test_plan_builder_names_bad_rows():
    llm = _llm()
    model, cache = llm.model, llm.cache
    pb = model.plan_builder(cache)
    one = StepSeqs(np.array([0]), np.array([3]), np.array([[cache.num_blocks]]))
    with pytest.raises(ValueError, match=r"block_tables: sequence 0 block 0 is 48"):
        pb.build(one, [1, 2, 3], [2])
    two = StepSeqs(np.array([0, 0]), np.array([2, 2]), np.array([[5], [5]]))
    with pytest.raises(ValueError, match="written by sequences 0 and 1"):
        pb.build(two, [1, 2, 3, 4], [1, 3])
    with pytest.raises(ValueError, match="input_ids: ids must lie"):
        pb.build(StepSeqs(np.array([0]), np.array([1]), np.array([[1]])), [VOCAB], [0])
    with pytest.raises(ValueError, match="beyond max_seq_len"):
        pb.build(StepSeqs(np.array([4095]), np.array([2]), np.arange(33)[None]), [1, 2], [1])


def test_chat_image_part_is_a_per_request_error():
    llm = _llm()
    name = llm.served_model_name
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    out = llm.chat([{"model": name, "messages": [{"role": "user", "content": [{"type": "text", "text": "what?"},
                                                                              image]}]},
                    {"model": name, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}])
    assert out[0]["error"]["code"] == "images_unsupported" and "image_url" in out[0]["error"]["message"]
    assert out[0]["error"]["status_code"] == 400
    assert out[1]["choices"][0]["finish_reason"] == "length"
    assert llm.model_version == "v4.1"


@pytest.mark.skipif(not GOLDEN.is_dir(), reason=f"golden V4.1 data not found at {GOLDEN}")
def test_golden_checkpoint_through_the_engine():
    """A golden checkpoint (no ``model_type``, no tokenizer.json) loads through ``LLM``; its greedy engine decode
    equals the model's own per-sequence decode (which the golden tests hold to the reference)."""
    from safetensors.torch import load_file

    folder = GOLDEN / "small-seed0"
    cases = load_file(str(folder / "cases.safetensors"))
    ids = cases["prefill.len033.input_ids"]
    llm = LLM(str(folder), num_blocks=4)
    out = llm.generate([ids.tolist()], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    m = llm.model
    st = m.new_state(ids.numel() + 12)
    logits, _ = m.forward(ids, st, all_logits=False)
    toks = []
    for _ in range(12):
        toks.append(int(logits[-1].argmax()))
        logits, _ = m.forward(torch.tensor(toks[-1:]), st)
    assert out.token_ids == toks
    assert toks[0] == int(cases["decode.len033.fix.stable.generated_ids"][0])
    assert not (folder / "tokenizer.json").exists()


def test_presets_state_their_size():
    from deepinfer.models.deepseek_v41 import DeepseekV41Config
    from deepinfer.presets import checkpoint_size, preset_config

    flash = preset_config("v41-flash-shapes")
    cfg = DeepseekV41Config.from_dict(flash)
    assert (cfg.dim, cfg.n_heads, cfg.head_dim, cfg.n_routed_experts, cfg.num_dspark_layers) == (5120, 64, 512, 384, 3)
    assert {cfg.block_type(L) for L in range(cfg.n_layers)} == {
        "swa_only", "kv_index_source", "consumer_ratio2", "candidate_source", "consumer_ratio1",
        "candidate_index_source"}
    size = checkpoint_size("v41-flash-shapes")
    assert size > 40 << 30 and checkpoint_size("v41-flash-shapes", num_experts=8) < size / 5
    tiny = DeepseekV41Config.from_dict(preset_config("tiny-v41"))
    assert tiny.engram_layer_ids and tiny.num_dspark_layers == 1 and tiny.vocab_size == VOCAB
    with pytest.raises(ValueError, match="num_layers"):
        preset_config("tiny-v41", num_layers=3)
    with pytest.raises(ValueError, match="native format only"):
        checkpoint_size("tiny-v41", quant="none")


def _cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO / "python"), str(REPO / "engine"), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run([sys.executable, "-m", "deepinfer.cli", *args], input=stdin, capture_output=True,
                          text=True, env=env, timeout=None, check=False)


def test_cli_generate_tiny_v41():
    bodies = [{"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3, "temperature": 0},
              {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}]
    r = _cli("generate", "--model", "tiny-v41", "--input", "-", "--output", "-", "--no-progress", "--created", "0",
             stdin="".join(json.dumps(b) + "\n" for b in bodies))
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert lines[0]["usage"]["completion_tokens"] == 3 and lines[0]["model"].startswith("tiny-v41")
    assert lines[1]["error"]["code"] == "images_unsupported"


def test_make_checkpoint_tiny_v41(tmp_path):
    r = _cli("make-checkpoint", "--preset", "tiny-v41", "--out", str(tmp_path / "t"), "--seed", "1")
    assert r.returncode == 0, r.stderr
    assert "make-checkpoint: writing 0.07 GiB" in r.stderr
    from deepinfer.models.deepseek_v41 import load_model

    m = load_model(tmp_path / "t")
    assert torch.isfinite(m.forward_full(torch.tensor([0, 5, 9, 128799]))).all()


def test_forward_batch_form_equals_full_forward():
    """``forward(ForwardBatch, cache)`` (one table for both groups) of two prefills equals each one's full forward."""
    from deepinfer.forward_batch import ForwardBatch

    llm = _llm()
    m = llm.model
    cache = m.allocate_cache(6)
    rng = random.Random(2)
    a, b = _ids(rng, 140), _ids(rng, 9)
    batch = ForwardBatch(input_ids=torch.tensor(a + b), positions=torch.tensor(list(range(140)) + list(range(9))),
                         query_lens=[140, 9], context_lens=[140, 9],
                         block_tables=torch.tensor([[0, 1], [2, -1]], dtype=torch.int32),
                         logits_indices=torch.tensor([139, 148]))
    out = m.forward(batch, cache)
    assert torch.equal(out[0], m.forward_full(torch.tensor(a))[-1])
    assert torch.equal(out[1], m.forward_full(torch.tensor(b))[-1])


def test_dequant_path_on_the_cpu_matches_exact():
    """The GPU path's numerics (bf16 weights dequantised at load, bf16 GEMMs) run on the CPU in CI: held to the
    exact path with the V4.1 CUDA test's bounds (routing flips counted, index-selection rows held per row to the
    looser bound); and batch-invariant mode is refused where it does not hold."""
    from test_deepseek_v41_cuda import _check, _full

    from deepinfer.models.deepseek_v41 import DeepseekV41ForCausalLM
    from deepinfer.presets import default_model_path

    path = default_model_path(preset="tiny-v41")
    exact = DeepseekV41ForCausalLM.from_checkpoint(path)
    dq = DeepseekV41ForCausalLM.from_checkpoint(path, gemm="dequant")
    assert exact.gemm == "exact" and dq.gemm == "dequant"
    ids = torch.tensor(_ids(random.Random(21), 160))
    ref, ref_ch = _full(exact, ids)
    got, got_ch = _full(dq, ids)
    _check(got, ref, got_ch, ref_ch, exact.cfg.n_layers, "V4.1 dequant vs exact on the CPU")
    assert LLM("tiny-v41", batch_invariant=True, num_blocks=4).config.batch_invariant
