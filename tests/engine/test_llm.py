"""LLM.generate through the fake model: batching never changes a request's output."""

import random

import torch

import pytest

from deepinfer import LLM, SamplingParams
from fake_model import FakeConfig, FakeModel, reference_greedy

VOCAB = 1000


def _llm(block_size=16, num_blocks=128, budget=96, max_num_seqs=16, **kw):
    model = FakeModel(FakeConfig(vocab_size=VOCAB, max_position_embeddings=4096, eos_every=29), block_size=block_size)
    return model, LLM(model, block_size=block_size, num_blocks=num_blocks, max_num_batched_tokens=budget,
                      max_num_seqs=max_num_seqs, **kw)


def _prompts(n=16, seed=0):
    r = random.Random(seed)
    lens = [1, 2, 15, 16, 17, 31, 33, 64, 100, 5, 47, 128, 129, 9, 200, 70][:n]
    return [[r.randrange(2, VOCAB) for _ in range(L)] for L in lens]


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_16_mixed_length_batched_equals_alone_greedy(batch_invariant):
    model, llm = _llm(batch_invariant=batch_invariant)
    prompts = _prompts()
    params = SamplingParams(temperature=0, max_tokens=12)
    batched = llm.generate(prompts, params)
    assert model.max_tokens_per_call <= 96
    for p, o in zip(prompts, batched):
        alone = llm.generate([p], params)[0]
        assert o.token_ids == alone.token_ids == reference_greedy(model, p, 12)
        assert o.logprobs == alone.logprobs
    assert any(o.finish_reason == "stop" for o in batched) and any(o.finish_reason == "length" for o in batched)


def test_seeded_sampling_batched_equals_alone_and_unset_seed_is_returned():
    model, llm = _llm(budget=64)
    prompts = _prompts(8, seed=3)
    params = [SamplingParams(temperature=1.0, top_p=0.9, top_k=[0, 40][i % 2], max_tokens=10, seed=1000 + i)
              for i in range(8)]
    batched = llm.generate(prompts, params)
    for p, sp, o in zip(prompts, params, batched):
        alone = llm.generate([p], sp)[0]
        assert o.token_ids == alone.token_ids and o.seed == sp.seed
    # an unset seed is drawn, used and reported: rerunning with it reproduces the output
    free = llm.generate([prompts[0]], SamplingParams(temperature=1.0, max_tokens=10))[0]
    assert isinstance(free.seed, int) and 0 <= free.seed < 2**63
    again = llm.generate([prompts[0]], SamplingParams(temperature=1.0, max_tokens=10, seed=free.seed))[0]
    assert again.token_ids == free.token_ids


def test_preemption_does_not_change_outputs():
    model, roomy = _llm(num_blocks=256, budget=64)
    _, tight = _llm(num_blocks=10, budget=64)
    prompts = _prompts(10, seed=5)
    params = SamplingParams(temperature=0.8, max_tokens=20, seed=9, ignore_eos=True)
    a = roomy.generate(prompts, params)
    b = tight.generate(prompts, params)
    assert tight.scheduler.num_preemptions > 0
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(len(o.token_ids) == 20 for o in a)


def test_text_prompts_stop_ids_and_bad_requests():
    model, llm = _llm()
    outs = llm.generate(
        [[5, 6, 7], [], [5, VOCAB + 3], [8, 9]],
        [SamplingParams(temperature=0, max_tokens=4), SamplingParams(max_tokens=4),
         SamplingParams(max_tokens=4), SamplingParams(max_tokens=0)])
    assert outs[0].error is None and len(outs[0].token_ids) <= 4
    assert outs[1].error["code"] == "invalid_request"
    assert "out of range" in outs[2].error["message"]
    assert "max_tokens" in outs[3].error["message"]
    first = reference_greedy(model, [5, 6, 7], 4)
    if first:
        stopped = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, stop_token_ids=(first[0],)))[0]
        assert stopped.token_ids == [] and stopped.finish_reason == "stop" and stopped.stop_token_id == first[0]


def test_context_limit_error():
    model, llm = _llm(max_model_len=64)
    outs = llm.generate([[3] * 60, [3] * 10], SamplingParams(temperature=0, max_tokens=8))
    assert outs[0].error["code"] == "context_length_exceeded" and outs[1].error is None


def test_model_error_leaves_engine_clean():
    model, llm = _llm()
    calls = {"n": 0}
    real = model.forward

    def flaky(batch, cache):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real(batch, cache)

    model.forward = flaky
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate(_prompts(4), SamplingParams(temperature=0, max_tokens=4))
    assert not llm.scheduler.has_unfinished() and llm.block_manager.num_free_blocks == 128
    model.forward = real
    p = _prompts(2, seed=9)
    assert [o.token_ids for o in llm.generate(p, SamplingParams(temperature=0, max_tokens=4))] == \
        [reference_greedy(model, q, 4) for q in p]


def test_logprobs_and_top_logprobs_match_the_model():
    model, llm = _llm()
    p = _prompts(1, seed=4)[0]
    o = llm.generate([p], SamplingParams(temperature=0.7, max_tokens=5, seed=3, top_logprobs=4, ignore_eos=True))[0]
    ctx = list(p)
    for t, lp, top in zip(o.token_ids, o.logprobs, o.top_logprobs):
        ref = torch.log_softmax(model.reference_logits(ctx), -1)
        assert lp == pytest.approx(float(ref[t]), abs=1e-6)
        vals, idx = torch.sort(ref, descending=True, stable=True)
        assert [i for i, _ in top] == idx[:4].tolist()
        assert [v for _, v in top] == pytest.approx(vals[:4].tolist(), abs=1e-6)
        ctx.append(t)


def test_accelerator_env_is_honoured(monkeypatch):
    """DEEPINFER_ACCELERATOR picks the engine's device; an unavailable or unknown backend is a clear error."""
    import deepinfer_ops
    from deepinfer import LLM

    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "ascend")
    with pytest.raises(deepinfer_ops.BackendUnavailableError, match="CANN"):
        LLM("tiny")
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "bogus")
    with pytest.raises(ValueError, match="DEEPINFER_ACCELERATOR"):
        LLM("tiny")


def test_explicit_device_is_checked_before_loading():
    """``device=`` (CLI ``--device``): an unparsable or unsupported device is a ValueError naming it, CUDA without a
    CUDA build or device a BackendUnavailableError saying which (one-line CLI errors, no traceback)."""
    import deepinfer_ops
    import torch
    from deepinfer import LLM

    with pytest.raises(ValueError, match="device: 'tpu' is not a torch device"):
        LLM("tiny", device="tpu")
    with pytest.raises(ValueError, match="device: 'xpu': this engine runs on 'cpu' or 'cuda'"):
        LLM("tiny", device="xpu")
    if not (deepinfer_ops.BUILT_WITH_CUDA and torch.cuda.is_available()):
        with pytest.raises(deepinfer_ops.BackendUnavailableError, match="device 'cuda'"):
            LLM("tiny", device="cuda")


def test_bad_request_in_generate_is_its_own_error():
    """LLM.generate: a bad prompt or SamplingParams becomes that request's error; the good requests still run."""
    from deepinfer import LLM, SamplingParams

    llm = LLM(FakeModel(FakeConfig(max_position_embeddings=1024)), num_blocks=16)
    good = SamplingParams(temperature=0, max_tokens=2)
    bads = [SamplingParams(top_logprobs=True), SamplingParams(top_k=2 ** 64), SamplingParams(stop_token_ids=None),
            SamplingParams(temperature="x"), SamplingParams(temperature=1e308), SamplingParams(seed=1.5), None]
    outs = llm.generate([[5, 6, 7]] * (len(bads) + 1), [good, *bads])
    assert outs[0].error is None and len(outs[0].token_ids) == 2
    fields = ["top_logprobs", "top_k", "stop_token_ids", "temperature", "temperature", "seed", "sampling_params"]
    for o, b, field in zip(outs[1:], bads, fields):
        assert o.error is not None and o.token_ids == [], b
        assert o.error["param"] == field and o.error["status_code"] == 400, o.error
    outs = llm.generate([[5, 6], [0, "a"], [1.5], [True], b"abc", {5: 6}, [5, 10 ** 6]], good)
    assert outs[0].error is None and all(o.error and "prompts[" in o.error["message"] for o in outs[1:6])
    assert "out of range" in outs[6].error["message"]
    assert all(o.error["param"] == "prompt" for o in outs[1:])


def test_stop_token_ids_from_a_generator_are_kept():
    """A one-shot iterable of stop ids is read once by validation and kept: the stop still ends the output."""
    model, llm = _llm()
    first = reference_greedy(model, [5, 6, 7], 4)
    assert first, "the fake model emits a token for this prompt"
    sp = SamplingParams(temperature=0, max_tokens=4, stop_token_ids=(t for t in [first[0]]))
    out = llm.generate([[5, 6, 7]], sp)[0]
    assert out.error is None and out.token_ids == [] and out.finish_reason == "stop"
    assert sp.stop_token_ids == (first[0],)


def test_speculation_settings_without_a_method_are_refused():
    """As on the CLI: a speculation setting without speculative_method would be ignored, so it is an error, as a
    keyword or in an EngineConfig."""
    from deepinfer import EngineConfig

    for kw in ({"num_speculative_tokens": 2}, {"spec_schedule": "fixed"}, {"spec_admit_hold": 1}):
        with pytest.raises(ValueError, match=f"{next(iter(kw))}: needs speculative_method"):
            LLM(FakeModel(FakeConfig(max_position_embeddings=1024)), **kw)
        with pytest.raises(ValueError, match=f"{next(iter(kw))}: needs speculative_method"):
            LLM(FakeModel(FakeConfig(max_position_embeddings=1024)), config=EngineConfig(**kw))


def test_hostile_stop_ids_and_raising_inputs_stay_their_requests_errors():
    """A shared SamplingParams whose one-shot stop ids are bad fails every request that uses it; endless or
    out-of-vocabulary stop ids are refused without reading them all; anything a prompt or parameter raises is
    that request's error record, and the good requests run."""
    import itertools

    _, llm = _llm()
    bad = SamplingParams(max_tokens=2, stop_token_ids=(t for t in [5, -1]))
    outs = llm.generate([[5, 6], [7, 8], [9]], bad)
    assert all(o.error and o.error["param"] == "stop_token_ids" for o in outs)
    for ids in (itertools.count(1), range(10 ** 9), [VOCAB], [2 ** 70]):
        out = llm.generate([[5, 6]], SamplingParams(max_tokens=2, stop_token_ids=ids))[0]
        assert out.error["param"] == "stop_token_ids" and out.error["status_code"] == 400, ids

    def boom():
        yield 1
        raise RuntimeError("x" * 10 ** 6)

    good = SamplingParams(temperature=0, max_tokens=2)
    outs = llm.generate([[5, 6], [5, 6]], [good, SamplingParams(max_tokens=2, stop_token_ids=boom())])
    assert outs[0].error is None and len(outs[0].token_ids) == 2
    assert outs[1].error["param"] == "sampling_params" and len(outs[1].error["message"]) < 200
    outs = llm.generate([boom(), [5, 6]], good)
    assert outs[0].error["param"] == "prompt" and "RuntimeError" in outs[0].error["message"]
    assert outs[1].error is None and len(outs[1].token_ids) == 2


def test_engine_config_types_are_checked():
    from deepinfer import LLM

    for kw in ({"batch_invariant": "no"}, {"max_model_len": float("nan")}, {"cpu_cache_gib": -1},
               {"num_blocks": 1.5}, {"max_num_seqs": "4"}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            LLM(FakeModel(FakeConfig(max_position_embeddings=1024)), **kw)


def test_nan_logits_end_that_request_with_an_error():
    """A request whose logits turn NaN (broken weights or kernel) ends with an error record; the others finish."""
    from deepinfer import LLM, SamplingParams
    from deepinfer.forward_batch import ForwardBatch

    class NanForPrompt7(FakeModel):
        def forward(self, batch: ForwardBatch, cache):
            logits = super().forward(batch, cache)
            starts = torch.cumsum(torch.tensor([0, *batch.query_lens[:-1]]), 0)
            for row, idx in enumerate(batch.logits_indices.tolist()):
                i = int((starts <= idx).nonzero().max())
                if batch.positions[int(starts[i])].item() == 0 and batch.input_ids[int(starts[i])].item() == 7:
                    logits[row, 3] = float("nan")
            return logits

    llm = LLM(NanForPrompt7(FakeConfig(max_position_embeddings=1024)), num_blocks=16)
    outs = llm.generate([[5, 6], [7, 8], [9]], SamplingParams(temperature=0, max_tokens=3))
    assert outs[1].error is not None and outs[1].error["code"] == "nan_logits" and outs[1].token_ids == []
    assert outs[0].error is None and len(outs[0].token_ids) == 3 and outs[2].error is None


def test_numpy_scalars_are_taken_as_python_numbers():
    """NumPy scalars in SamplingParams behave as the Python numbers they hold (prompts already take NumPy ints);
    a NumPy bool is no integer, as a Python bool is not."""
    import numpy as np

    model, llm = _llm()
    ref = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, seed=7))[0]
    sp = SamplingParams(temperature=np.float32(0), max_tokens=np.int64(3), top_p=np.float32(0.5), seed=np.uint64(7),
                        stop_token_ids=np.array([VOCAB - 1]), logit_bias={np.int64(5): np.float32(0)})
    out = llm.generate([[5, 6, 7]], sp)[0]
    assert out.error is None and out.token_ids == ref.token_ids
    assert type(sp.max_tokens) is int and sp.stop_token_ids == (VOCAB - 1,) and sp.logit_bias == {5: 0.0}
    bad = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=np.bool_(True)))[0]
    assert bad.error["param"] == "max_tokens"
