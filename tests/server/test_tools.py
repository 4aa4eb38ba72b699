"""Tool calls, tool results and json_object through the clients, with a scripted model (its output is fixed
text), so the DSML parsing is exercised end to end: tool-call deltas carry no DSML markup, and the streamed calls
equal the non-streamed ones (same ids)."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest
from tokenizers import Tokenizer

from deepinfer import LLM
from deepinfer.chat import packaged_tokenizer_json
from fake_model import ScriptedModel

CALL = ("<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" "
        "string=\"true\">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>")
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                           "parameters": PARAMS}}]
USER = [{"role": "user", "content": "Weather in Paris?"}]
NO_THINK = {"thinking": {"type": "disabled"}}


def _scripted_server(start_server, text: str):
    ids = Tokenizer.from_file(packaged_tokenizer_json()).encode(text, add_special_tokens=False).ids
    s = start_server(LLM(ScriptedModel(ids), num_blocks=32, max_model_len=4096, served_model_name="scripted",
                         created=0))
    return s, openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60)


def test_chat_tool_calls_streamed_without_markup(start_server):
    s, oai = _scripted_server(start_server, CALL)
    kw = dict(model="scripted", messages=USER, tools=TOOLS, max_tokens=80, seed=1, extra_body=NO_THINK)
    full = oai.chat.completions.create(**kw)
    call = full.choices[0].message.tool_calls[0]
    assert full.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    calls: dict[int, dict] = {}
    content = ""
    for chunk in oai.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = tc.id or entry["id"]
                entry["name"] += (tc.function.name or "") if tc.function else ""
                entry["arguments"] += (tc.function.arguments or "") if tc.function else ""
                assert "DSML" not in (tc.function.arguments or "")
    assert "DSML" not in content and not content.strip()
    assert calls == {0: {"id": call.id, "name": "get_weather", "arguments": call.function.arguments}}
    assert call.id.startswith("call_00_")
    # the tool result goes back in; the prompt renders it (the scripted model then calls again)
    history = USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    again = oai.chat.completions.create(**{**kw, "messages": history})
    assert again.usage.prompt_tokens > full.usage.prompt_tokens
    s.wait_idle()


def _messages_both_ways(s, max_tokens: int):
    """``(claude, kw, message, stream events, streamed final message)`` of one Messages request with the tool."""
    claude = anthropic.Anthropic(base_url=s.url, api_key="x", max_retries=0, timeout=60)
    kw = dict(model="scripted", max_tokens=max_tokens, messages=USER, extra_body=NO_THINK,
              tools=[{"name": "get_weather", "description": "w", "input_schema": PARAMS}])
    m = claude.messages.create(**kw)
    with claude.messages.stream(**kw) as stream:
        events = list(stream)
        return claude, kw, m, events, stream.get_final_message()


def test_messages_tool_use_stream(start_server):
    s, _ = _scripted_server(start_server, CALL)
    claude, kw, m, events, final = _messages_both_ways(s, 80)
    assert m.stop_reason == final.stop_reason == "tool_use"
    use = [b for b in final.content if b.type == "tool_use"]
    assert use and use[0].input == {"city": "Paris"} == [b for b in m.content if b.type == "tool_use"][0].input
    starts = [ev.content_block for ev in events if ev.type == "content_block_start"
              and ev.content_block.type == "tool_use"]
    assert [b.id for b in starts] == [use[0].id]  # the stream's tool_use id is the final one (rewritten once)
    assert use[0].id.startswith("toolu_00_")
    partial = "".join(ev.delta.partial_json for ev in events
                      if ev.type == "content_block_delta" and ev.delta.type == "input_json_delta")
    assert json.loads(partial) == {"city": "Paris"} and "DSML" not in partial
    # a tool_result block round trip
    history = USER + [{"role": "assistant", "content": [{"type": "tool_use", "id": use[0].id, "name": "get_weather",
                                                          "input": {"city": "Paris"}}]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id,
                                                    "content": "sunny"}]}]
    # input_tokens leaves out the prefix-cache reads (Anthropic's meaning): the prompt is the sum
    u = claude.messages.create(**{**kw, "messages": history}).usage
    assert u.input_tokens + u.cache_read_input_tokens > m.usage.input_tokens + m.usage.cache_read_input_tokens
    s.wait_idle()


def test_responses_function_call_stream_ids(start_server):
    s, oai = _scripted_server(start_server, CALL)
    kw = dict(model="scripted", input="Weather in Paris?", max_output_tokens=80,
              tools=[{"type": "function", "name": "get_weather", "description": "w", "parameters": PARAMS}])
    r = oai.responses.create(**kw)
    events = list(oai.responses.create(stream=True, **kw))
    calls = [o for o in r.output if o.type == "function_call"]
    streamed = [o for o in events[-1].response.output if o.type == "function_call"]
    added = [e.item for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    assert calls and streamed and added
    assert streamed[0].call_id == added[0].call_id and streamed[0].call_id.startswith("call_00_")
    assert calls[0].call_id.startswith("call_00_") and calls[0].arguments == streamed[0].arguments
    assert {e.item_id for e in events if e.type == "response.function_call_arguments.delta"} == {streamed[0].id}


def test_json_object(start_server):
    # json_object is enforced: the scripted answer is compact JSON (the grammar allows no free whitespace)
    s, oai = _scripted_server(start_server, '{"city":"Paris","temp":21}')
    kw = dict(model="scripted", messages=[{"role": "user", "content": "Reply in JSON."}], max_tokens=40, seed=2,
              response_format={"type": "json_object"}, extra_body=NO_THINK)
    full = oai.chat.completions.create(**kw)
    assert json.loads(full.choices[0].message.content) == {"city": "Paris", "temp": 21}
    streamed = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(stream=True, **kw)
                       if c.choices)
    assert streamed == full.choices[0].message.content


def test_json_object_is_enforced_over_a_model_that_writes_prose(start_server):
    s, oai = _scripted_server(start_server, 'Here it is: {"city": "Paris"}')
    out = oai.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "JSON please"}],
                                      max_tokens=40, temperature=0, response_format={"type": "json_object"},
                                      extra_body=NO_THINK)
    text, finish = out.choices[0].message.content, out.choices[0].finish_reason
    assert text.startswith("{")  # the prose was masked out
    if finish == "stop":  # the grammar may also run to max_tokens inside the object (the engine tests cover both)
        assert isinstance(json.loads(text), dict)
    else:
        assert finish == "length"


# ------------------------------------------------------------------ invalid DSML: streamed as the final answer shows it
def _dsml(name: str, value: str, string: str = "true") -> str:
    return CALL.replace("get_weather", name).replace('string="true">Paris', f'string="{string}">{value}')


BAD_CALLS = {"undeclared tool": (_dsml("launch_missiles", "Paris"), 200),
             "arguments not JSON": (_dsml("get_weather", "{not json", "false"), 200),
             "block cut by max_tokens": ("Checking. " + CALL, 20)}


@pytest.fixture
def no_tool_grammar(monkeypatch):
    """The tool-call grammar off (``chat.tool_call_constraint``), so the scripted model writes its invalid call and
    the post-hoc checks, the safety net behind the grammar, answer it."""
    import deepinfer.chat as chat

    monkeypatch.setattr(chat, "tool_call_constraint", lambda *a, **k: None)


def _chat_stream(oai, kw) -> tuple[str, list, str | None]:
    content, calls, finish = "", [], None
    for chunk in oai.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            calls += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_chat_invalid_call_streams_as_the_raw_text_it_answers(start_server, case, no_tool_grammar):
    """An invalid DSML block is answered as text (issue 25); the stream shows the same text and no tool-call delta
    (issue 21: a stream adds up to its non-streamed twin)."""
    text, max_tokens = BAD_CALLS[case]
    s, oai = _scripted_server(start_server, text)
    kw = dict(model="scripted", messages=USER, tools=TOOLS, max_tokens=max_tokens, seed=1, extra_body=NO_THINK)
    full = oai.chat.completions.create(**kw)
    msg = full.choices[0].message
    assert not msg.tool_calls and "<｜DSML｜tool_calls>" in msg.content
    assert full.choices[0].finish_reason == ("length" if max_tokens < 100 else "stop")
    if max_tokens > 100:
        assert msg.content == text
    content, calls, finish = _chat_stream(oai, kw)
    assert (content, calls, finish) == (msg.content, [], full.choices[0].finish_reason)
    s.wait_idle()


def test_messages_and_responses_invalid_call_stream_equals_answer(start_server, no_tool_grammar):
    text = _dsml("get_weather", "{not json", "false")
    s, oai = _scripted_server(start_server, text)
    _, _, m, events, final = _messages_both_ways(s, 200)
    assert [b.model_dump() for b in m.content] == [b.model_dump() for b in final.content] == [
        {"type": "text", "text": text, "citations": None}]
    assert m.stop_reason == final.stop_reason == "end_turn" and final.usage.output_tokens == m.usage.output_tokens
    assert not [ev for ev in events if ev.type == "content_block_start" and ev.content_block.type == "tool_use"]
    rkw = dict(model="scripted", input="Weather in Paris?", max_output_tokens=200, reasoning={"effort": "none"},
               extra_body={"seed": 1},
               tools=[{"type": "function", "name": "get_weather", "description": "w", "parameters": PARAMS}])
    r = oai.responses.create(**rkw)
    events = list(oai.responses.create(stream=True, **rkw))
    assert not [e for e in events if e.type.startswith("response.function_call")]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == r.output_text and text in r.output_text
    assert [o.model_dump() for o in events[-1].response.output] == [o.model_dump() for o in r.output]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    s.wait_idle()


def test_text_streams_as_it_comes_and_a_call_is_held_until_validated():
    """With tools declared, text (also text with a '<' that could open a DSML block) is released token by token;
    tool-call deltas are held until the answer ends and the call is known valid."""
    from deepinfer.chat import ChatFrontend

    fe = ChatFrontend(packaged_tokenizer_json(), "scripted", max_model_len=4096, eos_token_id=1, created=0)
    body = {"messages": USER, "tools": TOOLS, "max_tokens": 200, "seed": 1, **NO_THINK, "stream": True}
    text = "if a < b and c <d then x</y done"
    pc = fe.prepare(body, stream=True)
    released = []
    for t in fe.tokenizer.encode(text):
        pc.push_token(t, None)
        released.append("".join(d["choices"][0]["delta"].get("content") or "" for _, d in pc.take_events()
                                if d["choices"]))
    assert "".join(released) == text and sum(1 for r in released if r) >= len(released) - 3
    pc = fe.prepare(body, stream=True)
    before = []
    for t in fe.tokenizer.encode("Checking. " + CALL):
        pc.push_token(t, None)
        before += pc.take_events()
    assert not [d for _, d in before if d["choices"] and d["choices"][0]["delta"].get("tool_calls")]
    out = pc.finish("stop")
    after = [d for _, d in pc.take_events()]
    assert [tc["function"]["name"] for d in after if d["choices"] for tc in d["choices"][0]["delta"].get(
        "tool_calls") or [] if tc.get("function", {}).get("name")] == ["get_weather"]
    assert out["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


# ------------------------------------------------------------------ the tool-call grammar over a random model
BOUNDED = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_required_call_from_a_random_model_streamed_equals_answer(start_server, choice):
    """The tiny model has random weights: only the grammar makes its answer a call of the declared tool with
    schema-valid arguments (issue 20). The stream carries the same call, with no DSML markup."""
    import jsonschema

    s = start_server(LLM("tiny", max_num_seqs=4))
    oai = openai.OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": BOUNDED}},
             {"type": "function", "function": {"name": "other", "parameters": {"type": "object", "properties": {}}}}]
    kw = dict(model="tiny", messages=USER, tools=tools, tool_choice=choice, max_tokens=300, seed=4, temperature=0.7,
              extra_body=NO_THINK)
    full = oai.chat.completions.create(**kw)
    calls = full.choices[0].message.tool_calls
    assert full.choices[0].finish_reason == "tool_calls" and calls and not (full.choices[0].message.content or "")
    for c in calls:
        assert c.function.name in ("get_weather", "other")
        if c.function.name == "get_weather":
            jsonschema.validate(json.loads(c.function.arguments), BOUNDED)
    if isinstance(choice, dict):
        assert {c.function.name for c in calls} == {"get_weather"}
    content, deltas, finish = _chat_stream(oai, kw)
    streamed: dict[int, dict] = {}
    for tc in deltas:
        entry = streamed.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
        entry["id"] = tc.id or entry["id"]
        entry["name"] += (tc.function.name or "") if tc.function else ""
        entry["arguments"] += (tc.function.arguments or "") if tc.function else ""
    assert finish == "tool_calls" and not content and "DSML" not in json.dumps(streamed)
    assert streamed == {i: {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
                        for i, c in enumerate(calls)}
    s.wait_idle()
