"""Structured output: parameter checks, the compiler's cache and pool, the bitmask, per-request error records."""

import time

import pytest
import torch

from deepinfer.sequence import SamplingParamError, SamplingParams
from deepinfer.structured import GrammarCompiler, GrammarError, StructuredOutputsParams as S, apply_token_bitmask

pytest.importorskip("xgrammar")


@pytest.fixture(scope="module")
def llm():
    from deepinfer.llm import LLM

    return LLM("tiny")


@pytest.mark.parametrize("spec, field", [
    (S(), "structured_outputs"),
    (S(regex="a", grammar="root ::= \"a\""), "structured_outputs"),
    (S(json=3), "structured_outputs.json"),
    (S(json="{bad"), "structured_outputs.json"),
    (S(json="[1]"), "structured_outputs.json"),
    (S(regex=""), "structured_outputs.regex"),
    (S(grammar=5), "structured_outputs.grammar"),
    (S(choice=()), "structured_outputs.choice"),
    (S(choice="ab"), "structured_outputs.choice"),
    (S(choice=("a", "")), "structured_outputs.choice"),
    (S(json_object="yes"), "structured_outputs.json_object"),
    (S(regex="a", after_token_id=-1), "structured_outputs.after_token_id"),
    (S(structural_tag=3), "structured_outputs.structural_tag"),
    (S(structural_tag="[1]"), "structured_outputs.structural_tag"),
    (S(structural_tag="{bad"), "structured_outputs.structural_tag"),
])
def test_bad_params_name_the_field(spec, field):
    with pytest.raises(SamplingParamError) as e:
        SamplingParams(structured_outputs=spec).validate()
    assert e.value.param == field and field in str(e.value)


def test_params_type_and_ignore_eos():
    with pytest.raises(SamplingParamError, match="structured_outputs must be a StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"}).validate()
    with pytest.raises(SamplingParamError) as e:
        SamplingParams(ignore_eos=True, structured_outputs=S(regex="a")).validate()
    assert e.value.param == "ignore_eos"


def test_cache_key_is_canonical():
    assert S(json={"b": 1, "a": 2}).cache_key() == S(json='{"a": 2, "b": 1}').cache_key()
    assert S(regex="a").cache_key() != S(grammar="a").cache_key()


def test_bitmask_is_elementwise_and_batch_invariant():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 70, generator=g)
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (2, 3), generator=g, dtype=torch.int64).to(torch.int32)
    rows = torch.tensor([1, 3])
    out = apply_token_bitmask(logits, rows, bits)
    for j, r in enumerate(rows.tolist()):
        allowed = [(int(bits[j, t // 32]) >> (t % 32)) & 1 for t in range(70)]
        for t in range(70):
            assert out[r, t] == (logits[r, t] if allowed[t] else float("-inf"))
    assert torch.equal(out[[0, 2, 4]], logits[[0, 2, 4]])
    alone = apply_token_bitmask(logits[3:4], torch.tensor([0]), bits[1:2])
    assert torch.equal(alone[0], out[3])
    with pytest.raises(ValueError, match="bitmask must be"):
        apply_token_bitmask(logits, rows, bits[:, :2])


@pytest.mark.parametrize("n, vocab", [(1, 1), (7, 129280), (33, 95)])
def test_bitmask_torch_path_equals_xgrammars(n, vocab):
    """The CUDA path's torch ops (run here on the CPU) give what xgrammar's CPU kernel gives."""
    from deepinfer.structured import _apply_token_bitmask_torch

    g = torch.Generator().manual_seed(n)
    logits = torch.randn(n, vocab, generator=g)
    rows = torch.randperm(n, generator=g)[:max(1, n // 2)]
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (rows.numel(), -(-vocab // 32) + (n % 2)), generator=g,
                         dtype=torch.int64).to(torch.int32)
    bits[0] = 0  # a row with nothing allowed
    out = apply_token_bitmask(logits, rows, bits)
    assert torch.equal(out, _apply_token_bitmask_torch(logits.clone(), rows, bits))
    assert bool(torch.isinf(out[rows[0]]).all())
    every = torch.arange(n)  # every row in order: masked in place
    wide = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, bits.shape[1]), generator=g, dtype=torch.int64).to(torch.int32)
    assert torch.equal(apply_token_bitmask(logits, every, wide),
                       _apply_token_bitmask_torch(logits.clone(), every, wide))


def test_compiled_once_and_byte_limited(llm):
    comp = GrammarCompiler(llm.tokenizer_json, llm.vocab_size, llm.eos_token_ids, cache_bytes=1 << 20)
    n0 = comp.num_compiled
    a = comp.submit(S(json={"type": "integer"}))
    b = comp.submit(S(json='{"type": "integer"}'))
    assert a.result(60) is b.result(60) and comp.num_compiled == n0 + 1
    assert comp.submit(S(json={"type": "integer"})).result(60) is a.result()
    assert comp.num_compiled == n0 + 1
    for i in range(40):  # more than the byte limit holds: the oldest go, the total stays bounded
        comp.submit(S(regex=f"x{i}[a-z]{{1,3}}")).result(60)
        assert comp.cached_bytes <= comp.cache_bytes
    assert comp.submit(S(json={"type": "integer"})).result(60) is not a.result()  # evicted, compiled again
    err = comp.submit(S(grammar="root ::= foo")).exception(60)
    assert isinstance(err, GrammarError) and err.param == "structured_outputs.grammar" and "foo" in str(err)
    comp.shutdown()


def test_pending_compilations_are_bounded(llm):
    comp = GrammarCompiler(llm.tokenizer_json, llm.vocab_size, llm.eos_token_ids, max_workers=1, max_pending=1)
    first = comp.submit(S(regex="[0-9]{1,4}"))
    second = comp.submit(S(regex="[a-f]{1,4}"))
    if not first.done():  # the pool is busy with the first: the second is refused at once
        assert isinstance(second.exception(0), GrammarError)
    first.result(60)
    comp.shutdown()


def test_bad_constraints_fail_alone(llm):
    good = SamplingParams(temperature=0, max_tokens=8, structured_outputs=S(choice=("yes", "no")))
    bad = [S(json={"type": "objectx"}), S(regex="[a-"), S(grammar="root ::= missing"), S(json='{"$ref": "#/x"}')]
    outs = llm.generate(["hi"] * 6, [good] + [SamplingParams(max_tokens=8, structured_outputs=s) for s in bad]
                        + [SamplingParams(temperature=0, max_tokens=4)])
    assert outs[0].error is None and outs[0].text in ("yes", "no")
    for o, s in zip(outs[1:5], bad):
        assert o.error is not None and o.error["code"] == "invalid_request", o.error
        assert f"structured_outputs.{s.kind()}" in o.error["message"]
        assert o.error["param"] == f"structured_outputs.{s.kind()}"
    assert outs[5].error is None and len(outs[5].token_ids) == 4


def test_compile_timeout_fails_the_request(llm):
    from concurrent.futures import Future

    class Stuck:
        timeout_s = 0.2

        def submit(self, spec):
            return Future()  # never completes

    engine = llm.engine
    saved = engine.grammars
    engine.grammars = Stuck()
    try:
        t = time.perf_counter()
        out = llm.generate(["hi", "hi"], [SamplingParams(max_tokens=4, structured_outputs=S(regex="a+")),
                                          SamplingParams(temperature=0, max_tokens=3)])
        assert time.perf_counter() - t < 30
    finally:
        engine.grammars = saved
    assert out[0].error["code"] == "invalid_request" and "took more than" in out[0].error["message"]
    assert out[1].error is None and len(out[1].token_ids) == 3


def test_constraint_after_think(llm):
    """With ``after_token_id`` the output is free until that token, then constrained (the bias forces the token
    first; after it only the grammar's tokens are allowed, so the bias cannot force it again)."""
    end = 128822  # </think>
    p = SamplingParams(temperature=0, max_tokens=12, logit_bias={end: 100.0},
                       structured_outputs=S(choice=("alpha", "beta"), after_token_id=end))
    out = llm.generate(["hi"], p)[0]
    assert out.error is None and out.token_ids[0] == end
    assert llm.decode(out.token_ids[1:]) in ("alpha", "beta") and out.finish_reason == "stop"


def test_preempted_request_replays_its_matcher():
    from deepinfer.structured import RequestMatcher

    import xgrammar as xgr

    # the matcher of a resumed request starts from its output so far
    info = xgr.TokenizerInfo(["<eos>", "a", "b", "c"], stop_token_ids=[0])
    g = xgr.GrammarCompiler(info, cache_enabled=False).compile_regex("ab+c")
    m = RequestMatcher(g, None, [1, 2, 2])
    assert not m.failed and m.accept(3) and m.accept(0)
    assert not RequestMatcher(g, None, [2]).accept(1)  # "b" first breaks the grammar
    later = RequestMatcher(g, 9, [2, 9, 1])
    assert later.active and not later.failed


def test_rejected_token_fails_that_request(llm, monkeypatch):
    from deepinfer.structured import RequestMatcher

    def reject(self, token_id):
        self.failed = True
        return False

    monkeypatch.setattr(RequestMatcher, "accept", reject)
    out = llm.generate(["hi", "hi"], [SamplingParams(temperature=0, max_tokens=4, structured_outputs=S(regex="a+")),
                                      SamplingParams(temperature=0, max_tokens=3)])
    assert out[0].error["code"] == "grammar_violation"
    assert out[1].error is None and len(out[1].token_ids) == 3


def test_a_grammar_that_matches_nothing_is_the_requests_error(llm):
    out = llm.generate(["hi", "hi"], [SamplingParams(temperature=0, max_tokens=4,
                                                     structured_outputs=S(grammar="root ::= root")),
                                      SamplingParams(temperature=0, max_tokens=3)])
    err = out[0].error
    assert err["code"] == "grammar_dead_end" and err["type"] == "invalid_request_error"
    assert err["param"] == "structured_outputs"
    assert out[1].error is None and len(out[1].token_ids) == 3


def test_chat_fields(llm):
    import json
    import re

    import jsonschema

    base = {"messages": [{"role": "user", "content": "reply in json"}], "max_tokens": 40, "temperature": 0,
            "thinking": {"type": "disabled"}}
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "b": {"type": "string", "enum": ["x", "y"]}},
              "required": ["a", "b"], "additionalProperties": False}
    bodies = [dict(base, response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema,
                                                                                 "strict": True}}),
              dict(base, response_format={"type": "json_object"}),
              dict(base, structured_outputs={"regex": "[a-z]{2,4}-[0-9]"}),
              dict(base, structured_outputs={"choice": ["yes", "no"]}),
              dict(base, structured_outputs={"grammar": 'root ::= "x" ("," "x")? ("," "x")?'}),
              dict(base, structured_outputs={"json": schema}),
              dict(base, structured_outputs={"regex": "[a-"}),
              dict(base, structured_outputs={"foo": 1}),
              dict(base, structured_outputs={"regex": "a", "choice": ["a"]}),
              dict(base, response_format={"type": "json_object"}, structured_outputs={"regex": "a"}),
              # thinking: the reasoning is free; the bias forces </think> first, then only the grammar counts
              dict(base, thinking={"type": "enabled"}, logit_bias={"128822": 100},
                   structured_outputs={"choice": ["yes", "no"]}),
              base]
    r = llm.chat(bodies)
    text = [x["choices"][0]["message"]["content"] if "choices" in x else None for x in r]
    jsonschema.validate(json.loads(text[0]), schema)
    assert isinstance(json.loads(text[1]), dict)
    assert re.fullmatch("[a-z]{2,4}-[0-9]", text[2]) and text[3] in ("yes", "no")
    assert re.fullmatch("x(,x)*", text[4])
    jsonschema.validate(json.loads(text[5]), schema)
    assert r[6]["error"]["param"] == "structured_outputs.regex" and "Unclosed" in r[6]["error"]["message"]
    assert r[7]["error"]["param"] == "structured_outputs.foo"
    assert r[8]["error"]["param"] == "structured_outputs" and r[9]["error"]["param"] == "structured_outputs"
    assert text[10] in ("yes", "no") and r[10]["choices"][0]["finish_reason"] == "stop"
    assert text[11] is not None


# ------------------------------------------------------------------ speculation: draft masks and rollback
@pytest.fixture(scope="module")
def spec_grammars():
    from deepinfer.chat import packaged_tokenizer_json

    comp = GrammarCompiler(packaged_tokenizer_json(), 129280, [1])
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "n": {"type": "integer", "minimum": 0, "maximum": 999},
                                               "tags": {"type": "array", "items": {"enum": ["a", "bc"]},
                                                        "maxItems": 3}},
              "required": ["name", "n"], "additionalProperties": False}
    specs = {"json": S(json=schema), "regex": S(regex="[a-c]{2,5}-[0-9]{1,3}(x|yz)?"),
             "grammar": S(grammar='root ::= "(" item ("," item){0,3} ")"\nitem ::= [0-9] | "ab" | "c"')}
    out = {k: comp.submit(s).result(60) for k, s in specs.items()}
    comp.shutdown()
    return out


V = 129280
W = -(-V // 32)


def _allowed(row: torch.Tensor) -> list[int]:
    import numpy as np

    return np.unpackbits(row.numpy().view(np.uint8), bitorder="little")[:V].nonzero()[0].tolist()


def _walk(compiled, rng, length: int, prefix=()) -> list[int]:
    """A random token path the grammar accepts (after the free ``prefix``), ending early at a stop token."""
    from deepinfer.structured import RequestMatcher

    m = RequestMatcher(compiled)
    mask = torch.empty((1, W), dtype=torch.int32)
    path = []
    while len(path) < length and not m.matcher.is_terminated():
        m.fill(mask, 0)
        ids = _allowed(mask[0])
        t = ids[rng.randrange(len(ids))] if rng.random() < 0.8 or 1 not in ids else 1
        assert m.accept(t)
        path.append(t)
    return list(prefix) + path


def _stepped_masks(compiled, after, done, drafts) -> tuple[torch.Tensor, int]:
    """The reference: a fresh matcher stepped one token at a time through ``drafts`` (while the grammar takes
    them), one :meth:`fill` per position."""
    from deepinfer.structured import RequestMatcher

    m = RequestMatcher(compiled, after, done)
    rows = torch.full((len(drafts) + 1, W), -1, dtype=torch.int32)
    m.fill(rows, 0)
    n = 0
    for i, t in enumerate(drafts):
        if t not in _allowed(rows[i]):
            break
        assert m.accept(t)
        n += 1
        if m.active and m.matcher.is_terminated():
            break
        m.fill(rows, i + 1)
    return rows, n


@pytest.mark.parametrize("kind", ["json", "regex", "grammar"])
@pytest.mark.parametrize("after", [None, 128822], ids=["always", "after_think"])
def test_draft_masks_equal_one_step_at_a_time(spec_grammars, kind, after):
    import random

    from deepinfer.structured import RequestMatcher

    g = spec_grammars[kind]
    rng = random.Random(f"{kind}-{after}")
    seen = {"all taken": 0, "one refused": 0, "stop token": 0}
    for trial in range(12):
        free = [rng.randrange(2, V) for _ in range(rng.randrange(3))] + [after] if after is not None else []
        path = _walk(g, rng, 14, free)
        cut = rng.randrange(len(path))
        k = rng.randrange(1, 7)
        drafts = path[cut:cut + k]
        if drafts and trial % 3 == 1:  # a draft the grammar rejects (where some token is refused)
            j = rng.randrange(len(drafts))
            ref, _ = _stepped_masks(g, after, path[:cut], drafts[:j])
            refused = set(range(V)) - set(_allowed(ref[j])) if j < len(ref) else set()
            if refused:
                drafts[j] = rng.choice(sorted(refused))
        m = RequestMatcher(g, after, path[:cut], max_rollback_tokens=8)
        before = torch.empty((1, W), dtype=torch.int32)
        m.fill(before, 0)
        # rows in a scrambled order of a larger bitmask, as a batch would hold them
        rows = rng.sample(range(len(drafts) + 4), len(drafts) + 1)
        bits = torch.zeros((len(drafts) + 4, W), dtype=torch.int32)
        n = m.fill_draft_masks(bits, rows, drafts)
        ref, n_ref = _stepped_masks(g, after, path[:cut], drafts)
        assert n == n_ref, (kind, trial)
        seen["all taken" if n == len(drafts) else "one refused"] += 1
        seen["stop token"] += 1 in drafts[:n]
        for i, r in enumerate(rows):  # past the drafts the grammar takes, all tokens allowed (as the reference)
            assert torch.equal(bits[r], ref[i]), (kind, trial, i)
        # the matcher is as it was: the same mask, and the path goes on
        again = torch.empty((1, W), dtype=torch.int32)
        m.fill(again, 0)
        assert torch.equal(again, before) and m.num_rollback_tokens == min(cut, 8)
        for t in path[cut:]:
            assert m.accept(t)
    assert seen["all taken"] and seen["one refused"], seen


def test_rollback_restores_the_state_exactly(spec_grammars):
    import random

    from deepinfer.structured import RequestMatcher

    g = spec_grammars["json"]
    rng = random.Random(3)
    path = [5, 128822] + _walk(g, rng, 12)  # two free tokens, then the grammar from </think>
    masks = []
    ref = RequestMatcher(g, 128822)
    for t in path + [None]:
        row = torch.empty((1, W), dtype=torch.int32)
        ref.fill(row, 0)
        masks.append((row, ref.active))
        if t is not None:
            ref.accept(t)
    m = RequestMatcher(g, 128822, max_rollback_tokens=5)
    for t in path:
        m.accept(t)
    assert m.num_rollback_tokens == 5
    for back in (2, 5, 0, 1, 3):
        m.rollback(back)
        pos = len(path) - back
        row = torch.empty((1, W), dtype=torch.int32)
        m.fill(row, 0)
        assert torch.equal(row, masks[pos][0]) and m.active == masks[pos][1]
        for t in path[pos:]:
            assert m.accept(t)
    with pytest.raises(ValueError, match="num_tokens must be an int in"):
        m.rollback(6)
    with pytest.raises(ValueError):
        m.rollback(-1)
    # a rejected token: failed is undone by the rollback
    bad = next(t for t in range(2, V) if t not in _allowed(masks[-1][0]))
    assert not m.accept(bad) and m.failed
    m.rollback(1)
    assert not m.failed
    row = torch.empty((1, W), dtype=torch.int32)
    m.fill(row, 0)
    assert torch.equal(row, masks[-1][0])
    # back over the activating token: inactive again, every token allowed
    m2 = RequestMatcher(g, 128822, max_rollback_tokens=3)
    for t in path[:3]:
        m2.accept(t)
    m2.rollback(2)
    assert not m2.active
    m2.fill(row, 0)
    assert bool((row == -1).all())


def test_draft_mask_argument_errors(spec_grammars):
    from deepinfer.structured import RequestMatcher

    bits = torch.zeros((4, W), dtype=torch.int32)
    with pytest.raises(ValueError, match="rows must hold"):
        RequestMatcher(spec_grammars["regex"], max_rollback_tokens=4).fill_draft_masks(bits, [0, 1], [5, 6])
    with pytest.raises(ValueError, match="max_rollback_tokens=2"):
        RequestMatcher(spec_grammars["regex"], max_rollback_tokens=2).fill_draft_masks(bits, [0, 1, 2, 3], [5, 6, 7])
    with pytest.raises(ValueError, match="max_rollback_tokens must be"):
        RequestMatcher(spec_grammars["regex"], max_rollback_tokens=-1)
    m = RequestMatcher(spec_grammars["regex"])  # no rollback: no drafts, row 0 only
    assert m.fill_draft_masks(bits, [2], []) == 0 and bits[2].any()


def test_json_keeps_the_schemas_property_order(llm):
    """Properties come out in their declared order (found by a newcomer: the canonical key sorted them)."""
    import json

    def schema(names):
        return {"type": "object", "properties": {n: {"type": "boolean"} for n in names}, "required": list(names),
                "additionalProperties": False}

    assert S(json=schema("ba")).cache_key() != S(json=schema("ab")).cache_key()
    assert S(json=schema("ba")).cache_key() == S(json=dict(reversed(list(schema("ba").items())))).cache_key()
    for names in ("ba", "zay"):
        out = llm.generate(["Answer:"], SamplingParams(temperature=0, max_tokens=40,
                                                        structured_outputs=S(json=schema(names))))[0]
        assert list(json.loads(out.text)) == list(names), out.text


def test_constrained_and_penalised_steps_overlap_and_match_in_order_runs(monkeypatch):
    """Async scheduling keeps overlapping with grammar and penalty rows: the next step's forward is enqueued
    before the step in flight is applied (its tokens reach the matchers behind that forward), and the outputs
    equal an in-order run's, seeded sampling included."""
    from deepinfer.llm import LLM
    from deepinfer.model_runner import ModelRunner

    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "yy"]}},
              "required": ["a", "b"]}
    params = [SamplingParams(temperature=0, max_tokens=24, structured_outputs=S(json=schema)),
              SamplingParams(temperature=0.9, seed=4, max_tokens=12, structured_outputs=S(regex="(ab|c)+d")),
              SamplingParams(temperature=0.8, seed=5, max_tokens=10, frequency_penalty=1.5, presence_penalty=0.5),
              SamplingParams(temperature=0, max_tokens=9, structured_outputs=S(choice=("yes", "no"))),
              SamplingParams(temperature=0, max_tokens=7)]
    prompts = [[5, 6, 7 + i] for i in range(len(params))]
    forced = []
    real_execute = ModelRunner.execute

    def execute(self, output, prev=None):
        pending = prev is not None and prev._result is None
        out = real_execute(self, output, prev)
        forced.append(pending and prev._result is not None)  # execute fetched prev's tokens itself
        return out

    monkeypatch.setattr(ModelRunner, "execute", execute)
    runs = {}
    for async_ in (False, True):
        forced.clear()
        llm = LLM("tiny", async_scheduling=async_, max_num_seqs=8)
        runs[async_] = [(g.token_ids, g.finish_reason, g.error) for g in llm.generate(prompts, params)]
        assert any(forced) == async_
    assert runs[True] == runs[False]
    assert all(err is None for _, _, err in runs[True])
