"""The tool-call grammar (``deepinfer.tool_grammar``, issue 20): the matcher on token sequences (the recipe's own
rendering of calls accepted; undeclared names, schema-violating arguments, markup spelled from other tokens and
stray markup refused), the ``tool_choice`` modes of each API, and end to end on the tiny random model, where only
the grammar can make a call valid."""

import json

import deepseek_recipe as R
import jsonschema
import pytest
from tokenizers import Tokenizer

from deepinfer.chat import ChatFrontend, RequestError, is_error_record, packaged_tokenizer_json
from deepinfer.structured import GrammarCompiler, StructuredOutputsParams
from deepinfer.tool_grammar import DSML_TOKEN, tool_call_structural_tag

xgr = pytest.importorskip("xgrammar")

TOK = packaged_tokenizer_json()
EOS = 1
THINK_END = 128822
LT = 30  # "<"
PARAMS = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "metric": {"type": "boolean"},
    "note": {"type": "string"},
    "where": {"$ref": "#/$defs/Point"}},
    "required": ["city", "days"], "additionalProperties": False,
    "$defs": {"Point": {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"],
                        "additionalProperties": False}}}
BOUNDED = {"type": "object", "properties": {k: PARAMS["properties"][k] for k in ("city", "days", "metric")},
           "required": ["city", "days"], "additionalProperties": False}  # what a random model finishes quickly
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "w", "parameters": PARAMS}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
FREE = {"type": "function", "function": {"name": "anything"}}  # no parameters: any keys, any values
USER = {"role": "user", "content": "Weather in Paris?"}
OFF = {"type": "disabled"}


@pytest.fixture(scope="module")
def hf():
    return Tokenizer.from_file(TOK)


@pytest.fixture(scope="module")
def dsml_id(hf):
    return hf.token_to_id(DSML_TOKEN)


@pytest.fixture(scope="module")
def compiler():
    gc = GrammarCompiler(TOK, 129280, [EOS])
    yield gc
    gc.shutdown()


def compile_tag(compiler, tools, mode, version="v4", block_open=False, parallel=True):
    tag = tool_call_structural_tag(tools, mode, version, block_open, parallel)
    return compiler.submit(StructuredOutputsParams(structural_tag=tag)).result()


def accepts(grammar, ids) -> bool:
    """The matcher takes every id and then EOS (the grammar is complete)."""
    m = xgr.GrammarMatcher(grammar)
    return all(m.accept_token(int(t)) for t in ids) and (m.is_terminated() or m.accept_token(EOS))


def rendered_calls(version: str, calls: list[dict], tools: list[dict]) -> str:
    """The text the recipe's encoder renders for an assistant turn with ``calls`` (``\\n\\n<｜DSML｜...>`` up to the
    end of the block)."""
    model = {"v4": "DeepSeek-V4-Pro", "v4.1": "DeepSeek-V4.1-Flash"}[version]
    enc = {"v4": R.DeepseekV4Encoding, "v4.1": R.DeepseekV41Encoding}[version]().with_tokenizer(
        R.Tokenizer.from_file(TOK))
    body = {"model": model, "thinking": OFF, "tools": tools, "messages": [
        USER, {"role": "assistant", "content": "", "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
            for i, (n, a) in enumerate((c["name"], c["arguments"]) for c in calls)]},
        *({"role": "tool", "tool_call_id": f"c{i}", "content": "ok"} for i in range(len(calls)))]}
    prompt = enc.render_conversation(R.ChatCompletionRequest(body).convert(R.ConversionOptions()).conversation).prompt
    start = prompt.index("</think>", prompt.index("Weather in Paris?")) + len("</think>")
    return prompt[start:prompt.index("<｜end▁of▁sentence｜>", start)]


CALLS = [{"name": "get_weather", "arguments": {"city": "Rome", "days": 3, "note": 'a "b" </c> ｜x',
                                               "where": {"lat": 1.5}}},
         {"name": "get_time", "arguments": {}},
         {"name": "anything", "arguments": {"q": "hi", "n": [1, {"a": None}]}}]


# ------------------------------------------------------------------ the matcher on token sequences
@pytest.mark.parametrize("version", ["v4", "v4.1"])
def test_the_recipes_rendering_of_calls_is_accepted(compiler, hf, version):
    tools = [WEATHER, CLOCK, FREE]
    text = rendered_calls(version, CALLS, tools)
    ids = hf.encode(text, add_special_tokens=False).ids
    assert text.startswith("\n\n<｜DSML｜")
    assert accepts(compile_tag(compiler, tools, "auto", version), ids)
    assert accepts(compile_tag(compiler, tools, "auto", version), hf.encode("Let me check." + text).ids)
    assert accepts(compile_tag(compiler, tools, "required", version), ids)
    opened = text.split("\n", 3)[3]  # the prompt of a required / named tool_choice ends with the opening line
    assert accepts(compile_tag(compiler, tools, "required", version, block_open=True),
                   hf.encode(opened, add_special_tokens=False).ids)
    assert not accepts(compile_tag(compiler, tools, "none", version), ids)


def _call(args: str, name: str = "get_weather") -> str:
    return (f'<｜DSML｜invoke name="{name}">\n{args}</｜DSML｜invoke>\n</｜DSML｜tool_calls>')


def _p(key: str, value: str, string: bool = False) -> str:
    return f'<｜DSML｜parameter name="{key}" string="{"true" if string else "false"}">{value}</｜DSML｜parameter>\n'


GOOD = _p("city", "Paris", True) + _p("days", "2")


@pytest.mark.parametrize("args, name, ok", [
    (GOOD, "get_weather", True),
    (GOOD + _p("metric", "true") + _p("note", "free <text>\n", True) + _p("where", '{"lat": -2}'), "get_weather",
     True),
    (GOOD, "get_weathers", False),  # undeclared tool
    (GOOD, "launch", False),
    (_p("city", "Berlin", True) + _p("days", "2"), "get_weather", False),  # enum
    (_p("city", "Paris", True) + _p("days", "9"), "get_weather", False),  # maximum
    (_p("city", "Paris", True) + _p("days", '"2"'), "get_weather", False),  # type
    (_p("city", "Paris", True) + _p("days", "2", True), "get_weather", False),  # an integer is JSON
    (_p("city", "Paris", True), "get_weather", False),  # required days
    (_p("days", "2") + _p("city", "Paris", True), "get_weather", False),  # declared order
    (GOOD + _p("extra", "1"), "get_weather", False),  # additionalProperties false
    (GOOD + _p("where", '{"lon": 1}'), "get_weather", False),  # $ref'd schema
    (GOOD + _p("note", "a｜DSML｜b", True), "get_weather", False),  # markup inside a value
    ("", "get_time", True),
    (_p("x", "1"), "get_time", True),  # properties {} without additionalProperties false: any keys
])
def test_calls_are_checked_against_the_declared_tools(compiler, hf, args, name, ok):
    g = compile_tag(compiler, [WEATHER, CLOCK], "required", block_open=True)
    assert accepts(g, hf.encode(_call(args, name), add_special_tokens=False).ids) is ok


def test_markup_must_be_the_dsml_token(compiler, hf, dsml_id):
    """The recipe's parser reads markup by the ``｜DSML｜`` token: the same text spelled from other tokens is
    refused in the block and in free text."""
    g = compile_tag(compiler, [WEATHER], "auto")
    ids = hf.encode("\n\n<｜DSML｜tool_calls>\n" + _call(GOOD), add_special_tokens=False).ids
    assert accepts(g, ids)
    spelled = hf.encode("｜", add_special_tokens=False).ids + hf.encode("DSML", add_special_tokens=False).ids \
        + hf.encode("｜", add_special_tokens=False).ids
    i = ids.index(dsml_id)
    assert not accepts(g, ids[:i] + spelled + ids[i + 1:])
    for text in ("a ｜DSML｜ b", "x <｜DSML｜invoke", "x </｜DSML｜tool_calls>"):
        assert not accepts(g, hf.encode(text, add_special_tokens=False).ids), text
    assert accepts(g, hf.encode("if a < b then </x> ｜ DSML", add_special_tokens=False).ids)


def test_auto_none_and_required_shapes(compiler, hf):
    auto = compile_tag(compiler, [WEATHER], "auto")
    block = "\n\n<｜DSML｜tool_calls>\n" + _call(GOOD)
    enc = lambda s: hf.encode(s, add_special_tokens=False).ids  # noqa: E731
    assert accepts(auto, enc("plain text")) and accepts(auto, enc(""))
    assert not accepts(auto, enc(block + "more text"))  # the answer ends with the block
    assert not accepts(auto, enc("a</think>b"))
    none = compile_tag(compiler, [], "none")
    assert accepts(none, enc("plain text")) and not accepts(none, enc(block))
    required = compile_tag(compiler, [WEATHER], "required")
    assert accepts(required, enc(block)) and not accepts(required, enc("plain text"))
    assert not accepts(required, enc("text" + block))
    two = block.replace("</｜DSML｜tool_calls>", _call("").replace("get_weather", "get_time"))
    assert accepts(compile_tag(compiler, [WEATHER, CLOCK], "auto"), enc(two))
    single = compile_tag(compiler, [WEATHER, CLOCK], "auto", parallel=False)  # parallel_tool_calls false
    assert accepts(single, enc(block)) and not accepts(single, enc(two))
    with pytest.raises(ValueError):
        tool_call_structural_tag([], "required")
    with pytest.raises(ValueError):
        tool_call_structural_tag([WEATHER], "sometimes")


def test_a_schema_xgrammar_cannot_compile_names_tools(compiler):
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}, "required": ["a"]}}}
    fut = compiler.submit(StructuredOutputsParams(structural_tag=tool_call_structural_tag([bad], "auto"),
                                                  error_param="tools"))
    with pytest.raises(ValueError) as e:
        fut.result()
    assert e.value.param == "tools" and str(e.value).startswith("tools: xgrammar cannot compile it")


# ------------------------------------------------------------------ tool_choice modes per API
@pytest.fixture(scope="module")
def fe():
    return ChatFrontend(TOK, "tiny-test", max_model_len=4096, eos_token_id=1, created=0)


def _format(pc) -> dict | None:
    so = pc.params.structured_outputs
    return so.structural_tag["format"] if so is not None and so.structural_tag else None


WEATHER_MSG = {"name": "get_weather", "input_schema": BOUNDED}
WEATHER_RESP = {"type": "function", "name": "get_weather", "parameters": BOUNDED}


@pytest.mark.parametrize("api, body, expect", [
    ("chat", {"messages": [USER], "thinking": OFF, "tools": [WEATHER]}, "auto"),
    ("chat", {"messages": [USER], "tools": [WEATHER]}, "auto"),  # thinking: after </think>
    ("chat", {"messages": [USER], "thinking": OFF, "tools": [WEATHER], "tool_choice": "required"}, "open"),
    ("chat", {"messages": [USER], "thinking": OFF, "tools": [WEATHER, CLOCK],
              "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "open"),
    ("chat", {"messages": [USER], "thinking": OFF, "tools": [WEATHER], "tool_choice": "none"}, "none"),
    ("chat", {"messages": [USER], "thinking": OFF}, None),
    ("chat", {"messages": [USER], "thinking": OFF, "tools": [WEATHER], "tool_choice": "none",
              "structured_outputs": {"regex": "a+"}}, "user"),
    ("messages", {"messages": [USER], "max_tokens": 64, "tools": [WEATHER_MSG]}, "auto"),
    ("messages", {"messages": [USER], "max_tokens": 64, "tools": [WEATHER_MSG], "tool_choice": {"type": "any"}},
     "required"),
    ("messages", {"messages": [USER], "max_tokens": 2048, "tools": [WEATHER_MSG], "tool_choice": {"type": "any"},
                  "thinking": {"type": "enabled", "budget_tokens": 1024}}, "required"),
    ("messages", {"messages": [USER], "max_tokens": 64, "tools": [WEATHER_MSG],
                  "tool_choice": {"type": "tool", "name": "get_weather"}}, "open"),
    ("messages", {"messages": [USER], "max_tokens": 64, "tools": [WEATHER_MSG], "tool_choice": {"type": "none"}},
     "none"),
    ("messages", {"messages": [USER], "max_tokens": 64, "tools": [WEATHER_MSG],
                  "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}}, "auto"),
    ("responses", {"input": "hi", "tools": [WEATHER_RESP]}, "auto"),
    ("responses", {"input": "hi", "reasoning": {"effort": "none"}, "tools": [WEATHER_RESP],
                   "tool_choice": "required"}, "open"),
])
def test_tool_choice_modes(fe, api, body, expect):
    pc = fe.prepare(body, api=api)
    fmt = _format(pc)
    so = pc.params.structured_outputs
    if expect is None:
        assert so is None
        return
    if expect == "user":
        assert so.regex == "a+"
        return
    assert so.error_param == "tools"
    assert so.after_token_id == (THINK_END if pc.thinking else None)
    dump = json.dumps(fmt)
    kind = {"auto": "sequence", "none": "any_text", "required": "sequence", "open": "sequence"}[expect]
    assert fmt["type"] == kind
    if expect == "none":
        return
    named = "get_time" in json.dumps(body.get("tool_choice"))
    assert ("get_time" in dump) == named and ("get_weather" in dump) != named  # a named choice: that tool only
    assert ('"plus"' in dump) != ("disable_parallel_tool_use" in json.dumps(body))  # one call, or one or more
    if expect == "auto":
        assert fmt["elements"][0]["type"] == "any_text" and fmt["elements"][1]["type"] == "optional"
    elif expect == "required":
        assert fmt["elements"][0] == {"type": "const_string", "value": "\n\n"}
    else:  # the prompt opened the block: the answer starts at the first call
        assert pc.starts_in_tool_calls and fmt["elements"][0]["type"] == "plus"


def test_structured_outputs_with_a_tool_grammar_is_a_400(fe):
    with pytest.raises(RequestError) as e:
        fe.prepare({"messages": [USER], "thinking": OFF, "tools": [WEATHER], "structured_outputs": {"regex": "a"}})
    assert e.value.record["param"] == "structured_outputs" and "tools" in str(e.value)


# ------------------------------------------------------------------ end to end on the tiny random model
@pytest.fixture(scope="module")
def llm():
    from deepinfer.llm import LLM

    return LLM("tiny")


WEATHER_B = {"type": "function", "function": {"name": "get_weather", "parameters": BOUNDED}}
CLOCK_B = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}}, "required": ["zone"]}}}
SCHEMAS = {"get_weather": BOUNDED, "get_time": CLOCK_B["function"]["parameters"]}
# toward "<" then the DSML token: where the grammar lets it, a random model opens a calls block
OPEN_BLOCK = {str(LT): 60, "128825": 60}


def _calls(out: dict) -> list:
    calls = out["choices"][0]["message"].get("tool_calls") or []
    for c in calls:
        jsonschema.validate(json.loads(c["function"]["arguments"]), SCHEMAS[c["function"]["name"]])
    return calls


def test_required_and_named_calls_parse_with_schema_valid_arguments(llm):
    base = {"messages": [USER], "thinking": OFF, "max_tokens": 300, "tools": [WEATHER_B, CLOCK_B]}
    plain = {"messages": [USER], "thinking": OFF, "max_tokens": 12, "temperature": 0}
    bodies = [dict(base, tool_choice="required", temperature=0, seed=1),
              dict(base, tool_choice="required", temperature=1.0, seed=5),
              dict(base, tool_choice={"type": "function", "function": {"name": "get_time"}}, temperature=0),
              dict(base, tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0.8,
                   seed=2),
              plain]
    outs = llm.chat(bodies)
    assert not any(is_error_record(o) for o in outs), outs
    for o in outs[:4]:
        msg = o["choices"][0]["message"]
        assert o["choices"][0]["finish_reason"] == "tool_calls" and not (msg.get("content") or "").strip()
        assert _calls(o) and DSML_TOKEN not in json.dumps(o)
    assert {c["function"]["name"] for c in _calls(outs[2])} == {"get_time"}
    assert {c["function"]["name"] for c in _calls(outs[3])} == {"get_weather"}
    assert outs[4]["choices"][0]["message"]["content"]  # the unconstrained request in the batch is answered
    alone = llm.chat([bodies[0]])[0]
    assert alone["choices"][0]["message"] == outs[0]["choices"][0]["message"]  # batched == alone


def test_auto_none_and_thinking(llm):
    base = {"messages": [USER], "thinking": OFF, "max_tokens": 300, "tools": [WEATHER_B], "temperature": 0}
    # auto: the bias opens a block, the grammar fills it (one call: the bias would open calls until max_tokens)
    bodies = [dict(base, logit_bias=OPEN_BLOCK, parallel_tool_calls=False),
              dict(base, max_tokens=16),  # auto: free text
              dict(base, tool_choice="none", max_tokens=16, logit_bias=OPEN_BLOCK),  # no call can start
              # thinking: the reasoning is free; </think> first, then the block
              dict(base, thinking={"type": "enabled"}, logit_bias={str(THINK_END): 100, **OPEN_BLOCK},
                   parallel_tool_calls=False)]
    sampled = [dict(b, temperature=1.0, seed=30 + i) for i, b in enumerate(bodies[:3])]
    plain = {"messages": [USER], "thinking": OFF, "max_tokens": 10, "temperature": 0.9, "seed": 3}
    outs = llm.chat(bodies + sampled + [plain])  # greedy and sampled, with an unconstrained request
    assert not any(is_error_record(o) for o in outs), outs
    outs, sampled, plain = outs[:4], outs[4:7], outs[7]
    assert plain["choices"][0]["message"]["content"]
    for o, mode in zip(sampled, ("auto, opened", "auto", "none")):  # sampled: the same shapes as greedy
        calls, content = _calls(o), o["choices"][0]["message"]["content"] or ""
        assert DSML_TOKEN not in content and DSML_TOKEN not in json.dumps(calls), (mode, o)
        if mode == "auto, opened":
            assert len(calls) == 1 and o["choices"][0]["finish_reason"] == "tool_calls", o
        elif mode == "auto":
            assert bool(calls) == (o["choices"][0]["finish_reason"] == "tool_calls")
        else:
            assert not calls and content.count("<") >= 8
    assert [c["function"]["name"] for c in _calls(outs[0])] == ["get_weather"]
    assert outs[0]["choices"][0]["finish_reason"] == "tool_calls"
    for o in outs[1:3]:
        assert not _calls(o) and DSML_TOKEN not in o["choices"][0]["message"]["content"]
    assert outs[2]["choices"][0]["message"]["content"].count("<") >= 8  # the bias held; the markup could not open
    assert _calls(outs[3]) and outs[3]["choices"][0]["message"]["reasoning_content"] == ""
    assert outs[3]["choices"][0]["finish_reason"] == "tool_calls"
    # Messages' any: the prompt does not open the block; the answer must (thinking off: Anthropic's default)
    msg = llm.chat([{"messages": [USER], "max_tokens": 300, "tools": [{"name": "get_weather", "input_schema": BOUNDED}],
                     "tool_choice": {"type": "any"}, "temperature": 0}], api="messages")[0]
    uses = [b for b in msg["content"] if b["type"] == "tool_use"]
    assert msg["stop_reason"] == "tool_use" and len(uses) >= 1, msg
    jsonschema.validate(uses[0]["input"], BOUNDED)

