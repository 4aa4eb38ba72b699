"""Recipe integration: prompts, parsing, EOS / stop handling, reproducible tool-call ids, error records."""

import json

import pytest
from tokenizers import Tokenizer as HFTokenizer

from deepinfer import LLM
from deepinfer.chat import ChatFrontend, RequestError, is_error_record, packaged_tokenizer_json, public_address_only
from fake_model import FakeConfig, FakeModel, ScriptedModel

TOK = packaged_tokenizer_json()
USER = {"role": "user", "content": "What's the weather in Paris?"}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def fe():
    return ChatFrontend(TOK, "tiny-test", max_model_len=4096, eos_token_id=1, created=0)


@pytest.fixture(scope="module")
def hf():
    return HFTokenizer.from_file(TOK)


def test_prompt_ids_decode_to_the_recipe_rendering(fe, hf):
    import deepseek_recipe as R

    body = {"messages": [{"role": "system", "content": "Be brief."}, USER,
                         {"role": "assistant", "content": "Sunny.", "reasoning_content": "It is always sunny."},
                         {"role": "user", "content": "代码:\n    x = 1  # 😀"}],
            "tools": [WEATHER], "reasoning_effort": "high", "max_tokens": 7, "seed": 3}
    pc = fe.prepare(body)
    conv = R.ChatCompletionRequest({**body, "model": "DeepSeek-V4-Pro"}).convert(R.ConversionOptions()).conversation
    rendered = R.DeepseekV4Encoding().render_conversation(conv).prompt
    assert hf.decode(pc.prompt_token_ids, skip_special_tokens=False) == rendered
    assert pc.prompt_token_ids[0] == 0 and pc.prompt_token_ids[-1] == 128821  # BOS ... <think>
    assert pc.params.max_tokens == 7 and pc.params.seed == 3 and pc.params.temperature == 1.0  # thinking: T = 1


def test_default_max_tokens_clamped_to_context(fe):
    pc = fe.prepare({"messages": [USER], "thinking": {"type": "disabled"}})
    assert pc.params.max_tokens == 4096 - len(pc.prompt_token_ids)  # 8192 lowered to what is left
    with pytest.raises(RequestError) as e:
        fe.prepare({"messages": [USER], "max_tokens": 4090})
    assert e.value.record["code"] == "context_length_exceeded"


def _push_text(pc, fe, text):
    for t in fe.tokenizer.encode(text):
        if pc.push_token(t, -0.5):
            return True
    return False


def test_reasoning_and_tool_call_parsing_with_reproducible_ids(fe):
    body = {"messages": [USER], "tools": [WEATHER], "max_tokens": 200, "seed": 11}
    outs = []
    for _ in range(2):
        pc = fe.prepare(body)
        text = ("I should call the tool.</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
                "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
                "</｜DSML｜tool_calls>")
        assert not _push_text(pc, fe, text)
        outs.append(pc.finish("stop"))
    a, b = outs
    msg = a["choices"][0]["message"]
    assert msg["reasoning_content"] == "I should call the tool."
    assert msg["tool_calls"][0]["function"]["name"] == "get_weather"
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert a["choices"][0]["finish_reason"] == "tool_calls"
    assert msg["tool_calls"][0]["id"].startswith("call_00_")
    assert a == b  # ids, timestamps and all: reproducible
    assert a["usage"]["completion_tokens_details"]["reasoning_tokens"] > 0 and a["seed"] == 11


def test_stop_sequence_finishes_the_parser(fe):
    pc = fe.prepare({"messages": [USER], "thinking": {"type": "disabled"}, "stop": ["STOP"], "seed": 1})
    assert _push_text(pc, fe, "Hello there STOP and more")
    out = pc.finish("stop")
    assert out["choices"][0]["message"]["content"].rstrip() == "Hello there"
    assert out["choices"][0]["finish_reason"] == "stop"


def test_length_finish(fe):
    pc = fe.prepare({"messages": [USER], "thinking": {"type": "disabled"}, "seed": 1})
    _push_text(pc, fe, "partial answer")
    assert pc.finish("length")["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("body,code", [
    ("{not json", "invalid_json"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "invalid_request_error"),
    ({"messages": []}, "invalid_request_error"),
    ({"messages": [USER], "max_tokens": 0}, "invalid_request_error"),
    ({"messages": [USER], "max_tokens": -1}, "invalid_request_error"),
    ({"messages": [USER], "n": 3}, "invalid_request_error"),
    ({"model": "gpt-4o", "messages": [USER]}, "model_not_found"),
    ({"messages": [{"role": "user", "content": "word " * 5000}]}, "context_length_exceeded"),
    ([1, 2], "invalid_request_error"),
])
def test_bad_requests_raise_request_error(fe, body, code):
    with pytest.raises(RequestError) as e:
        fe.prepare(body)
    assert e.value.record["code"] == code and e.value.record["message"]


def test_image_fetch_filter():
    assert public_address_only("example.com", "93.184.216.34")
    for addr in ("10.0.0.1", "127.0.0.1", "169.254.169.254", "192.168.1.1", "::1", "fc00::1", "0.0.0.0", "junk"):
        assert not public_address_only("h", addr)
    fe_on = ChatFrontend(TOK, "x", 4096, 1, enable_image_fetch=True, image_max_bytes=1000)
    assert fe_on.image_fetcher is not None
    assert ChatFrontend(TOK, "x", 4096, 1).image_fetcher is None


# ------------------------------------------------------------------ through LLM.chat
def test_llm_chat_eos_is_dropped_and_finishes():
    enc = HFTokenizer.from_file(TOK).encode("Bonjour!", add_special_tokens=False).ids
    llm = LLM(ScriptedModel(enc), num_blocks=16, max_model_len=4096, created=0)
    res = llm.chat([{"messages": [USER], "thinking": {"type": "disabled"}, "max_tokens": 20, "seed": 2}])[0]
    assert res["choices"][0]["message"]["content"] == "Bonjour!"
    assert res["choices"][0]["finish_reason"] == "stop"
    assert res["usage"]["completion_tokens"] == len(enc)  # EOS not counted


def test_llm_chat_tool_call_and_other_apis():
    text = ("<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n<｜DSML｜parameter name=\"city\" "
            "string=\"true\">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>")
    ids = HFTokenizer.from_file(TOK).encode(text, add_special_tokens=False).ids
    llm = LLM(ScriptedModel(ids), num_blocks=16, max_model_len=4096, created=0)
    chat_body = {"messages": [USER], "tools": [WEATHER], "thinking": {"type": "disabled"}, "max_tokens": 64, "seed": 4}
    r1, r2 = llm.chat([chat_body, chat_body])
    assert r1 == r2 and r1["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    msgs = llm.chat([{"model": "DeepSeek-V4-Pro", "max_tokens": 64, "messages": [USER], "thinking": {"type": "disabled"},
                      "tools": [{"name": "get_weather", "description": "w", "input_schema": WEATHER["function"]["parameters"]}]}],
                    api="messages")[0]
    assert not is_error_record(msgs), msgs
    tool_use = [b for b in msgs["content"] if b["type"] == "tool_use"]
    assert tool_use and tool_use[0]["input"] == {"city": "Paris"} and tool_use[0]["id"].startswith("toolu_00_")
    resp = llm.chat([{"input": "What's the weather in Paris?", "max_output_tokens": 64,
                      "tools": [{"type": "function", **WEATHER["function"]}]}], api="responses")[0]
    assert not is_error_record(resp) and resp["error"] is None, resp
    calls = [o for o in resp["output"] if o["type"] == "function_call"]
    assert calls and calls[0]["call_id"].startswith("call_00_")


def test_llm_chat_one_bad_request_does_not_take_others_down():
    llm = LLM(FakeModel(FakeConfig(max_position_embeddings=1024)), num_blocks=32, created=0)
    ok = {"messages": [USER], "thinking": {"type": "disabled"}, "max_tokens": 5, "seed": 1}
    res = llm.chat([ok, "{bad", {"messages": []}, ok, {"messages": [USER], "max_tokens": 2000}])
    assert "choices" in res[0] and "choices" in res[3] and res[0]["choices"] == res[3]["choices"]
    assert [is_error_record(r) for r in res] == [False, True, True, False, True]
    assert res[4]["error"]["code"] == "context_length_exceeded"


def test_llm_chat_logprobs():
    llm = LLM(FakeModel(FakeConfig(max_position_embeddings=1024)), num_blocks=32, created=0)
    res = llm.chat([{"messages": [USER], "thinking": {"type": "disabled"}, "max_tokens": 3, "seed": 1,
                     "logprobs": True, "top_logprobs": 2}])[0]
    content = res["choices"][0]["logprobs"]["content"]
    assert content and all(len(c["top_logprobs"]) == 2 and c["logprob"] <= 0 for c in content)
    assert all(c["top_logprobs"][0]["logprob"] >= c["logprob"] for c in content)


def test_model_field_same_family_served_name_other_family_refused(fe):
    """A recipe name of the served family is accepted and the response names the model that answered; a name of
    another family (its prompt format differs) is an error record naming the field."""
    p = fe.prepare({"model": "DeepSeek-V4-Pro", "messages": [USER], "max_tokens": 4})
    assert p.model_name == "tiny-test"
    assert fe.prepare({"model": "tiny-test", "messages": [USER], "max_tokens": 4}).model_name == "tiny-test"
    with pytest.raises(RequestError) as e:
        fe.prepare({"model": "DeepSeek-V4.1-Flash", "messages": [USER], "max_tokens": 4})
    assert e.value.record["param"] == "model" and e.value.record["code"] == "model_not_found"
    assert "DeepSeek-V4.1" in str(e.value) and "tiny-test" in str(e.value)


def test_max_completion_tokens_top_k_and_logit_bias_keys(fe):
    """max_completion_tokens (OpenAI's current name) sets the budget; top_k reaches the sampler; logit_bias keys are
    ASCII decimal token ids, each named once."""
    body = {"messages": [USER], "thinking": {"type": "disabled"}}
    assert fe.prepare({**body, "max_completion_tokens": 2}).params.max_tokens == 2
    assert fe.prepare({**body, "max_completion_tokens": 3, "max_tokens": 3}).params.max_tokens == 3
    with pytest.raises(RequestError) as e:
        fe.prepare({**body, "max_completion_tokens": 2, "max_tokens": 5})
    assert e.value.record["param"] == "max_completion_tokens"
    assert fe.prepare({**body, "max_tokens": 4, "top_k": 1}).params.top_k == 1
    for bad in (1.5, "2", True, -2, 2 ** 40):
        with pytest.raises(RequestError) as e:
            fe.prepare({**body, "max_tokens": 4, "top_k": bad})
        assert e.value.record["param"] == "top_k", bad
    for bias in ({"\u0663": 5}, {"5": 1, "05": -1}):
        with pytest.raises(RequestError) as e:
            fe.prepare({**body, "max_tokens": 4, "logit_bias": bias})
        assert e.value.record["param"] == "logit_bias", bias


@pytest.mark.parametrize("api,body", [
    ("chat", {"messages": [{"role": "user", "content": [{"type": "file", "file": {"file_id": "f"}}]}]}),
    ("responses", {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}),
])
def test_file_parts_are_refused(fe, api, body):
    """The models are text-only: a request with a file part is refused, never answered without it (images: see
    test_api_misuse.py, they become "[Unsupported Image]" in V4 prompts)."""
    with pytest.raises(RequestError) as e:
        fe.prepare(body, api=api)
    assert e.value.record["code"] == "images_unsupported"


@pytest.mark.parametrize("field,value", [("temperature", float("nan")), ("top_p", float("inf")), ("max_tokens", "4"),
                                         ("seed", 2 ** 64), ("frequency_penalty", [1]), ("n", True)])
def test_numeric_fields_are_named(fe, field, value):
    """A top-level number that is not a finite JSON number in range is refused with the field named (the recipe's
    own messages do not name it)."""
    with pytest.raises(RequestError) as e:
        fe.prepare({"messages": [USER], "max_tokens": 4, field: value})
    assert e.value.record["param"] == field and field in str(e.value)


def test_developer_role_is_the_system_role(fe):
    sys_msg = {"role": "system", "content": "Be brief."}
    a = fe.prepare({"messages": [sys_msg, USER], "max_tokens": 4, "seed": 1})
    b = fe.prepare({"messages": [{**sys_msg, "role": "developer"}, USER], "max_tokens": 4, "seed": 1})
    assert a.prompt_token_ids == b.prompt_token_ids
