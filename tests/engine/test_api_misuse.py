"""Issue 25, item 8: API misuse is refused where it happens, before any work (each failed on 3ff3f77)."""

from __future__ import annotations

import pytest

from deepinfer import LLM
from deepinfer.cli import main


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny")


def test_chat_with_an_unknown_api_raises(llm):
    with pytest.raises(ValueError, match="chat: api must be one of"):
        llm.chat([{"messages": [{"role": "user", "content": "hi"}]}], api="bogus")


@pytest.mark.parametrize("bad", ["greedy", b"x", {"temperature": 0}, 3])
def test_generate_with_sampling_params_of_the_wrong_type_raises(llm, bad):
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams or a list of them"):
        llm.generate(["a"], bad)



def test_chat_with_one_body_runs_it_once(llm):
    """A dict or JSON text passed as ``requests`` was iterated: its keys or characters each became a body, giving
    one error record per key or character instead of the answer."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "seed": 3,
            "thinking": {"type": "disabled"}}
    import json

    want = llm.chat([body])
    assert len(want) == 1 and want[0]["object"] == "chat.completion"
    for one in (body, json.dumps(body), json.dumps(body).encode()):
        got = llm.chat(one)
        assert len(got) == 1 and got[0]["id"] == want[0]["id"] and got[0]["choices"] == want[0]["choices"]
    with pytest.raises(TypeError, match="requests must be a list of request bodies"):
        llm.chat(5)

def test_summary_json_in_a_missing_folder_fails_before_the_run(tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}\n')
    out = tmp_path / "out.jsonl"
    rc = main(["generate", "--input", str(inp), "--output", str(out), "--summary-json",
               str(tmp_path / "missing" / "s.json"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "--summary-json" in err and "does not exist" in err
    assert "start-up" not in err and not out.exists()  # refused before the model was loaded


@pytest.mark.parametrize("which", ["directory", "the output"])
def test_summary_json_on_a_directory_or_the_output_fails_before_the_run(tmp_path, capsys, which):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}\n')
    out = tmp_path / "out.jsonl"
    summary = tmp_path if which == "directory" else out
    rc = main(["generate", "--input", str(inp), "--output", str(out), "--summary-json", str(summary),
               "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "--summary-json" in err and "start-up" not in err and not out.exists()


# ------------------------------------------------------------------ a model-emitted </think> with thinking off
def test_a_sampled_think_end_stays_in_the_answer_with_thinking_off():
    from fake_model import ScriptedModel

    ids = LLM(ScriptedModel([0]), num_blocks=16, max_model_len=1024).encode("hello</think>world")
    assert len(ids) == 3  # the middle one is the added </think> token, the one the parser knows
    llm = LLM(ScriptedModel(ids), num_blocks=16, max_model_len=1024, created=0)
    off = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 20, "thinking": {"type": "disabled"},
           "logprobs": True}
    choice = llm.chat([off])[0]["choices"][0]
    assert choice["message"]["content"] == "hello</think>world"
    assert [e["token"] for e in choice["logprobs"]["content"]] == ["hello", "</think>", "world"]
    msg = llm.chat([{k: v for k, v in off.items() if k != "logprobs"}], api="messages")[0]
    assert msg["content"] == [{"type": "text", "text": "hello</think>world"}]
    on = llm.chat([{**off, "thinking": {"type": "enabled"}, "logprobs": False}])[0]["choices"][0]["message"]
    assert on["reasoning_content"] == "hello" and on["content"] == "world"  # thinking on: it ends the reasoning


# ------------------------------------------------------------------ images and the image fetcher
@pytest.mark.parametrize("addr", ["64:ff9b::7f00:1", "64:ff9b::a00:1", "2002:7f00:1::1", "2002:c0a8:101::1",
                                  "::7f00:1", "::ffff:127.0.0.1", "64:ff9b:1::808:808"])
def test_ipv6_forms_of_private_ipv4_addresses_are_not_public(addr):
    from deepinfer.chat import public_address_only

    assert not public_address_only("h", addr)


@pytest.mark.parametrize("addr", ["64:ff9b::808:808", "2002:808:808::1", "2606:4700::1111", "8.8.8.8"])
def test_ipv6_forms_of_public_addresses_stay_public(addr):
    from deepinfer.chat import public_address_only

    assert public_address_only("h", addr)


IMAGE_BODIES = [
    ("chat", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this"}, {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x"}}]}]}),
    ("messages", {"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}),
    ("responses", {"max_output_tokens": 2, "input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "data:image/png;base64,AA"}]}]}),
]


@pytest.mark.parametrize("api,body", IMAGE_BODIES)
def test_v4_images_become_unsupported_image_text(llm, api, body):
    """As deepseek-recipe and DeepSeek's API do for V4: each image is the literal text "[Unsupported Image]" in the
    prompt, never fetched, and the request runs."""
    fe = llm.frontend
    pc = fe.prepare(body, api=api)
    prompt = llm.decode(pc.prompt_token_ids)
    assert prompt.count("[Unsupported Image]") == 1, prompt
    pc.close()
    res = llm.chat([dict(body, max_tokens=2) if api != "responses" else body], api=api)[0]
    assert "error" not in res or res["error"] is None, res


@pytest.mark.parametrize("api,body", IMAGE_BODIES)
def test_v41_images_are_still_refused(api, body):
    from deepinfer.chat import ChatFrontend, RequestError, packaged_tokenizer_json

    fe = ChatFrontend(packaged_tokenizer_json(), "tiny-test", 4096, 1, model_version="v4.1")
    with pytest.raises(RequestError) as e:
        fe.prepare(body, api=api)
    assert e.value.record["code"] == "images_unsupported"
