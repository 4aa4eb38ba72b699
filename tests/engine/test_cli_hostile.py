"""Issue 25, item 7 (newcomer's run): memory before a load, make-checkpoint's size, OpenAI Batch lines in
``deepinfer generate``, defaults in ``--help``, ``--version``, determinism-check progress."""

from __future__ import annotations

import json

import pytest
import torch

from deepinfer import __version__, checkpoint, llm as llm_mod
from deepinfer.cli import build_parser, main, run_determinism_check, run_generate
from deepinfer.presets import checkpoint_size, default_model_path, preset_config
from fake_model import FakeConfig, FakeModel

HI = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "thinking": {"type": "disabled"}}


# ------------------------------------------------------------------ memory
def test_load_memory_estimate_matches_the_loaded_weights():
    from deepinfer import LLM

    cfg = checkpoint.read_config(default_model_path())
    need = checkpoint.load_memory_bytes(cfg, "dequant", torch.float32)
    model = LLM("tiny", num_blocks=4).model
    held = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    assert 0.9 * held <= need <= held  # a lower bound, within 10%
    assert checkpoint.load_memory_bytes(cfg, "fp8", torch.float32) < need


def test_a_load_that_cannot_fit_is_refused_with_the_figure_and_the_alternatives(monkeypatch):
    from deepinfer import LLM

    monkeypatch.setattr(llm_mod, "available_memory", lambda device: 1 << 20)  # 1 MiB free
    calls = []
    monkeypatch.setattr(checkpoint, "load_checkpoint", lambda *a, **k: calls.append(1))
    with pytest.raises(ValueError) as e:
        LLM("tiny", gemm="dequant")
    msg = str(e.value)
    assert "needs at least 0.1 GiB" in msg and "0.0 GiB is free" in msg
    assert "--gemm fp8" in msg and "--num-experts" in msg
    assert not calls  # refused before any weight was read


def test_make_checkpoint_states_its_size(tmp_path, capsys):
    out = tmp_path / "ck"
    assert main(["make-checkpoint", "--preset", "tiny", "--out", str(out), "--num-layers", "2"]) == 0
    err = capsys.readouterr().err
    size = checkpoint_size("tiny", num_layers=2)
    assert f"({size:,} bytes)" in err
    written = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    assert size <= written <= size * 1.05  # the headers on top
    flash = checkpoint_size("v4-flash-shapes")
    assert flash > 15 * 2 ** 30  # the ~20 GB a newcomer was never told about
    assert checkpoint_size("v4-flash-shapes", num_experts=16) < flash / 4
    assert preset_config("v4-flash-shapes")["n_routed_experts"] == 256


# ------------------------------------------------------------------ OpenAI Batch lines
def _generate(tmp_path, lines, api="chat"):
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(json.dumps(x) if not isinstance(x, str) else x for x in lines) + "\n")
    out = tmp_path / "out.jsonl"
    args = build_parser().parse_args(["generate", "--input", str(inp), "--output", str(out), "--created", "0",
                                      "--no-progress", "--api", api])
    assert run_generate(args, model_obj=FakeModel(FakeConfig(max_position_embeddings=1024))) == 0
    return [json.loads(x) for x in out.read_text().splitlines()]


def test_batch_api_lines_in_and_out(tmp_path):
    ok = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": HI}
    recs = _generate(tmp_path, [
        ok,
        HI,                                                         # a plain body beside them
        {**ok, "custom_id": "b", "body": {**HI, "max_tokens": 0}},  # the request's own error
        {**ok, "custom_id": "a"},                                   # repeated custom_id
        {**ok, "custom_id": "c", "url": "/v1/messages"},            # another endpoint
        {**ok, "custom_id": "d", "method": "GET"},
        {**ok, "custom_id": "e", "extra": 1},
        {**ok, "custom_id": 5},
    ])
    a = recs[0]
    assert set(a) == {"id", "custom_id", "response", "error"} and a["custom_id"] == "a" and a["error"] is None
    assert a["response"]["status_code"] == 200 and a["response"]["body"]["object"] == "chat.completion"
    assert a["response"]["request_id"] == a["response"]["body"]["id"] and a["id"].startswith("batch_req_")
    assert recs[1]["object"] == "chat.completion"
    b = recs[2]["response"]
    assert b["status_code"] == 400 and b["body"]["error"]["param"] == "max_tokens"
    for rec, param in zip(recs[3:], ["custom_id", "url", "method", "extra", "custom_id"]):
        assert rec["response"] is None and rec["error"]["param"] == param, rec
        assert rec["error"]["line"] == recs.index(rec) + 1
    assert recs[3]["custom_id"] == "a" and "repeats line 1" in recs[3]["error"]["message"]
    ids = [r["id"] for r in recs if "custom_id" in r]
    assert len(set(ids)) == len(ids), ids  # the repeated custom_id's record has its own id


def test_batch_lines_for_the_messages_endpoint(tmp_path):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    recs = _generate(tmp_path, [{"custom_id": "m", "method": "POST", "url": "/v1/messages", "body": body}],
                     api="messages")
    assert recs[0]["response"]["status_code"] == 200 and recs[0]["response"]["body"]["type"] == "message"



def test_many_batch_lines_parse_in_one_pass_and_repeats_name_the_first_line():
    """The repeated-custom_id check scanned every earlier line: 40,000 Batch lines took 90 s to parse before the run
    (a million, hours). It is one dict lookup per line now; a repeat still names the first line that holds the id,
    and a line refused for another reason holds no id."""
    from deepinfer.cli import _parse_lines

    ok = {"method": "POST", "url": "/v1/chat/completions", "body": HI}
    n = 20000
    lines = [{"custom_id": f"r{i}", **ok} for i in range(n)]
    lines += [{"custom_id": "r7", **ok}, {"custom_id": "x", **ok, "method": "GET"}, {"custom_id": "x", **ok}]
    records, custom_ids, bodies, where = _parse_lines([json.dumps(x).encode() for x in lines], "chat")
    assert len(bodies) == n + 1 and where[-1] == n + 2 and custom_ids[:n] == [f"r{i}" for i in range(n)]
    assert "repeats line 8" in records[n]["error"]["message"] and records[n + 1]["error"]["param"] == "method"
    assert records[n + 2] is None and custom_ids[n + 2] == "x"

# ------------------------------------------------------------------ --help, --version, progress
def test_help_shows_defaults_and_presets(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = capsys.readouterr().out
    assert "(default: 2048)" in out and "(default: 64)" in out and "tiny, deepinfer-tiny" in out
    assert "4096" in out  # the tiny preset's real context default
    with pytest.raises(SystemExit):
        main(["determinism-check", "--help"])
    assert "(default: 1,7,33,64)" in capsys.readouterr().out


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"deepinfer {__version__}"


def test_determinism_check_shows_progress(capsys):
    args = build_parser().parse_args(["determinism-check", "--batch-sizes", "1,3", "--max-tokens", "2",
                                      "--prompt-len", "4", "--num-blocks", "32"])
    assert run_determinism_check(args, model_obj=FakeModel(FakeConfig(max_position_embeddings=1024))) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("determinism-check: lone run, then 2 batch sizes")
    assert err[1].startswith("determinism-check: batch 1/2 (size 1)") and err[2].startswith("determinism-check: batch 2/2 (size 3)")


# ------------------------------------------------------------------ --max-model-len
def test_max_model_len_above_the_models_warns_and_is_lowered():
    from deepinfer import LLM

    with pytest.warns(UserWarning, match="max_model_len 2048 exceeds the 1024 tokens the model was built for"):
        llm = LLM(FakeModel(FakeConfig(max_position_embeddings=1024)), max_model_len=2048, num_blocks=16)
    assert llm.max_model_len == 1024
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # at or below the model's limit: no warning
        assert LLM(FakeModel(FakeConfig(max_position_embeddings=1024)), max_model_len=1024,
                   num_blocks=16).max_model_len == 1024


def test_cli_max_model_len_warning_is_one_line(tmp_path, capsys, monkeypatch):
    import deepinfer.cli as cli

    run = cli.run_generate
    monkeypatch.setattr(cli, "run_generate",
                        lambda args: run(args, model_obj=FakeModel(FakeConfig(max_position_embeddings=1024))))
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps(HI) + "\n")
    assert main(["generate", "--input", str(inp), "--output", str(tmp_path / "o.jsonl"), "--no-progress",
                 "--max-model-len", "4096"]) == 0
    err = capsys.readouterr().err
    assert "deepinfer: warning: max_model_len 4096 exceeds the 1024 tokens the model was built for" in err
    assert "UserWarning" not in err


# ------------------------------------------------------------------ output paths and unencodable text
def test_a_lone_surrogate_copied_into_a_record_loses_no_line(tmp_path):
    # json.dumps escapes a lone surrogate as "\ud800": the bad line gets its record, the others theirs
    recs = _generate(tmp_path, [HI, '{"\\ud800": 1, "messages": [{"role": "user", "content": "hi"}]}', HI,
                                {"custom_id": "\ud800x", "method": "POST", "url": "/v1/chat/completions", "body": HI}])
    assert len(recs) == 4 and recs[0]["object"] == recs[2]["object"] == "chat.completion"
    assert recs[1]["error"]["param"] == "\ud800"
    # a custom_id is held to the rule body strings follow: valid Unicode (refused on its line, not echoed)
    assert recs[3]["error"]["param"] == "custom_id" and recs[3]["custom_id"] is None


def test_output_through_a_symlink_writes_its_target(tmp_path):
    from deepinfer.cli import _Output

    target, link = tmp_path / "real.jsonl", tmp_path / "link.jsonl"
    target.write_text("old\n")
    link.symlink_to(target)
    _Output(str(link)).write([{"a": 1}])
    assert link.is_symlink() and json.loads(target.read_text()) == {"a": 1}


def test_output_to_a_fifo_is_written_in_place_not_replaced(tmp_path):
    import os
    import threading

    from deepinfer.cli import _Output

    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_text()))
    reader.start()
    _Output(str(fifo)).write([{"a": 1}, {"b": 2}])
    reader.join(10)
    assert got == ['{"a": 1}\n{"b": 2}\n'] and fifo.is_fifo()


def test_summary_reports_no_throughput_when_nothing_finished(tmp_path, capsys):
    """Every request refused or failed: the tok/s figures are 0 and a note says why (they were computed from the
    steps of requests that never finished)."""
    from deepinfer.stats import NO_THROUGHPUT, EngineStats

    steps = [(0, 100, 0.1, 0.0, 0.0, 0.0), (4, 0, 0.01, 0.0, 0.0, 0.0)]
    failed = EngineStats(num_requests=2, num_errors=2, decode_tokens=4, decode_time=0.01, prefill_tokens=100,
                         prefill_time=0.1, steps=steps).summary()
    assert failed["note"] == NO_THROUGHPUT
    assert failed["decode_tok_s"] == failed["prefill_tok_s"] == failed["decode_tok_s_median"] == 0.0
    ok = EngineStats(num_requests=2, num_errors=1, decode_tokens=4, decode_time=0.01, steps=steps).summary()
    assert ok["note"] is None and ok["decode_tok_s"] == pytest.approx(400.0)
    inp, out, summary = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "s.json"
    inp.write_text("{not json\n" + json.dumps({**HI, "max_tokens": 0}) + "\n")
    args = build_parser().parse_args(["generate", "--input", str(inp), "--output", str(out), "--no-progress",
                                      "--summary-json", str(summary)])
    assert run_generate(args, model_obj=FakeModel(FakeConfig(max_position_embeddings=1024))) == 0
    s = json.loads(summary.read_text())
    assert s["errors"] == 2 and s["note"] == NO_THROUGHPUT and s["decode_tok_s"] == 0.0
    assert "decode n/a (no request finished" in capsys.readouterr().err
