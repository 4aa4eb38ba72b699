"""Frequency / presence penalties and logit_bias (OpenAI semantics), their validation and error records, their batch
invariance, and the explicit tokenizer choice for checkpoint folders."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from deepinfer import LLM
from deepinfer.chat import (PACKAGED_TOKENIZER, ChatFrontend, RequestError,
                            packaged_tokenizer_json, resolve_tokenizer_json)
from deepinfer.sampler import Sampler, adjust_logits, sample
from deepinfer.sequence import SamplingParamError, SamplingParams, Sequence
from fake_model import FakeConfig, FakeModel, reference_greedy

USER = {"role": "user", "content": "Hello"}


def _seq(i, output, **params):
    return Sequence(seq_id=i, prompt_token_ids=[3, 4], params=SamplingParams(**params), seed=1000 + i,
                    output_token_ids=list(output))


def _manual(logits_row, seq):
    """Element-by-element reference of the adjustment of one row, with float32 scalar tensors."""
    row = logits_row.float().clone()
    p = seq.params
    counts = {}
    if p.frequency_penalty or p.presence_penalty:
        for t in seq.output_token_ids:
            counts[t] = counts.get(t, 0) + 1
    f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    for t in set(counts) | set(p.logit_bias or {}):
        c = counts.get(t, 0)
        pen = f32(p.presence_penalty if c > 0 else 0.0) + f32(p.frequency_penalty) * f32(float(c))
        row[t] = (row[t] - pen) + f32((p.logit_bias or {}).get(t, 0.0))
    return row


def test_adjust_logits_matches_the_elementwise_definition():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g) * 5
    seqs = [_seq(0, [4, 4, 7, 4, 9], frequency_penalty=0.7, presence_penalty=1.3),
            _seq(1, [4, 4], logit_bias={4: -100.0, 11: 37.5}),
            _seq(2, [1, 2, 2, 3], frequency_penalty=-2.0, presence_penalty=0.25, logit_bias={2: 3.0, 40: -1.0})]
    from deepinfer.sampler import _adjustments

    got = adjust_logits(logits, *_adjustments(seqs, logits.device))
    for i, s in enumerate(seqs):
        assert torch.equal(got[i], _manual(logits[i], s)), i
    # the input is not modified; untouched elements keep their bits
    assert not torch.equal(got, logits) and torch.equal(got[0, :4], logits[0, :4])
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 50\)"):
        adjust_logits(logits, torch.tensor([0]), torch.tensor([50]), *(torch.zeros(1),) * 4)


def test_sampler_applies_adjustments_and_reports_raw_logprobs():
    g = torch.Generator().manual_seed(1)
    vocab = 3000
    logits = torch.randn(4, vocab, generator=g) * 3
    top = int(torch.argmax(logits[0]))
    seqs = [_seq(0, [], temperature=0.0, logit_bias={top: -100.0}, top_logprobs=2),  # greedy: the top is banned
            _seq(1, [], temperature=1.0, logit_bias={17: 100.0}),  # forced
            _seq(2, [5, 5, 5, 8], temperature=0.8, frequency_penalty=1.5, presence_penalty=0.5, top_k=40),
            _seq(3, [9], temperature=0.7, top_p=0.9)]  # no adjustment
    toks, lps, tops = Sampler()(logits, seqs)
    assert toks[0] != top and toks[0] == int(torch.argmax(_manual(logits[0], seqs[0])))
    assert toks[1] == 17
    adjusted = torch.stack([_manual(logits[i], s) for i, s in enumerate(seqs)])
    want, _ = sample(adjusted, torch.tensor([0.0, 1.0, 0.8, 0.7]), torch.tensor([0, 0, 40, 0]),
                     torch.tensor([1.0, 1.0, 1.0, 0.9]), torch.tensor([1000, 1001, 1002, 1003]),
                     torch.tensor([0, 0, 4, 1]))
    assert toks == want.tolist()
    raw_lp = torch.log_softmax(logits, -1)
    torch.testing.assert_close(torch.tensor(lps), raw_lp.gather(1, torch.tensor(toks)[:, None]).squeeze(1),
                               rtol=1e-6, atol=1e-5)  # reported from the raw logits, not the adjusted ones
    assert tops[0][0][0] == top  # top_logprobs come from the model's own distribution


def test_presence_and_frequency_penalties_change_the_greedy_choice():
    logits = torch.zeros(1, 10)
    logits[0, 3], logits[0, 6] = 2.0, 1.0
    assert Sampler()(logits, [_seq(0, [3], temperature=0.0)])[0] == [3]
    assert Sampler()(logits, [_seq(0, [3], temperature=0.0, presence_penalty=1.5)])[0] == [6]  # 2 - 1.5 < 1
    assert Sampler()(logits, [_seq(0, [3], temperature=0.0, frequency_penalty=1.5)])[0] == [6]
    assert Sampler()(logits, [_seq(0, [3, 3], temperature=0.0, frequency_penalty=0.6)])[0] == [6]  # 2 - 1.2 < 1
    assert Sampler()(logits, [_seq(0, [3], temperature=0.0, frequency_penalty=0.6)])[0] == [3]  # 2 - 0.6 > 1
    assert Sampler()(logits, [_seq(0, [3], temperature=0.0, presence_penalty=-2.0)])[0] == [3]  # negative: favours
    assert Sampler()(logits, [_seq(0, [6], temperature=0.0, presence_penalty=-2.0)])[0] == [6]


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_adjusted_rows_draw_the_same_alone_and_batched(batch_invariant):
    g = torch.Generator().manual_seed(2)
    vocab = 4000
    logits = torch.randn(7, vocab, generator=g) * 2
    specs = [dict(temperature=1.0, frequency_penalty=0.9, presence_penalty=0.4),
             dict(temperature=0.0, logit_bias={5: 3.0, 6: -100.0}),
             dict(temperature=1.2, top_p=0.8, logit_bias={int(i): 1.5 for i in range(0, vocab, 97)}),
             dict(temperature=0.9, top_k=30, presence_penalty=-1.0),
             dict(temperature=1.0),
             dict(temperature=0.7, frequency_penalty=2.0, logit_bias={11: 2.0}),
             dict(temperature=1.0, top_k=1500, top_p=0.95, presence_penalty=2.0)]
    outputs = [torch.randint(0, vocab, (int(n),), generator=g).tolist() for n in torch.randint(0, 40, (7,), generator=g)]
    seqs = [_seq(i, outputs[i], **specs[i]) for i in range(7)]
    sampler = Sampler(batch_invariant)
    full = sampler(logits, seqs)
    for i in range(7):
        alone = sampler(logits[i:i + 1], [seqs[i]])
        assert alone[0][0] == full[0][i] and alone[1][0] == full[1][i], i
    perm = [6, 2, 0, 5, 1, 4, 3]
    extra = torch.randn(2, vocab, generator=g)
    big = sampler(torch.cat([logits[perm], extra]), [seqs[j] for j in perm] + [_seq(9, [1, 2], presence_penalty=1.0),
                                                                              _seq(10, [], logit_bias={3: 9.0})])
    assert big[0][:7] == [full[0][j] for j in perm] and big[1][:7] == [full[1][j] for j in perm]


def test_output_token_counts_are_incremental():
    s = _seq(0, [4, 4, 9])
    assert s.output_token_counts() == {4: 2, 9: 1}
    s.output_token_ids += [9, 2]
    assert s.output_token_counts() == {4: 2, 9: 2, 2: 1}


@pytest.mark.parametrize("kw,field", [
    (dict(frequency_penalty=2.5), "frequency_penalty"), (dict(presence_penalty=-2.01), "presence_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"), (dict(presence_penalty="1"), "presence_penalty"),
    (dict(logit_bias={5: 100.5}), "logit_bias"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={"5": 1.0}), "logit_bias"), (dict(logit_bias={5: float("inf")}), "logit_bias"),
    (dict(logit_bias=[1, 2]), "logit_bias"), (dict(logit_bias={100: 1.0}), "logit_bias"),
])
def test_params_validation_names_the_field(kw, field):
    with pytest.raises(SamplingParamError, match=field) as e:
        SamplingParams(**kw).validate(vocab_size=100)
    assert e.value.param == field
    SamplingParams(frequency_penalty=-2, presence_penalty=2.0, logit_bias={99: -100, 0: 100.0}).validate(100)


def test_chat_reads_penalties_and_bias_and_names_bad_fields():
    fe = ChatFrontend(packaged_tokenizer_json(), "tiny-test", max_model_len=4096, eos_token_id=1, created=0,
                      vocab_size=129280)
    base = {"messages": [USER], "max_tokens": 4, "seed": 1, "thinking": {"type": "disabled"}}
    knobs = {"frequency_penalty": 0.5, "presence_penalty": -0.25, "logit_bias": {"42": -100, "7": 5}}
    p = fe.prepare({**base, **knobs}).params
    assert (p.frequency_penalty, p.presence_penalty, p.logit_bias) == (0.5, -0.25, {42: -100.0, 7: 5.0})
    assert fe.prepare(base).params.adjusts_logits is False
    # thinking mode: like temperature / top_p (DeepSeek's API rule, applied by the recipe), penalties have no effect
    p = fe.prepare({**base, **knobs, "thinking": {"type": "enabled"}}).params
    assert (p.frequency_penalty, p.presence_penalty, p.logit_bias) == (0.0, 0.0, {42: -100.0, 7: 5.0})
    for extra in ({"logit_bias": {"x": 1}}, {"logit_bias": {"5": 300}}, {"logit_bias": {"129280": 1}},
                  {"logit_bias": {"5": "a"}}, {"logit_bias": [1]}):
        with pytest.raises(RequestError) as e:
            fe.prepare({**base, **extra})
        assert e.value.record["param"] == "logit_bias" and "logit_bias" in e.value.record["message"], extra
    with pytest.raises(RequestError) as e:  # the JSON type is check_request's
        fe.prepare({**base, "presence_penalty": "high"})
    assert e.value.record["param"] == "presence_penalty" and "presence_penalty" in str(e.value)


def test_llm_applies_bias_end_to_end_and_records_errors():
    model = FakeModel(FakeConfig(max_position_embeddings=1024))
    llm = LLM(model, num_blocks=32, created=0)
    prompt = [5, 6, 7]
    first = reference_greedy(model, prompt, 1)[0]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=1, logit_bias={first: -100.0}))[0]
    assert out.error is None and out.token_ids[0] != first
    forced = llm.generate([prompt], SamplingParams(temperature=1.0, seed=3, max_tokens=3, logit_bias={77: 100.0}))[0]
    assert forced.token_ids == [77, 77, 77]
    bad = llm.generate([prompt], SamplingParams(max_tokens=1, logit_bias={10**6: 1.0}))[0]
    assert bad.error is not None and "logit_bias" in bad.error["message"]
    res = llm.chat([{"messages": [USER], "thinking": {"type": "disabled"}, "max_tokens": 2, "seed": 1,
                     "logit_bias": {"200000": 1}}])[0]
    assert res["error"]["param"] == "logit_bias"


# ------------------------------------------------------------------------------------------------- tokenizer choice


def test_checkpoint_without_tokenizer_json_is_an_error(tmp_path):
    with pytest.raises(ValueError, match=r"has no tokenizer.json .*tokenizer.json is missing"):
        resolve_tokenizer_json(None, str(tmp_path))
    with pytest.raises(ValueError, match="has no tokenizer.json"):  # before any weights are read
        LLM(str(tmp_path), device="cpu")
    assert resolve_tokenizer_json(PACKAGED_TOKENIZER, str(tmp_path)) == packaged_tokenizer_json()
    assert resolve_tokenizer_json(None, str(tmp_path), preset=True) == packaged_tokenizer_json()
    assert resolve_tokenizer_json(None, None) == packaged_tokenizer_json()  # a model object: documented default
    (tmp_path / "tokenizer.json").write_text("{}")
    assert resolve_tokenizer_json(None, str(tmp_path)) == str(tmp_path / "tokenizer.json")
    with pytest.raises(ValueError, match=r"tokenizer: '.*nope.json' is not a file"):
        resolve_tokenizer_json(str(tmp_path / "nope.json"), str(tmp_path))


def test_tiny_temperature_is_greedy():
    """logits / T overflows float32 for tiny T: such temperatures are greedy, not a draw among +-inf scores."""
    from deepinfer.sampler import sample

    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0)) * 5
    n = logits.shape[0]
    for t in (1e-45, 1e-40, 1e-6):
        tok, _ = sample(logits, torch.full((n,), t), torch.zeros(n, dtype=torch.int64), torch.ones(n),
                        torch.arange(n), torch.zeros(n, dtype=torch.int64))
        assert torch.equal(tok, logits.argmax(dim=-1)), t
