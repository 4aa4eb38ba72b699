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


def test_summary_json_in_a_missing_folder_fails_before_the_run(tmp_path, capsys):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}\n')
    out = tmp_path / "out.jsonl"
    rc = main(["generate", "--input", str(inp), "--output", str(out), "--summary-json",
               str(tmp_path / "missing" / "s.json"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "--summary-json" in err and "does not exist" in err
    assert "start-up" not in err and not out.exists()  # refused before the model was loaded
