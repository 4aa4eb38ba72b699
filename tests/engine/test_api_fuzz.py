"""Seeded fuzz of the three chat APIs' bodies through ``deepinfer generate`` (issue 25 acceptance): each body is a
valid one with one to three fields replaced by random JSON values (types, ranges, nesting, unicode), at the top
level or at a random path inside a valid value (``messages[0].content``, ``tools[0].function.parameters``, ...),
written as JSON text lines beside good ones. Every line yields, in order, a response or an error record whose
``param`` is rooted at a field the case changed; nothing else raises. Each case's ``prepare`` stays under
``CASE_BUDGET_BYTES`` of Python allocations (tracemalloc peak). Fixed seed; the model is the fake one, so the run
costs the checks and the rendering only.
"""

from __future__ import annotations

import copy
import json
import random
import tracemalloc

import pytest

from deepinfer.api_checks import FIELDS, UNSUPPORTED
from deepinfer.chat import ChatFrontend, RequestError, is_error_record, packaged_tokenizer_json
from deepinfer.cli import build_parser, run_generate
from fake_model import FakeConfig, FakeModel

SEED = 2526
CASES = 48  # per API
GOOD_EVERY = 4  # a good line after every 4th case
CASE_BUDGET_BYTES = 64 << 20  # the most Python memory one body's checks and rendering may allocate
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
BASES = {
    "chat": {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
             "max_tokens": 1, "tools": [{"type": "function", "function": {"name": "f", "parameters": WEATHER}}],
             "thinking": {"type": "disabled"}},
    "messages": {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 1,
                 "system": "Be brief.", "tools": [{"name": "f", "input_schema": WEATHER}]},
    "responses": {"input": [{"role": "user", "content": "hi"}], "max_output_tokens": 1, "instructions": "Be brief.",
                  "tools": [{"type": "function", "name": "f", "parameters": WEATHER}]},
}
# codes of refusals that name no field because none is at fault (the body is fine, the engine cannot run it)
NO_FIELD_CODES = {"context_length_exceeded", "cache_exhausted"}


def _value(rng: random.Random, depth: int = 0):
    kinds = [
        lambda: None, lambda: rng.choice([True, False]), lambda: rng.choice([0, 1, -1, 2, 7, 2 ** 31, 2 ** 63, -2 ** 70]),
        lambda: rng.choice([0.5, -1.5, 4.0, 1e-320, 1e308, float("nan"), float("inf")]),
        lambda: rng.choice(["", "x", "auto", "none", "required", "text", "function", "\ud800", "😀 ٣",
                            "\u2028", "<｜end▁of▁sentence｜>", "</think>", "x" * 3000]),
        lambda: [_value(rng, depth + 1) for _ in range(rng.randrange(4))],
        lambda: {rng.choice(["type", "name", "role", "content", "text", "function", "x"]): _value(rng, depth + 1)
                 for _ in range(rng.randrange(3))},
        lambda: _nest(rng),
    ]
    return rng.choice(kinds[:5] if depth >= 3 else kinds)()


def _nest(rng: random.Random):
    v = rng.choice([0, "x", {}])
    for _ in range(rng.choice([10, 70, 500])):
        v = [v] if rng.random() < 0.5 else {"k": v}
    return v


def _near(rng: random.Random, v):
    """A value of ``v``'s own JSON type (a string stays a string, a number a small number): often still valid."""
    if isinstance(v, bool):
        return not v
    if isinstance(v, (int, float)):
        return rng.choice([1, 2, 3, 0.5]) if isinstance(v, float) else rng.randrange(1, 5)
    if isinstance(v, str):
        return rng.choice(["x", "😀 ٣", "</think>", "<｜User｜>", "auto", "a\u2028b", "f"])
    return copy.deepcopy(v)


def _paths(v, path=()):
    """The paths inside a value (keys and indices) down to 6 levels, the value's own first."""
    yield path
    if len(path) >= 6:
        return
    if isinstance(v, dict):
        for k, x in v.items():
            yield from _paths(x, (*path, k))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            yield from _paths(x, (*path, i))


def _mutate(rng: random.Random, api: str) -> tuple[dict, set[str]]:
    body, changed = copy.deepcopy(BASES[api]), set()
    for _ in range(rng.randrange(1, 4)):
        if rng.random() < 0.4:
            r = rng.random()
            name = rng.choice(list(FIELDS[api]) if r < 0.8 else list(UNSUPPORTED) if r < 0.95 else ["zz_unknown"])
            body[name] = _value(rng)
        else:  # a random path inside a field the body holds
            name = rng.choice(sorted(set(body) & set(BASES[api])))
            path = rng.choice(list(_paths(body[name])))
            if not path:
                body[name] = _value(rng)
            else:
                node = body[name]
                for p in path[:-1]:
                    node = node[p]
                r = rng.random()
                if r < 0.15 and isinstance(node, dict):
                    node.pop(path[-1])
                else:
                    node[path[-1]] = _near(rng, node[path[-1]]) if r < 0.5 else _value(rng)
        changed.add(name)
    return body, changed


def _cases(api: str):
    rng = random.Random(f"{SEED}-{api}")
    return [_mutate(rng, api) for _ in range(CASES)]


def _root(param: str) -> str:
    return param.split("[")[0].split(".")[0]


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_fuzzed_bodies_through_generate_answer_every_line(tmp_path, api):
    cases = _cases(api)
    good = json.dumps(BASES[api])
    lines, where = [], []  # where: each case's line index
    for i, (body, _) in enumerate(cases):
        where.append(len(lines))
        lines.append(json.dumps(body))
        if i % GOOD_EVERY == GOOD_EVERY - 1:
            lines.append(good)
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_bytes("\n".join(lines).encode("utf-8", "surrogatepass") + b"\n")
    args = build_parser().parse_args(["generate", "--input", str(inp), "--output", str(out), "--created", "0",
                                      "--no-progress", "--api", api])
    assert run_generate(args, model_obj=FakeModel(FakeConfig(max_position_embeddings=4096))) == 0
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(recs) == len(lines)
    for j in set(range(len(lines))) - set(where):  # the good lines between the cases are answered
        assert not is_error_record(recs[j]) and "line" not in recs[j], (j, recs[j])
    kinds = set()
    for i, ((body, changed), j) in enumerate(zip(cases, where)):
        rec = recs[j]
        if "line" not in rec:
            kinds.add("response")
            continue
        err = rec["error"]
        assert rec["line"] == j + 1 and set(err) >= {"message", "type", "code", "param"}, rec
        assert "Traceback" not in err["message"] and not err["message"].startswith("invalid request: "), rec
        if err["param"] is None:
            assert err["code"] in NO_FIELD_CODES or err["code"] == "invalid_json", (changed, body, err)
        else:
            assert _root(err["param"]) in changed, (changed, err)
        kinds.add("error")
    assert kinds == {"response", "error"}  # both outcomes are reached


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_fuzzed_bodies_stay_within_a_memory_budget(api):
    fe = ChatFrontend(packaged_tokenizer_json(), "tiny-test", max_model_len=4096, eos_token_id=1, created=0)
    fe.prepare(BASES[api], api=api).close()  # first-use caches are not a case's allocations
    tracemalloc.start()
    try:
        for body, changed in _cases(api):
            tracemalloc.reset_peak()
            before = tracemalloc.get_traced_memory()[0]
            try:
                fe.prepare(body, api=api).close()
            except RequestError:
                pass
            peak = tracemalloc.get_traced_memory()[1] - before
            assert peak < CASE_BUDGET_BYTES, (changed, peak)
    finally:
        tracemalloc.stop()
