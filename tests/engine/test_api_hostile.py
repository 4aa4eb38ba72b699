"""Issue 25, items 3-7 (request and output side): usage from sampled tokens, the Messages contract, field checks
that name the field, tool calls the request did not allow, hidden special tokens, logprobs shapes."""

from __future__ import annotations

import json
import random

import pytest

from deepinfer import LLM
from deepinfer.api_checks import MAX_NESTING, MAX_OUTPUT_TOKENS, MAX_STOP_SEQUENCES
from deepinfer.chat import ChatFrontend, RequestError, is_error_record, packaged_tokenizer_json
from fake_model import FakeConfig, FakeModel, ScriptedModel

TOK = packaged_tokenizer_json()
USER = {"role": "user", "content": "What's the weather in Paris?"}
OFF = {"type": "disabled"}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
WEATHER_MSG = {"name": "get_weather", "description": "w", "input_schema": WEATHER["function"]["parameters"]}
WEATHER_RESP = {"type": "function", **WEATHER["function"]}
THINK_END = 128822


def dsml(name: str, value: str, string: str = "true") -> str:
    return (f"<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"{name}\">\n<｜DSML｜parameter name=\"city\" "
            f"string=\"{string}\">{value}</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>")


@pytest.fixture(scope="module")
def fe():
    return ChatFrontend(TOK, "tiny-test", max_model_len=4096, eos_token_id=1, created=0)


def run(fe, body, ids, reason="stop", api="chat", top=None):
    pc = fe.prepare(body, api=api)
    for t in ids:
        if pc.push_token(t, -0.5, top(t) if top else None):
            break
    return pc.finish(reason)


# ------------------------------------------------------------------ item 3: usage
def test_reasoning_tokens_never_exceed_completion_tokens(fe):
    """Thinking-mode answers cut by length inside the reasoning: every sampled token is a reasoning token (the recipe
    re-tokenised the text and reported e.g. 12 reasoning of 10 completion tokens)."""
    rng = random.Random(0)
    for trial in range(120):
        n = rng.randrange(1, 12)
        ids = [rng.randrange(3, 128000) for _ in range(n)]
        u = run(fe, {"messages": [USER], "max_tokens": 12, "seed": trial}, ids, "length")["usage"]
        assert u["completion_tokens"] == n and u["completion_tokens_details"]["reasoning_tokens"] == n, (trial, u)
        assert u["total_tokens"] == u["prompt_tokens"] + n


@pytest.mark.parametrize("api,body", [
    ("chat", {"messages": [USER], "max_tokens": 40}),
    ("responses", {"input": "hi", "max_output_tokens": 40}),
])
def test_reasoning_tokens_are_the_tokens_before_think_end(fe, api, body):
    ids = fe.tokenizer.encode("I think hard.") + [THINK_END] + fe.tokenizer.encode("Four.")
    k = ids.index(THINK_END)
    u = run(fe, body, ids, api=api)["usage"]
    if api == "chat":
        assert (u["completion_tokens"], u["completion_tokens_details"]["reasoning_tokens"]) == (len(ids), k)
    else:
        assert (u["output_tokens"], u["output_tokens_details"]["reasoning_tokens"]) == (len(ids), k)


# ------------------------------------------------------------------ item 4: Messages
@pytest.mark.parametrize("bad", [-3, 0.5, -7, "5", True, 2 ** 31])
def test_messages_top_k_is_range_checked(fe, bad):
    with pytest.raises(RequestError) as e:
        fe.prepare({"messages": [USER], "max_tokens": 4, "top_k": bad}, api="messages")
    assert e.value.record["param"] == "top_k"


def test_messages_top_k_applied_and_thinking_off_unless_asked(fe):
    pc = fe.prepare({"messages": [USER], "max_tokens": 4, "top_k": 5, "temperature": 0.5}, api="messages")
    assert pc.params.top_k == 5 and not pc.thinking and pc.params.temperature == 0.5
    assert pc.prompt_token_ids[-1] != 128821  # no <think> opened
    on = fe.prepare({"messages": [USER], "max_tokens": 2048, "thinking": {"type": "enabled", "budget_tokens": 1024}},
                    api="messages")
    assert on.thinking and on.prompt_token_ids[-1] == 128821
    assert fe.prepare({"messages": [USER], "max_tokens": 4}).thinking  # Chat keeps DeepSeek's default


def test_messages_answer_cut_inside_thinking_still_has_a_text_block(fe):
    out = run(fe, {"messages": [USER], "max_tokens": 2048, "thinking": {"type": "enabled", "budget_tokens": 1024}},
              fe.tokenizer.encode("Let me think"), "length", api="messages")
    assert [b["type"] for b in out["content"]] == ["thinking", "text"] and out["stop_reason"] == "max_tokens"


def test_messages_requires_max_tokens_and_temperature_in_anthropic_range(fe):
    with pytest.raises(RequestError) as e:
        fe.prepare({"messages": [USER]}, api="messages")
    assert e.value.record["param"] == "max_tokens" and "required" in str(e.value)
    with pytest.raises(RequestError) as e:
        fe.prepare({"messages": [USER], "max_tokens": 4, "temperature": 1.5}, api="messages")
    assert e.value.record["param"] == "temperature"


def test_messages_stop_sequences_end_the_run():
    ids = FakeTok.encode("Hello there STOP and more")
    llm = LLM(ScriptedModel(ids), num_blocks=16, max_model_len=4096, created=0)
    out = llm.chat([{"messages": [USER], "max_tokens": 40, "stop_sequences": ["STOP"], "seed": 1}], api="messages")[0]
    assert not is_error_record(out), out
    assert out["content"] == [{"type": "text", "text": "Hello there "}]
    assert out["stop_reason"] == "stop_sequence" and out["stop_sequence"] == "STOP"
    assert out["usage"]["output_tokens"] < len(ids)  # the run ended at the stop string


class FakeTok:
    @staticmethod
    def encode(text: str) -> list[int]:
        from tokenizers import Tokenizer

        return Tokenizer.from_file(TOK).encode(text, add_special_tokens=False).ids


# ------------------------------------------------------------------ item 5: fields named
@pytest.mark.parametrize("api,field,value,param,code", [
    ("chat", "seed", -1, "seed", "invalid_request_error"),
    ("chat", "max_tokens", 4.0, "max_tokens", "invalid_request_error"),
    ("chat", "max_completion_tokens", "4", "max_completion_tokens", "invalid_request_error"),
    ("chat", "temperature", 2.5, "temperature", "invalid_request_error"),
    ("chat", "top_p", float("nan"), "top_p", "invalid_request_error"),
    ("chat", "logprobs", 1, "logprobs", "invalid_request_error"),
    ("chat", "n", 2, "n", "invalid_request_error"),
    ("chat", "stream", True, "stream", "unsupported_parameter"),
    ("chat", "store", True, "store", "unsupported_parameter"),
    ("chat", "guided_json", {"type": "object"}, "guided_json", "unsupported_parameter"),
    ("chat", "guided_regex", "a+", "guided_regex", "unsupported_parameter"),
    ("chat", "functions", [{"name": "f"}], "functions", "unsupported_parameter"),
    ("chat", "frobnicate", 1, "frobnicate", "unknown_parameter"),
    ("chat", "stop", ["a", 3], "stop[1]", "invalid_request_error"),
    ("chat", "stop", ["s"] * (MAX_STOP_SEQUENCES + 1), "stop", "invalid_request_error"),
    ("responses", "previous_response_id", "resp_1", "previous_response_id", "unsupported_parameter"),
    ("responses", "store", True, "store", "unsupported_parameter"),
    ("responses", "tools", [{"type": "web_search"}], "tools[0].type", "unsupported_parameter"),
    ("responses", "tools", [{"type": "mcp", "server_label": "x", "server_url": "http://x"}], "tools[0].type",
     "unsupported_parameter"),
    ("responses", "max_output_tokens", 0, "max_output_tokens", "invalid_request_error"),
    ("messages", "seed", 2 ** 63, "seed", "invalid_request_error"),
    ("messages", "stop_sequences", "STOP", "stop_sequences", "invalid_request_error"),
    ("messages", "top_p", -0.1, "top_p", "invalid_request_error"),
])
def test_top_level_fields_are_checked_and_named(fe, api, field, value, param, code):
    base = {"chat": {"messages": [USER], "max_tokens": 4}, "messages": {"messages": [USER], "max_tokens": 4},
            "responses": {"input": "hi", "max_output_tokens": 4}}[api]
    with pytest.raises(RequestError) as e:
        fe.prepare({**base, field: value}, api=api)
    assert e.value.record["param"] == param and e.value.record["code"] == code, e.value.record
    assert param.split("[")[0] in str(e.value)


def test_lone_surrogate_and_deep_nesting_name_the_path(fe):
    with pytest.raises(RequestError) as e:
        fe.prepare('{"messages": [{"role": "user", "content": "a\\ud800"}], "max_tokens": 2}')
    assert e.value.record["param"] == "messages[0].content" and "surrogate" in str(e.value)
    deep: object = "x"
    for _ in range(MAX_NESTING + 1):
        deep = [deep]
    with pytest.raises(RequestError) as e:
        fe.prepare({"messages": [USER], "max_tokens": 2, "metadata": {"k": deep}})
    assert e.value.record["param"] == "metadata" and "nested deeper" in str(e.value)


@pytest.mark.parametrize("api,body,param", [
    ("chat", {"messages": [USER], "max_tokens": 4, "tools": [WEATHER],
              "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ("messages", {"messages": [USER], "max_tokens": 4, "tools": [WEATHER_MSG],
                  "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ("responses", {"input": "hi", "tools": [WEATHER_RESP], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice.name"),
])
def test_tool_choice_naming_an_undeclared_tool_is_refused(fe, api, body, param):
    with pytest.raises(RequestError) as e:
        fe.prepare(body, api=api)
    assert e.value.record["param"] == param and "nope" in str(e.value)


# ------------------------------------------------------------------ item 6: tool calls
TOOLS_BODY = {"messages": [USER], "tools": [WEATHER], "thinking": OFF, "max_tokens": 200, "seed": 3}


@pytest.mark.parametrize("text", [dsml("launch_missiles", "Paris"), dsml("get_weather", "{not json", "false"),
                                  "<｜DSML｜tool_calls>\n garbage </｜DSML｜tool_calls> after"])
def test_calls_the_request_did_not_allow_come_back_as_text(fe, text):
    out = run(fe, TOOLS_BODY, fe.tokenizer.encode(text))
    choice = out["choices"][0]
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == text


def test_dsml_block_cut_by_max_tokens_stays_in_content(fe):
    text = "Checking. " + dsml("get_weather", "Paris")
    ids = fe.tokenizer.encode(text)[:-12]
    out = run(fe, TOOLS_BODY, ids, "length")
    choice = out["choices"][0]
    assert "tool_calls" not in choice["message"] and choice["finish_reason"] == "length"
    assert choice["message"]["content"].startswith("Checking. <｜DSML｜tool_calls>")
    assert out["usage"]["completion_tokens"] == len(ids)


def test_a_valid_call_is_still_a_call(fe):
    out = run(fe, TOOLS_BODY, fe.tokenizer.encode(dsml("get_weather", "Paris")))
    assert out["choices"][0]["finish_reason"] == "tool_calls"
    assert json.loads(out["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}


def test_messages_and_responses_flag_bad_calls_as_text(fe):
    text = dsml("get_weather", "{not json", "false")  # Messages used to return it as tool_use with input {}
    out = run(fe, {"messages": [USER], "max_tokens": 200, "tools": [WEATHER_MSG]}, fe.tokenizer.encode(text),
              api="messages")
    assert out["content"] == [{"type": "text", "text": text}] and out["stop_reason"] == "end_turn"
    text = dsml("launch_missiles", "Paris")
    out = run(fe, {"input": "hi", "max_output_tokens": 200, "tools": [WEATHER_RESP]},
              fe.tokenizer.encode("ok") + [THINK_END] + fe.tokenizer.encode(text), api="responses")
    assert not [o for o in out["output"] if o["type"] == "function_call"]
    texts = [c["text"] for o in out["output"] if o["type"] == "message" for c in o["content"]]
    assert texts == [text]


# ------------------------------------------------------------------ item 7: output text and logprobs
def test_special_tokens_outside_the_protocol_never_reach_content(fe):
    text = "Hello <|place_holder_mm_span_0105|> world<｜User｜>!<｜begin▁of▁sentence｜>"
    ids = fe.tokenizer.encode(text)
    out = run(fe, {"messages": [USER], "thinking": OFF, "max_tokens": 50, "seed": 1}, ids)
    assert out["choices"][0]["message"]["content"] == "Hello  world!"
    assert out["usage"]["completion_tokens"] == len(ids)  # sampled, so counted


def test_thinking_mode_logprobs_always_carry_content(fe):
    body = {"messages": [USER], "max_tokens": 4, "seed": 1, "logprobs": True, "top_logprobs": 1}
    out = run(fe, body, fe.tokenizer.encode("Let me think"), "length", top=lambda t: [(t, -0.5)])
    lp = out["choices"][0]["logprobs"]
    assert lp["content"] == [] and len(lp["reasoning_content"]) == 3


def test_logit_bias_toward_a_partial_utf8_token_keeps_its_tokens():
    """Token 163 is the lone byte 0xE4 (an incomplete UTF-8 sequence): the recipe held it back and dropped it at the
    end, answering completion_tokens 0 and logprobs null after 3 sampled tokens."""
    llm = LLM(FakeModel(FakeConfig(max_position_embeddings=1024, eos_every=10 ** 9)), num_blocks=16, created=0)
    out = llm.chat([{"messages": [USER], "thinking": OFF, "max_tokens": 3, "seed": 1, "logprobs": True,
                     "logit_bias": {"163": 100}}])[0]
    choice = out["choices"][0]
    assert out["usage"]["completion_tokens"] == 3 and choice["message"]["content"] == "\ufffd" * 3
    assert [e["bytes"] for e in choice["logprobs"]["content"]] == [[0xE4]] * 3
    assert all(e["logprob"] <= 0 for e in choice["logprobs"]["content"])


# ------------------------------------------------------------------ item 5: seeded fuzz of every top-level field
def _random_json(rng: random.Random, depth: int = 0):
    kinds = [lambda: None, lambda: rng.choice([True, False]), lambda: rng.randrange(-5, 10),
             lambda: rng.choice([0.5, -1.5, 1e308, float("nan"), float("-inf"), 3.0]),
             lambda: rng.choice(["", "x", "a\ud800", "😀 ٣", "\u2028" * 3]), lambda: rng.randrange(-2 ** 70, 2 ** 70),
             lambda: [_random_json(rng, depth + 1) for _ in range(rng.randrange(3))],
             lambda: {rng.choice(["type", "name", "role", "x"]): _random_json(rng, depth + 1)},
             lambda: {"type": rng.choice(["enabled", "disabled", "function", "text", "tool"])}]
    return rng.choice(kinds[:6] if depth >= 3 else kinds)()


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_fuzzed_top_level_fields_answer_or_name_the_field(fe, api):
    """Random JSON values (types, ranges, nesting, unicode) in every field each API knows or refuses, and an unknown
    one: each body is prepared or refused with ``param`` rooted at that field; no other exception."""
    from deepinfer.api_checks import FIELDS, UNSUPPORTED

    rng = random.Random(25)
    base = {"chat": {"messages": [USER], "max_tokens": 4}, "messages": {"messages": [USER], "max_tokens": 4},
            "responses": {"input": "hi", "max_output_tokens": 4}}[api]
    for name in [*FIELDS[api], *UNSUPPORTED, "zz_unknown"]:
        for _ in range(12):
            value = _random_json(rng)
            try:
                fe.prepare({**base, name: value}, api=api).close()
            except RequestError as e:
                param = e.record["param"] or ""
                assert param.split("[")[0].split(".")[0] == name, (name, value, e.record)


# ------------------------------------------------------------------ round two (issue 25, hostile input again)
def _entries(out, key="content"):
    return [e["token"] for e in out["choices"][0]["logprobs"][key]]


@pytest.mark.parametrize("text", ["{}", "{}\n", "Sure: {}", '{"a": 1}'])
def test_json_object_logprobs_list_each_token_once(fe, text):
    """The recipe split one token's text (``{}``) over several chunks, each with that token's logprob entry."""
    ids = fe.tokenizer.encode(text)
    body = {"messages": [{"role": "user", "content": "answer in json"}], "thinking": OFF, "max_tokens": 20,
            "logprobs": True, "top_logprobs": 1, "response_format": {"type": "json_object"}}
    out = run(fe, body, ids, top=lambda t: [(t, -0.5)])
    assert len(_entries(out)) == len(ids), _entries(out)
    assert "".join(_entries(out)) == text


def test_streamed_json_object_logprobs_list_each_token_once(fe):
    body = {"messages": [{"role": "user", "content": "answer in json"}], "thinking": OFF, "max_tokens": 20,
            "logprobs": True, "response_format": {"type": "json_object"}}
    ids = fe.tokenizer.encode("{}\n")
    pc = fe.prepare(body, stream=True)
    for t in ids:
        pc.push_token(t, -0.5)
    out = pc.finish("stop")
    streamed = [e["token"] for _, ev in pc.take_events() for c in ev.get("choices") or []
                for e in ((c.get("logprobs") or {}).get("content") or [])]
    assert streamed == _entries(out) == ["{}\n"]


def test_a_later_think_end_token_stays_in_the_answer(fe):
    """Thinking on, logit_bias toward ``</think>``: the first one ends the reasoning, later ones are answer text
    (they were dropped, with their logprob entries)."""
    e = fe.tokenizer.encode
    ids = e("ab") + [THINK_END] + e("cd") + [THINK_END, THINK_END] + e("ef")
    out = run(fe, {"messages": [USER], "logprobs": True, "max_tokens": 20}, ids)
    msg = out["choices"][0]["message"]
    assert msg["reasoning_content"] == "ab" and msg["content"] == "cd</think></think>ef"
    assert _entries(out) == ["cd", "</think>", "</think>", "ef"] and _entries(out, "reasoning_content") == ["ab"]
    assert out["usage"]["completion_tokens"] == len(ids)
    assert out["usage"]["completion_tokens_details"]["reasoning_tokens"] == 1
    body = {"messages": [USER], "max_tokens": 2048, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    blocks = run(fe, body, ids, api="messages")["content"]
    assert blocks[0]["thinking"] == "ab" and blocks[1] == {"type": "text", "text": "cd</think></think>ef"}


def test_logit_bias_toward_think_end_keeps_every_token():
    llm = LLM(FakeModel(FakeConfig(max_position_embeddings=1024, eos_every=10 ** 9)), num_blocks=16, created=0)
    out = llm.chat([{"messages": [USER], "max_tokens": 4, "seed": 1, "logprobs": True,
                     "logit_bias": {str(THINK_END): 100}}])[0]
    assert out["choices"][0]["message"]["content"] == "</think>" * 3
    assert len(out["choices"][0]["logprobs"]["content"]) == 3 and out["usage"]["completion_tokens"] == 4


GOOD_CALL = dsml("get_weather", "Paris")[len("<｜DSML｜tool_calls>"):]  # the prompt opened the block


@pytest.mark.parametrize("api,choice,tools", [
    ("chat", "required", [WEATHER]),
    ("chat", {"type": "function", "function": {"name": "get_weather"}}, [WEATHER]),
    ("messages", {"type": "tool", "name": "get_weather"}, [WEATHER_MSG]),
    ("messages", {"type": "any"}, [WEATHER_MSG]),
    ("responses", "required", [WEATHER_RESP]),
])
def test_a_required_call_is_a_call_or_an_error(fe, api, choice, tools):
    base = {"chat": {"messages": [USER], "thinking": OFF, "max_tokens": 100},
            "messages": {"messages": [USER], "max_tokens": 100},
            "responses": {"input": "hi", "reasoning": {"effort": "none"}, "max_output_tokens": 100}}[api]
    body = {**base, "tools": tools, "tool_choice": choice}
    pc = fe.prepare(body, api=api)
    prefix = "" if pc.starts_in_tool_calls else "<｜DSML｜tool_calls>"
    out = run(fe, body, fe.tokenizer.encode(prefix + GOOD_CALL), api=api)
    assert json.dumps(out).count("Paris") >= 1 and ("tool_calls" in json.dumps(out) or "tool_use" in json.dumps(out)
                                                    or "function_call" in json.dumps(out))
    with pytest.raises(RequestError) as e:
        run(fe, body, fe.tokenizer.encode("hello world"), api=api)
    assert e.value.record["param"] == "tool_choice" and e.value.record["code"] == "tool_call_missing"
    assert e.value.record["status_code"] == 500 and "hello world" in str(e.value)


def test_a_required_call_that_is_missing_is_an_error_record():
    llm = LLM(ScriptedModel(FakeTok.encode("no call here")), num_blocks=16, max_model_len=4096, created=0)
    ok = {"messages": [USER], "thinking": OFF, "max_tokens": 20, "seed": 1}
    outs = llm.chat([{**ok, "tools": [WEATHER], "tool_choice": "required"}, ok])
    assert is_error_record(outs[0]) and outs[0]["error"]["code"] == "tool_call_missing"
    assert not is_error_record(outs[1])  # the other request is answered


@pytest.mark.parametrize("api,body", [
    ("chat", {"messages": [USER], "tool_choice": "required"}),
    ("chat", {"messages": [USER], "tool_choice": "required", "tools": []}),
    ("messages", {"messages": [USER], "max_tokens": 4, "tool_choice": {"type": "any"}}),
    ("messages", {"messages": [USER], "max_tokens": 4, "tool_choice": {"type": "tool", "name": "f"}}),
    ("responses", {"input": "hi", "tool_choice": "required"}),
    ("chat", {"messages": [USER], "tools": [WEATHER], "tool_choice": "required"}),  # thinking on: the recipe refuses
])
def test_tool_choice_that_cannot_be_met_is_a_400_naming_it(fe, api, body):
    with pytest.raises(RequestError) as e:
        fe.prepare(body, api=api)
    assert e.value.record["param"] == "tool_choice" and e.value.record["status_code"] == 400, e.value.record


ROUND2 = [  # (api, body, param, words in the message)
    ("chat", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "string or an array"),
    ("chat", {"messages": [{"role": "user", "content": "x", "name": 5}]}, "messages[0].name", "string"),
    ("chat", {"messages": [{"role": "user", "content": "x", "bogus": 1}]}, "messages[0].bogus", "unrecognized"),
    ("chat", {"messages": [{"role": "user"}]}, "messages[0].content", "required"),
    ("chat", {"messages": [{"role": "martian", "content": "x"}]}, "messages[0].role", "one of"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content[0].text",
     "string"),
    ("chat", {"messages": [USER, {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
              "function": {"arguments": "{}"}}]}]}, "messages[1].tool_calls[0].function.name", "required"),
    ("chat", {"messages": [USER], "tools": [5]}, "tools[0]", "object"),
    ("chat", {"messages": [USER], "tools": [{"type": "function", "function": {"name": 5}}]}, "tools[0].function.name",
     "string"),
    ("chat", {"messages": [USER], "thinking": {"type": "enabled", "budget_tokens": -5}}, "thinking.budget_tokens",
     ">= 1024"),
    ("chat", {"messages": [USER], "thinking": {"type": "sometimes"}}, "thinking.type", "one of"),
    ("chat", {"messages": [USER], "tools": [WEATHER], "tool_choice": {"type": "function", "function": {}}},
     "tool_choice.function.name", "required"),
    ("chat", {"messages": [USER], "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": 5}}},
     "tool_choice.function.name", "string"),
    ("chat", {"messages": [USER], "tool_choice": "sometimes"}, "tool_choice", "one of"),
    ("chat", {"messages": [USER], "max_tokens": 2 ** 62}, "max_tokens", f"[1, {MAX_OUTPUT_TOKENS}]"),
    ("chat", {"messages": [USER], "max_completion_tokens": MAX_OUTPUT_TOKENS + 1}, "max_completion_tokens", "limit"),
    ("chat", {"messages": [USER], "logit_bias": {" 5": 1}}, "logit_bias", "canonical"),
    ("chat", {"messages": [USER], "logit_bias": {"05": 1}}, "logit_bias", "canonical"),
    ("messages", {"messages": [{"role": "system", "content": "x"}, USER], "max_tokens": 4}, "messages[0].role",
     "top-level system"),
    ("messages", {"messages": [{**USER, "cache": 1}], "max_tokens": 4}, "messages[0].cache", "unrecognized"),
    ("messages", {"messages": [USER], "max_tokens": 2000, "thinking": {"type": "enabled", "budget_tokens": 0}},
     "thinking.budget_tokens", ">= 1024"),
    ("messages", {"messages": [USER], "max_tokens": 2000, "thinking": {"type": "enabled", "budget_tokens": 2000}},
     "thinking.budget_tokens", "less than max_tokens"),
    ("messages", {"messages": [USER], "max_tokens": 4, "tools": [WEATHER_MSG], "tool_choice": {"type": "tool"}},
     "tool_choice.name", "required"),
    ("responses", {"input": "hi", "truncation": "banana"}, "truncation", "'auto', 'disabled'"),
    ("responses", {"input": "hi", "max_output_tokens": 2 ** 40}, "max_output_tokens", f"[1, {MAX_OUTPUT_TOKENS}]"),
]


@pytest.mark.parametrize("api,body,param,words", ROUND2)
def test_nested_fields_are_named_by_their_path(fe, api, body, param, words):
    with pytest.raises(RequestError) as e:
        fe.prepare(body, api=api)
    assert e.value.record["param"] == param and words in str(e.value), e.value.record
    assert "invalid request body" not in str(e.value)  # our own words, not the recipe's serde text


def test_valid_nested_fields_still_pass(fe):
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"P\"}"}}
    fe.prepare({"messages": [{"role": "system", "content": "s", "name": "ops"}, {**USER, "name": "ann"},
                             {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "r"},
                             {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
                             {"role": "user", "content": [{"type": "text", "text": "more"}]}],
                "tools": [WEATHER], "thinking": {"type": "enabled", "budget_tokens": 1024}, "max_tokens": 2048,
                "logit_bias": {"0": 1, "5": -1}}).close()
    fe.prepare({"messages": [USER], "max_tokens": 2048, "system": "be brief", "tools": [WEATHER_MSG],
                "tool_choice": {"type": "tool", "name": "get_weather"}}, api="messages").close()
    fe.prepare({"messages": [USER], "max_tokens": 2048, "thinking": {"type": "enabled", "budget_tokens": 1024}},
               api="messages").close()
    fe.prepare({"input": "hi", "truncation": "disabled", "max_output_tokens": 100}, api="responses").close()


def test_the_max_tokens_limit_is_the_recipes():
    import deepseek_recipe as R

    o = R.ConversionOptions()
    assert MAX_OUTPUT_TOKENS == o.thinking_max_tokens_upper_bound == o.non_thinking_max_tokens_upper_bound


@pytest.mark.parametrize("top_p", [1e-300, 5e-324, 1e-45])
def test_a_tiny_positive_top_p_keeps_the_most_likely_token(fe, top_p):
    pc = fe.prepare({"messages": [USER], "top_p": top_p, "max_tokens": 4, "thinking": OFF})
    assert 0 < pc.params.top_p <= 1.2e-38
    with pytest.raises(RequestError) as e:
        fe.prepare({"messages": [USER], "top_p": 0.0, "max_tokens": 4})
    assert e.value.record["param"] == "top_p"


# ------------------------------------------------------------------ round three (issue 25 verification)
@pytest.mark.parametrize("kind", ["item_reference", "web_search_call", "mcp_call", "computer_call_output",
                                  "local_shell_call", "compaction", "bogus"])
def test_responses_input_items_the_recipe_would_drop_are_refused(fe, kind):
    """deepseek-recipe dropped these items without a word: an ``item_reference`` alone rendered a prompt without any
    user turn. Each is refused naming ``input[i].type``; the items the engine renders still pass."""
    with pytest.raises(RequestError) as e:
        fe.prepare({"input": [{"role": "user", "content": "hi"}, {"type": kind, "id": "x"}],
                    "max_output_tokens": 4}, api="responses")
    assert e.value.record["param"] == "input[1].type" and e.value.record["code"] == "unsupported_parameter"
    with pytest.raises(RequestError) as e:
        fe.prepare({"input": [{"type": 5, "role": "user", "content": "hi"}], "max_output_tokens": 4}, api="responses")
    assert e.value.record["param"] == "input[0].type"
    call = [{"type": "function_call", "call_id": "c", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": "sunny"}]
    for items in ([{"type": "message", "role": "user", "content": "hi"}], [{"role": "user", "content": "hi"}, *call],
                  [{"type": "reasoning", "id": "r", "summary": []}, {"role": "user", "content": "hi"}]):
        fe.prepare({"input": items, "max_output_tokens": 4, "tools": [WEATHER_RESP]}, api="responses").close()


@pytest.mark.parametrize("api,body", [
    ("responses", {"input": "hi", "max_output_tokens": 4}),
    ("chat", {"messages": [USER], "max_tokens": 4}),
    ("messages", {"messages": [USER], "max_tokens": 4}),
])
def test_a_recipe_error_in_a_body_with_two_faults_names_its_own_field(fe, api, body):
    """An unknown model beside a tool schema the recipe refuses: removing either field alone still fails, and the
    unknown-model error (which the recipe reports without a field) was blamed on ``input`` / ``messages``."""
    bad_schema = {"type": "object", "properties": 5}
    tool = ({"type": "function", "function": {"name": "f", "parameters": bad_schema}} if api == "chat" else
            {"name": "f", "input_schema": bad_schema} if api == "messages" else
            {"type": "function", "name": "f", "parameters": bad_schema})
    with pytest.raises(RequestError) as e:
        fe.prepare({**body, "model": "no-such-model", "tools": [tool]}, api=api)
    assert "no-such-model" in e.value.record["message"] and e.value.record["param"] == "model", e.value.record


NAMES_THE_PARSER_REFUSES = ['a"b', "a b", " a", "a\tb", "a\nb", "a\rb", "a\x0bb", "a\x00b", "a\x1fb"]
NAMES_THE_PARSER_READS = ["a>b", "ü", "", "a\u00a0b", "a\u2028b", "a=b", "c｜DSML｜d", "a/b", "a'b", "a\x7fb"]


def _call_with_key(key: str) -> str:
    return ("\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"f\">\n<｜DSML｜parameter name=\"" + key +
            "\" string=\"true\">v</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>")


def _key_tool(api: str, key: str) -> dict:
    schema = {"type": "object", "properties": {key: {"type": "string"}}, "required": [key]}
    return ({"type": "function", "function": {"name": "f", "parameters": schema}} if api == "chat" else
            {"name": "f", "input_schema": schema} if api == "messages" else
            {"type": "function", "name": "f", "parameters": schema})


def test_the_dsml_argument_name_rule_is_the_parsers(fe):
    """``dsml_key_problem`` refuses exactly the names whose call deepseek-recipe's parser does not read."""
    from deepinfer.api_checks import dsml_key_problem

    for key in NAMES_THE_PARSER_REFUSES + NAMES_THE_PARSER_READS:
        assert (dsml_key_problem(key) is None) == (_parse_call(fe, key) == "tool_calls"), key


def _parse_call(fe, key: str) -> str:
    """The finish reason the recipe's parser gives the call text with ``key``, bypassing the name check."""
    from deepinfer import api_checks

    saved = api_checks.dsml_key_problem
    api_checks.dsml_key_problem = lambda k: None
    try:
        body = {"messages": [USER], "max_tokens": 200, "tools": [_key_tool("chat", key)], "thinking": OFF}
        return run(fe, body, fe.tokenizer.encode(_call_with_key(key)))["choices"][0]["finish_reason"]
    finally:
        api_checks.dsml_key_problem = saved


@pytest.mark.parametrize("api", ["chat", "messages", "responses"])
def test_tool_argument_names_dsml_cannot_carry_are_refused(fe, api):
    """A property named ``a b`` passed the checks, but no call the model writes for it parses: with a required
    ``tool_choice`` every answer was a ``tool_call_missing`` error, otherwise the call came back as text."""
    base = {"chat": {"messages": [USER], "max_tokens": 8}, "messages": {"messages": [USER], "max_tokens": 8},
            "responses": {"input": "hi", "max_output_tokens": 8}}[api]
    where = {"chat": "tools[0].function.parameters", "messages": "tools[0].input_schema",
             "responses": "tools[0].parameters"}[api]
    with pytest.raises(RequestError) as e:
        fe.prepare({**base, "tools": [_key_tool(api, "a b")]}, api=api)
    assert e.value.record["param"] == f"{where}.properties" and "'a b'" in e.value.record["message"]
    fe.prepare({**base, "tools": [_key_tool(api, "ü")]}, api=api).close()
    none = {"type": "none"} if api == "messages" else "none"
    fe.prepare({**base, "tools": [_key_tool(api, "a b")], "tool_choice": none}, api=api).close()
