"""``deepinfer generate`` on examples/requests.jsonl: every line answered, errors where the input is bad."""

import io
import json
import sys
from pathlib import Path

import pytest

from deepinfer.cli import build_parser, main, run_generate
from fake_model import FakeConfig, FakeModel

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "requests.jsonl"


def _expected_error(line: str) -> str | None:
    """Why a line of the examples must fail, judged from the line itself."""
    try:
        body = json.loads(line)
    except ValueError:
        return "malformed"
    msgs = body.get("messages")
    if not msgs:
        return "empty messages"
    if any(m.get("role") not in ("system", "user", "assistant", "tool") for m in msgs):
        return "unknown role"
    if "max_tokens" in body and body["max_tokens"] <= 0:
        return "max_tokens"
    if body.get("n", 1) > 1:
        return "n"
    if body.get("model", "DeepSeek-V4-Pro") not in ("DeepSeek-V4-Pro",):
        return "model"
    if sum(len(m["content"]) for m in msgs) > 4 * 4096:
        return "too long"
    return None


def _run(tmp_path, argv_extra=(), model=None):
    out = tmp_path / "out.jsonl"
    args = build_parser().parse_args(["generate", "--input", str(EXAMPLES), "--output", str(out), "--created", "0",
                                      "--max-model-len", "4096", "--no-progress", *argv_extra])
    run_generate(args, model_obj=model)
    return [json.loads(l) for l in out.read_text(encoding="utf-8").splitlines()]


def test_examples_every_line_answered_with_fake_model(tmp_path, capsys):
    lines = EXAMPLES.read_text(encoding="utf-8").splitlines()
    kinds = [_expected_error(l) for l in lines]
    assert {"malformed", "empty messages", "unknown role", "max_tokens", "n", "model", "too long"} <= set(kinds)
    model = FakeModel(FakeConfig(max_position_embeddings=4096))
    recs = _run(tmp_path, ["--num-blocks", "128", "--summary-json", str(tmp_path / "s.json")], model)
    assert len(recs) == len(lines)
    for n, (kind, rec) in enumerate(zip(kinds, recs), start=1):
        if kind is None:
            assert rec.get("object") == "chat.completion", (n, rec)
            choice = rec["choices"][0]
            assert choice["finish_reason"] in ("stop", "length", "tool_calls")
            assert set(choice["message"]) >= {"role", "content"}
            assert rec["usage"]["completion_tokens"] >= 0 and isinstance(rec["seed"], int)
        else:
            assert set(rec) == {"line", "error"} and rec["line"] == n, (n, kind, rec)
            assert rec["error"]["message"]
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["requests"] == len(lines) and summary["errors"] == sum(k is not None for k in kinds)
    assert summary["completion_tokens"] > 0 and summary["prefill_tok_s"] > 0
    err = capsys.readouterr().err
    assert "prefill" in err and "decode" in err and "TTFT" in err and "TPOT" in err


def test_stdin_stdout_and_seeded_lines_reproduce(tmp_path, monkeypatch, capsys):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "seed": 5, "temperature": 0.9,
            "thinking": {"type": "disabled"}}
    text = json.dumps(body) + "\n\n" + json.dumps(body) + "\n"
    model = FakeModel(FakeConfig(max_position_embeddings=1024))
    monkeypatch.setattr(sys, "stdin", io.StringIO(text))
    args = build_parser().parse_args(["generate", "--input", "-", "--output", "-", "--created", "0", "--no-progress",
                                      "--batch-invariant"])
    run_generate(args, model_obj=model)
    out = [json.loads(l) for l in capsys.readouterr().out.splitlines()]
    assert len(out) == 3 and out[1]["line"] == 2 and out[1]["error"]["code"] == "invalid_json"
    assert out[0] == out[2]


def test_cli_parser_has_generate():
    args = build_parser().parse_args(["generate", "--input", "a", "--output", "b", "--batch-invariant"])
    assert args.func is run_generate and args.batch_invariant and args.model is None
    with pytest.raises(SystemExit):
        main([])


ENGINE_ARGV = ["--model", "tiny", "--tokenizer", "tok.json", "--served-model-name", "m", "--batch-invariant",
               "--max-num-seqs", "3", "--max-num-batched-tokens", "256", "--num-blocks", "9", "--max-model-len", "1024",
               "--device", "cpu", "--gemm", "dequant", "--kv-cache-dtype", "fp8", "--seed", "5", "--enforce-eager",
               "--no-async-scheduling", "--enable-image-fetch"]


def test_generate_and_serve_share_the_engine_options():
    """One declaration (``add_engine_options``): both subcommands take every engine flag and build the same
    ``EngineConfig`` from it; a bad value is refused by the parser, naming the flag."""
    from deepinfer.cli import engine_config, run_serve

    gen = build_parser().parse_args(["generate", "--input", "a", "--output", "b", *ENGINE_ARGV])
    srv = build_parser().parse_args(["serve", "--port", "0", *ENGINE_ARGV])
    assert srv.func is run_serve and srv.port == 0
    names = ("model", "tokenizer", "served_model_name", "batch_invariant")
    assert [getattr(gen, n) for n in names] == [getattr(srv, n) for n in names] == ["tiny", "tok.json", "m", True]
    cfg = engine_config(srv)
    assert cfg == engine_config(gen)
    assert (cfg.max_num_seqs, cfg.num_blocks, cfg.kv_cache_dtype, cfg.async_scheduling) == (3, 9, "fp8", False)
    defaults = build_parser().parse_args(["serve"])
    assert engine_config(defaults) == engine_config(build_parser().parse_args(["generate", "--input", "a",
                                                                              "--output", "b"]))
    for cmd in (["serve"], ["generate", "--input", "a", "--output", "b"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*cmd, "--max-num-seqs", "0"])


def test_determinism_check_on_fake_model(capsys):
    from deepinfer.cli import run_determinism_check

    model = FakeModel(FakeConfig(vocab_size=700, max_position_embeddings=2048))
    args = build_parser().parse_args(["determinism-check", "--batch-sizes", "1,5,9", "--max-tokens", "6",
                                      "--batch-invariant", "--max-num-batched-tokens", "256", "--num-blocks", "64",
                                      "--prompt-len", "40"])
    assert run_determinism_check(args, model_obj=model) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["distinct_outputs"] == 1 and report["first_divergence"] is None and report["logprobs_bitwise_equal"]
    assert [r["batch_size"] for r in report["runs"]] == [1, 5, 9]


def test_hostile_lines_each_get_their_own_record(tmp_path):
    """Lines that once crashed the whole run or shifted the output: each now yields one record, in order."""
    ok = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                     "thinking": {"type": "disabled"}})
    raw_lines = [
        b"\xef\xbb\xbf" + ok.encode(),                                                   # 1: BOM on line 1 -> fine
        b'{"messages":[{"role":"user","content":"hi"}],"max_tokens":1000000000000000000000000000000}',  # 2: int overflow
        b'{"messages":[{"role":"user","content":"\\ud800"}],"max_tokens":1}',           # 3: lone surrogate
        b'{"messages":[{"role":"user","content":"hi"}],"x":' + b"[" * 200 + b"]" * 200 + b"}",  # 4: deep nesting
        b'{"messages":[{"role":"user","content":"bad \xff byte"}]}',                      # 5: invalid UTF-8
        ok.replace('"hi"', '"a\u2028b\u0085c"').encode(),                                # 6: raw U+2028 / U+0085 -> fine
        json.dumps(ok).encode(),                                                         # 7: a JSON string, not an object
        b"[" * 100000,                                                                   # 8: parser recursion
        ok.encode() + b"\r",                                                             # 9: CRLF -> fine
    ]
    inp = tmp_path / "hostile.jsonl"
    inp.write_bytes(b"\n".join(raw_lines) + b"\n")
    out = tmp_path / "out.jsonl"
    args = build_parser().parse_args(["generate", "--input", str(inp), "--output", str(out), "--created", "0",
                                      "--no-progress"])
    assert run_generate(args, model_obj=FakeModel(FakeConfig(max_position_embeddings=1024))) == 0
    recs = [json.loads(l) for l in out.read_text(encoding="utf-8").split("\n") if l]
    assert len(recs) == len(raw_lines)
    fine = {1, 6, 9}
    for n, rec in enumerate(recs, start=1):
        if n in fine:
            assert rec.get("object") == "chat.completion", (n, rec)
        else:
            assert set(rec) == {"line", "error"} and rec["line"] == n and rec["error"]["message"], (n, rec)
    assert "UTF-8" in recs[4]["error"]["message"] and "JSON object, got str" in recs[6]["error"]["message"]


def test_bad_output_folder_fails_before_the_model_runs(tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}) + "\n")
    calls = []

    class Boom(FakeModel):
        def forward(self, *a, **k):
            calls.append(1)
            return super().forward(*a, **k)

    args = build_parser().parse_args(["generate", "--input", str(inp), "--output", str(tmp_path / "missing" / "o.jsonl"),
                                      "--no-progress"])
    with pytest.raises(FileNotFoundError):
        run_generate(args, model_obj=Boom(FakeConfig(max_position_embeddings=1024)))
    assert not calls, "the model ran although the output could not be written"


def test_failed_run_keeps_the_previous_output_and_a_good_run_replaces_it(tmp_path):
    """The output is written to a temporary file and renamed only when the run completes: a run that fails (here: the
    model raises mid-run) leaves an existing file as it was and no temporary file behind."""
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}) + "\n")
    out = tmp_path / "o.jsonl"
    out.write_text("previous\n")

    class Boom(FakeModel):
        def forward(self, *a, **k):
            raise RuntimeError("boom")

    args = build_parser().parse_args(["generate", "--input", str(inp), "--output", str(out), "--no-progress"])
    with pytest.raises(RuntimeError, match="boom"):
        run_generate(args, model_obj=Boom(FakeConfig(max_position_embeddings=1024)))
    assert out.read_text() == "previous\n" and sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "o.jsonl"]
    assert run_generate(args, model_obj=FakeModel(FakeConfig(max_position_embeddings=1024))) == 0
    lines = out.read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["object"] == "chat.completion"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "o.jsonl"]


def test_cli_errors_are_one_line(tmp_path, capsys):
    rc = main(["generate", "--input", str(tmp_path / "nope.jsonl"), "--output", "-"])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("deepinfer: error:") and "nope.jsonl" in err[-1]


def test_constraints_are_accepted(tmp_path):
    base = {"messages": [{"role": "user", "content": "reply in json"}], "max_tokens": 2}
    bodies = [dict(base, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}),
              dict(base, response_format={"type": "json_object"}), base]
    inp = tmp_path / "c.jsonl"
    inp.write_text("\n".join(json.dumps(b) for b in bodies) + "\n")
    out = tmp_path / "o.jsonl"
    args = build_parser().parse_args(["generate", "--input", str(inp), "--output", str(out), "--no-progress"])
    run_generate(args, model_obj=FakeModel(FakeConfig(max_position_embeddings=1024)))
    recs = [json.loads(l) for l in out.read_text().splitlines()]
    assert all(r.get("object") == "chat.completion" for r in recs), recs


def test_interrupted_run_keeps_finished_results(tmp_path):
    """Ctrl-C / SIGTERM mid-run: the requests that finished keep their responses, every other line gets an
    'interrupted' error record, the output file is complete (one record per line) and the exit code is 130."""
    inp = tmp_path / "in.jsonl"
    short = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "thinking": {"type": "disabled"},
             "temperature": 0}  # greedy: a random draw could end a long request early with EOS
    long = {**short, "max_tokens": 40}
    inp.write_text("\n".join(json.dumps(b) for b in (short, long, "not an object", long)) + "\n")
    out = tmp_path / "o.jsonl"

    class StopAfter(FakeModel):
        def forward(self, *a, **k):
            if self.num_forward_calls >= 4:
                raise KeyboardInterrupt
            return super().forward(*a, **k)

    args = build_parser().parse_args(["generate", "--input", str(inp), "--output", str(out), "--no-progress"])
    never_eos = FakeConfig(max_position_embeddings=1024, eos_every=10**9)  # the long requests cannot end early
    assert run_generate(args, model_obj=StopAfter(never_eos)) == 130
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(recs) == 4 and recs[0]["object"] == "chat.completion"
    assert recs[1]["error"]["code"] == "interrupted" and recs[3]["error"]["code"] == "interrupted"
    assert recs[2]["line"] == 3 and recs[2]["error"]["code"] != "interrupted"


@pytest.mark.parametrize("port", ["99999", "-1", "x"])
def test_serve_refuses_a_port_out_of_range_before_loading(port, capsys):
    """Found by a newcomer: --port 99999 loaded the model, then died in bind() with a traceback."""
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--port", port])
    assert e.value.code == 2 and "--port" in capsys.readouterr().err
