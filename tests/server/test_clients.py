"""The official openai and anthropic clients against `deepinfer serve` with the tiny model: chat, streaming,
thinking on and off, Responses, Messages, Completions, error statuses and /metrics."""

from __future__ import annotations

import json

import anthropic
import httpx2
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server_util import RunningServer
from deepinfer import LLM
from deepinfer.server import ServerConfig

USER = [{"role": "user", "content": "Say something."}]
KEY = "sk-test-key"


@pytest.fixture(scope="module")
def server():
    s = RunningServer(LLM("tiny", max_num_seqs=16), ServerConfig(api_key=KEY))
    yield s
    s.close()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


def _model(server) -> str:
    return server.llm.served_model_name


def _collect_chat_stream(stream) -> tuple[str, str, str | None, object]:
    reasoning, content, finish, usage = "", "", None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
            finish = c.finish_reason or finish
    return reasoning, content, finish, usage


@pytest.mark.parametrize("thinking", [True, False])
def test_chat_stream_equals_non_stream(server, oai, thinking):
    extra = {"thinking": {"type": "enabled" if thinking else "disabled"}}
    kw = dict(model=_model(server), messages=USER, max_tokens=12, seed=7, temperature=0, extra_body=extra)
    full = oai.chat.completions.create(**kw)
    msg = full.choices[0].message
    reasoning, content, finish, usage = _collect_chat_stream(
        oai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    assert (reasoning, content, finish) == (getattr(msg, "reasoning_content", None) or "", msg.content or "",
                                            full.choices[0].finish_reason)
    assert bool(reasoning) == thinking  # the tiny model never closes its thinking within 12 tokens
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens == 12
    assert full.model == _model(server) and full.usage.prompt_tokens > 0
    # without include_usage no chunk carries usage
    _, _, _, usage = _collect_chat_stream(oai.chat.completions.create(stream=True, **kw))
    assert usage is None
    server.wait_idle()


def test_models_and_completions(server, oai):
    assert [m.id for m in oai.models.list().data] == [_model(server)]
    a = oai.completions.create(model=_model(server), prompt="Once upon a time", max_tokens=6, seed=3, temperature=0)
    assert a.object == "text_completion" and a.usage.completion_tokens == 6 and a.choices[0].finish_reason == "length"
    text = "".join(c.choices[0].text for c in oai.completions.create(
        model=_model(server), prompt="Once upon a time", max_tokens=6, seed=3, temperature=0, stream=True)
        if c.choices)
    assert text == a.choices[0].text
    ids = server.llm.encode("Once upon a time")
    b = oai.completions.create(model=_model(server), prompt=ids, max_tokens=6, seed=3, temperature=0)
    assert b.choices[0].text == a.choices[0].text  # token ids and text give the same prompt
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=_model(server), prompt=[1, -5], max_tokens=2)
    assert "prompt[1]" in e.value.body["message"]


def test_responses_api(server, oai):
    kw = dict(model=_model(server), input="Hello", max_output_tokens=8)
    r = oai.responses.create(**kw)
    assert r.status in ("completed", "incomplete") and r.usage.output_tokens == 8 and r.output
    events = list(oai.responses.create(**kw, stream=True))
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    final = events[-1].response
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed and streamed == final.output[0].content[0].text  # the deltas add up to the final output


@pytest.mark.parametrize("thinking", [True, False])
def test_messages_api(server, claude, thinking):
    # Messages has no seed: thinking (temperature forced to 1) is compared within the stream, greedy across
    kw = dict(model=_model(server), max_tokens=10, messages=USER,
              extra_body={"temperature": 0, "thinking": {"type": "enabled" if thinking else "disabled"}})
    m = claude.messages.create(**kw)
    assert m.type == "message" and m.usage.output_tokens == 10 and m.stop_reason == "max_tokens"
    assert [b.type for b in m.content][0] == ("thinking" if thinking else "text")
    with claude.messages.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    types = [ev.type for ev in events]
    assert types[0] == "message_start" and types[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(types)
    deltas = [ev.delta for ev in events if ev.type == "content_block_delta"]
    assert "".join(getattr(d, "thinking", "") or getattr(d, "text", "") for d in deltas) == "".join(
        getattr(b, "thinking", "") or getattr(b, "text", "") for b in final.content)
    # the same blocks, streamed or not: a thinking-only answer gets its empty text block in the stream too
    assert [b.type for b in final.content] == [b.type for b in m.content]
    if thinking:  # the tiny model never closes its thinking within 10 tokens
        assert [b.type for b in m.content] == ["thinking", "text"] and m.content[1].text == final.content[1].text == ""
        starts = [ev for ev in events if ev.type == "content_block_start"]
        assert [(ev.index, ev.content_block.type) for ev in starts] == [(0, "thinking"), (1, "text")]
        assert types[-4:] == ["content_block_start", "content_block_stop", "message_delta", "message_stop"]
    else:
        assert [b.text for b in final.content] == [b.text for b in m.content]


def test_error_statuses(server, oai, claude):
    with pytest.raises(openai.NotFoundError) as e:
        oai.chat.completions.create(model="gpt-4o", messages=USER, max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="claude-x", max_tokens=2, messages=USER)
    assert e.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=_model(server), messages=[], max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=_model(server), messages=USER, max_tokens=2, temperature="hot")
    assert e.value.body["param"] == "temperature"
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=_model(server), max_tokens=0, messages=USER)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=_model(server), max_tokens=2, messages=USER)
    assert e.value.body["error"]["type"] == "authentication_error"
    h = {"Authorization": f"Bearer {KEY}"}
    r = httpx2.post(server.url + "/v1/chat/completions", content=b"{not json", headers=h)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = httpx2.post(server.url + "/v1/chat/completions", content=b"[1, 2]", headers=h)
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    r = httpx2.post(server.url + "/v1/messages", content=b"x" * (5 << 20), headers={"x-api-key": KEY})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    assert httpx2.post(server.url + "/v1/chat/completions", json={"messages": USER}).status_code == 401
    assert httpx2.get(server.url + "/health").json()["status"] == "ok"  # no key needed
    server.wait_idle()


@pytest.mark.parametrize("path,body,param,code", [
    ("/v1/chat/completions", {"messages": USER, "frobnicate": 1}, "frobnicate", "unknown_parameter"),
    ("/v1/chat/completions", {"messages": USER, "stream": "yes"}, "stream", "invalid_request_error"),
    ("/v1/chat/completions", {"messages": USER, "store": True}, "store", "unsupported_parameter"),
    ("/v1/chat/completions", {"messages": USER, "stop": ["a", ""]}, "stop[1]", "invalid_request_error"),
    ("/v1/responses", {"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id",
     "unsupported_parameter"),
    ("/v1/completions", {"prompt": "hi", "echo": True}, "echo", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "hi", "suffix": "end"}, "suffix", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 2}, "logprobs", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "hi", "best_of": 3}, "best_of", "unsupported_parameter"),
    ("/v1/completions", {"prompt": "hi", "n": 2}, "n", "invalid_request_error"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2.5}, "max_tokens", "invalid_request_error"),
    ("/v1/completions", {"prompt": "hi", "stop": ["s"] * 17}, "stop", "invalid_request_error"),
    ("/v1/completions", {"prompt": "hi", "stop": ""}, "stop", "invalid_request_error"),
    ("/v1/completions", {"prompt": "hi", "messages": USER}, "messages", "unknown_parameter"),
    ("/v1/completions", {"max_tokens": 2}, "prompt", "invalid_request_error"),
    ("/v1/completions", {"prompt": "hi", "temperature": float("inf")}, "temperature", "invalid_request_error"),
])
def test_field_checks_are_api_checks_in_openai_format(server, path, body, param, code):
    """The server checks fields with ``api_checks.check_request`` (the offline path's tables; Completions has its
    own): 400, ``param`` names the field, the message too."""
    r = httpx2.post(server.url + path, content=json.dumps(body, allow_nan=True),
                    headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    err = r.json()["error"]
    assert r.status_code == 400 and (err["param"], err["code"]) == (param, code), err
    assert param.split("[")[0] in err["message"]


def test_field_checks_in_anthropic_format_and_stream_allowed(server, claude):
    r = httpx2.post(server.url + "/v1/messages", json={"messages": USER, "max_tokens": 2, "frobnicate": 1},
                    headers={"x-api-key": KEY})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error" and "frobnicate" in r.json()["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=_model(server), max_tokens=2, messages=USER, extra_body={"top_k": -3})
    assert "top_k" in e.value.body["error"]["message"]
    # stream: true is refused offline only: served, it streams (the same table)
    with claude.messages.stream(model=_model(server), max_tokens=2, messages=USER) as stream:
        assert stream.get_final_message().usage.output_tokens == 2
    server.wait_idle()


def test_metrics_parse(server, oai):
    oai.chat.completions.create(model=_model(server), messages=USER, max_tokens=4, seed=1)
    text = httpx2.get(server.url + "/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("deepinfer_num_requests_running", "deepinfer_num_requests_waiting", "deepinfer_kv_cache_usage_ratio",
                 "deepinfer_prefill_tokens_per_second", "deepinfer_decode_tokens_per_second",
                 "deepinfer_time_to_first_token_seconds", "deepinfer_time_per_output_token_seconds"):
        assert name in fams, name
    count = {s.name: s.value for s in fams["deepinfer_time_to_first_token_seconds"].samples}
    assert count["deepinfer_time_to_first_token_seconds_count"] >= 1
    tpot = {s.name: s.value for s in fams["deepinfer_time_per_output_token_seconds"].samples}
    assert tpot["deepinfer_time_per_output_token_seconds_count"] >= 1
    assert next(iter(fams["deepinfer_prefill_tokens_per_second"].samples)).value > 0
    server.wait_idle()
    assert next(iter(fams["deepinfer_kv_cache_usage_ratio"].samples)).value >= 0
