"""The structured-output suite on the tiny random model: its weights are random, so only the grammar can make its
output valid. 43 JSON schemas, 10 regexes and 5 EBNF grammars, greedy and sampled, batched together with
unconstrained requests and alone; every output must finish (``stop``) and validate with ``jsonschema`` or match its
regex / grammar fully."""

import json
import re

import pytest

from deepinfer.sequence import SamplingParams
from deepinfer.structured import StructuredOutputsParams as S

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

MAX_TOKENS = 64
S8 = {"type": "string", "maxLength": 8}
INT = {"type": "integer", "minimum": -50, "maximum": 50}


def obj(props: dict, required=None, **kw) -> dict:
    return {"type": "object", "properties": props, "required": list(props) if required is None else required,
            "additionalProperties": False, **kw}


SCHEMAS = [
    {"type": "integer", "minimum": 0, "maximum": 9},
    {"type": "integer", "minimum": -1000, "maximum": -10},
    {"type": "boolean"},
    {"type": "null"},
    {"type": "string", "maxLength": 5},
    {"type": "string", "minLength": 2, "maxLength": 4},
    {"type": "string", "pattern": "^[A-Z][a-z]{1,4}$"},
    {"type": "string", "pattern": "^[0-9]{3}-[0-9]{2}$"},
    {"enum": ["red", "green", "blue"]},
    {"enum": [1, "two", None, True]},
    {"const": "fixed"},
    {"type": "string", "format": "date"},
    {"type": "string", "enum": ["\u03b1", "\u03b2\u03b3"]},
    {"type": "string", "pattern": "^[a-z]{1,4}@[a-z]{1,3}\\.com$"},
    {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 5},
    {"type": "array", "items": INT, "maxItems": 3},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 3},
    {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 4},
    {"type": "array", "prefixItems": [{"type": "integer", "minimum": 0, "maximum": 3}, {"const": "x"}],
     "items": False},
    obj({"a": INT}),
    obj({"a": INT, "b": {"type": "boolean"}}),
    obj({"name": S8, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    obj({"a": INT, "b": S8}, required=["a"]),
    obj({"tag": {"enum": ["x", "y"]}, "n": {"type": "integer", "minimum": 1, "maximum": 5}}),
    obj({"inner": obj({"x": INT, "y": INT})}),
    obj({"outer": obj({"inner": obj({"leaf": {"type": "boolean"}})})}),
    obj({"items": {"type": "array", "items": obj({"id": INT}), "maxItems": 2}}),
    obj({"point": {"type": "array", "items": INT, "minItems": 2, "maxItems": 2}, "label": S8}),
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "boolean"}]},
    {"anyOf": [obj({"kind": {"const": "a"}, "v": INT}), obj({"kind": {"const": "b"}, "w": {"type": "boolean"}})]},
    {"oneOf": [{"type": "null"}, {"type": "string", "maxLength": 3}]},
    {"oneOf": [obj({"cat": {"const": True}}), obj({"dog": {"const": True}})]},
    {"$defs": {"p": obj({"x": INT})}, "$ref": "#/$defs/p"},
    {"$defs": {"p": obj({"x": INT})}, "type": "array", "items": {"$ref": "#/$defs/p"}, "maxItems": 2},
    obj({"a": {"$ref": "#/$defs/e"}, "b": {"$ref": "#/$defs/e"}}, **{"$defs": {"e": {"enum": [0, 1]}}}),
    obj({"score": {"type": "integer", "minimum": 10, "maximum": 20}, "ok": {"type": "boolean"}}),
    obj({"code": {"type": "string", "pattern": "^[a-f0-9]{4}$"}, "n": {"type": "null"}}),
    obj({"when": {"type": "string", "format": "date"}, "tags": {"type": "array", "items": {"enum": ["p", "q"]},
                                                                 "maxItems": 2}}),
    obj({"a": {"type": ["integer", "null"], "minimum": 0, "maximum": 5}}),
    obj({"x": {"anyOf": [INT, {"type": "null"}]}, "y": {"oneOf": [{"const": "u"}, {"const": "v"}]}}),
    # formats xgrammar bounds (its date-time / time allow unbounded fractional seconds, email / hostname unbounded
    # names: a random model runs them to max_tokens)
    {"type": "string", "format": "uuid"},
    {"type": "string", "format": "ipv6"},
    obj({"id": {"type": "string", "format": "uuid"}, "addr": {"type": "string", "format": "ipv6"},
         "on": {"type": "string", "format": "date"}}, required=["id"]),
]

REGEXES = [
    r"[a-z]{3}", r"\d{1,3}", r"(yes|no)", r"[A-Z][a-z]{0,5}", r"\d{4}-\d{2}-\d{2}", r"0x[0-9a-f]{1,4}",
    r"(cat|dog)s?", r"[a-c]+-[x-z]{2}", r"\(\d\)", r"[+-]?\d{1,2}\.\d",
]

GRAMMARS = [
    ('root ::= "a" | "b" | "c"', r"[abc]"),
    ('root ::= digit digit?\ndigit ::= [0-9]', r"[0-9]{1,2}"),
    ('root ::= "(" item ("," item)? ")"\nitem ::= [a-z]', r"\([a-z](,[a-z])?\)"),
    ('root ::= ("true" | "false") " " op " " ("true" | "false")\nop ::= "and" | "or"',
     r"(true|false) (and|or) (true|false)"),
    ('root ::= "SELECT " col " FROM t"\ncol ::= "a" | "b" | "*"', r"SELECT (a|b|\*) FROM t"),
]

CASES = ([("json", s) for s in SCHEMAS] + [("regex", r) for r in REGEXES]
         + [("grammar", g) for g in GRAMMARS])


def spec_of(kind, c) -> S:
    return S(json=c) if kind == "json" else S(regex=c) if kind == "regex" else S(grammar=c[0])


def check(kind, c, out) -> None:
    assert out.error is None, out.error
    assert out.finish_reason == "stop", (kind, c, out.text)
    if kind == "json":
        jsonschema.validate(json.loads(out.text), c, format_checker=jsonschema.FormatChecker())
    else:
        assert re.fullmatch(c if kind == "regex" else c[1], out.text), (c, out.text)


def test_suite_size():
    assert len(SCHEMAS) >= 40 and len(REGEXES) >= 10 and len(GRAMMARS) >= 5


@pytest.fixture(scope="module")
def llm():
    from deepinfer.llm import LLM

    return LLM("tiny")


def _params(kind, c, sampled: bool, i: int) -> SamplingParams:
    if sampled:
        return SamplingParams(temperature=1.0, seed=1000 + i, max_tokens=MAX_TOKENS, structured_outputs=spec_of(kind, c))
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=spec_of(kind, c))


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_suite_batched_with_unconstrained(llm, sampled):
    free = [SamplingParams(temperature=0.8 if sampled else 0, seed=7, max_tokens=24) for _ in range(4)]
    params = [_params(k, c, sampled, i) for i, (k, c) in enumerate(CASES)]
    outs = llm.generate(["Answer:"] * (len(params) + len(free)), params[:20] + free[:2] + params[20:] + free[2:])
    cons = outs[:20] + outs[22:-2]
    for (kind, c), out in zip(CASES, cons):
        check(kind, c, out)
    for out in outs[20:22] + outs[-2:]:  # the unconstrained requests run their full length
        assert out.error is None and len(out.token_ids) == 24


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_suite_alone(llm, sampled):
    for i, (kind, c) in enumerate(CASES[::6]):
        check(kind, c, llm.generate(["Answer:"], _params(kind, c, sampled, i))[0])


def test_same_schema_compiled_once_and_bad_ones_fail_alone(llm):
    """Equal schemas (any key order, dict or text) in one batch compile once; a schema, regex and grammar that
    xgrammar refuses fail their own requests with records naming the field, and the batch goes on."""
    schema = obj({"q": {"enum": ["a", "b"]}, "r": {"type": "boolean"}})
    spellings = [schema, json.dumps(schema), json.dumps(schema, sort_keys=True, indent=2),
                 dict(reversed(list(schema.items())))]
    bad = [S(json={"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}}), S(regex="(ab"),
           S(grammar='root ::= "a" undefined_rule')]
    n0 = llm.grammars.num_compiled
    params = [SamplingParams(temperature=t, seed=i, max_tokens=MAX_TOKENS, structured_outputs=S(json=s))
              for i, s in enumerate(spellings) for t in (0, 1.0)]
    params[3:3] = [SamplingParams(max_tokens=8, structured_outputs=b) for b in bad]
    params.append(SamplingParams(temperature=0, max_tokens=6))
    outs = llm.generate(["Answer:"] * len(params), params)
    for o in outs[:3] + outs[6:-1]:
        assert o.error is None and o.finish_reason == "stop"
        jsonschema.validate(json.loads(o.text), schema)
    for o, b in zip(outs[3:6], bad):
        assert o.error["code"] == "invalid_request" and o.error["param"] == f"structured_outputs.{b.kind()}"
    assert outs[-1].error is None and len(outs[-1].token_ids) == 6
    assert llm.grammars.num_compiled == n0 + 1  # one for the four spellings (failures are not kept)
    llm.generate(["Again:"], params[0])
    assert llm.grammars.num_compiled == n0 + 1  # cached
