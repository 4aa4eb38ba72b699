"""bench/bench_serve.py: the smoke mode (a `deepinfer serve` subprocess with the tiny preset), a JSONL dataset against
an in-process server, the metric arithmetic and the argument checks; /v1/completions' ignore_eos."""

from __future__ import annotations

import importlib.util
import json
import math
import random
import sys
from pathlib import Path

import openai
import pytest

from deepinfer import LLM
from fake_model import FakeConfig, FakeModel

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_serve.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_serve_under_test", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


def _check_row(row, num_prompts, output_len):
    assert row["op"] == "serve" and row["completed"] == num_prompts and row["failed"] == 0, row.get("errors")
    assert row["total_output_tokens"] == num_prompts * output_len
    assert row["output_throughput"] > 0 and row["request_throughput"] > 0
    assert row["us"] == pytest.approx(1e6 / row["output_throughput"], rel=1e-3)
    for m in ("ttft", "tpot", "itl", "e2el"):
        assert 0 < row[f"p50_{m}_ms"] <= row[f"p90_{m}_ms"] <= row[f"p99_{m}_ms"], m
    assert row["median_ttft_ms"] <= row["median_e2el_ms"]


def test_smoke_mode_starts_a_server_and_writes_json(bench, tmp_path):
    out = bench.main(["--smoke", "--out-dir", str(tmp_path)])
    doc = json.loads(out["json"].read_text())
    assert out["json"] == tmp_path / "bench_serve.json" and {"gpu", "torch", "commit", "rows"} <= set(doc)
    rows = doc["rows"]
    assert [r["shape"]["max_concurrency"] for r in rows] == [1, 3]
    for row in rows:
        _check_row(row, 6, 4)
        assert row["shape"]["input_len"] == 16 and row["total_input_tokens"] == 6 * 16
    lines = [json.loads(x) for x in out["requests"].read_text().splitlines()]
    assert len(lines) == 12 and {x["point"] for x in lines} == {0, 1}
    assert all(x["ok"] and x["output_tokens"] == 4 and x["prompt_tokens"] == 16 for x in lines)


def test_jsonl_dataset_and_rate_sweep_against_a_running_server(bench, start_server, tmp_path):
    server = start_server(LLM(FakeModel(FakeConfig(eos_every=2)), num_blocks=64, max_num_seqs=8))
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps(x) for x in [
        {"prompt": "Once upon a time", "max_tokens": 3, "ignore_eos": True},
        {"prompt": [1000, 1001, 1002], "max_tokens": 3, "ignore_eos": True},
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}]) + "\n\n")
    out = bench.main(["--url", server.url, "--dataset", str(data), "--num-prompts", "9", "--request-rates", "50,inf",
                      "--max-concurrency", "4", "--goodput", "ttft:60000", "tpot:60000", "--out-dir", str(tmp_path),
                      "--results-name", "serve_jsonl"])
    rows = out["rows"]
    assert [r["shape"]["request_rate"] for r in rows] == [50.0, "inf"]
    assert all(r["shape"]["max_concurrency"] == 4 for r in rows)
    for r in rows:
        assert r["completed"] == 9 and r["failed"] == 0, r.get("errors")
        assert r["goodput"] == pytest.approx(r["request_throughput"], rel=1e-6)  # generous SLOs: every one is good
    assert out["json"].name == "serve_jsonl.json" and out["requests"].name == "serve_jsonl_requests.jsonl"
    server.wait_idle()


def test_failed_requests_are_counted_not_fatal(bench, start_server, tmp_path):
    server = start_server(LLM(FakeModel(), num_blocks=64, max_num_seqs=4))
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"prompt": [5, 6], "max_tokens": 2}) + "\n"
                    + json.dumps({"prompt": [5, 6], "max_tokens": 2, "top_k": -7}) + "\n")  # a 400
    # the warm-up is the first (shuffled) request and must succeed: a seed whose first request is the valid one
    seed = next(s for s in range(100) if "top_k" not in bench.jsonl_requests(str(data), 4, 8, s)[0].body)
    rows = bench.main(["--url", server.url, "--dataset", str(data), "--num-prompts", "4", "--concurrency", "2",
                       "--seed", str(seed), "--out-dir", str(tmp_path)])["rows"]
    assert rows[0]["completed"] + rows[0]["failed"] == 4 and rows[0]["failed"] >= 1
    assert any("top_k" in e for e in rows[0]["errors"])
    server.wait_idle()


def _request():
    """A real request of the HTTP library this ``openai`` uses (some versions read its headers on errors)."""
    http = openai.AsyncOpenAI(api_key="x", base_url="http://127.0.0.1:9/v1")._client
    return http.build_request("POST", "http://127.0.0.1:9/v1/completions")


class _FlakyCompletions:
    """``completions.create`` that fails to connect ``fails`` times, then streams one chunk with usage."""

    def __init__(self, fails: int, exc):
        self.fails, self.exc, self.calls = fails, exc, 0

    async def create(self, **kw):
        self.calls += 1
        if self.calls <= self.fails:
            raise self.exc(request=_request())

        async def stream():
            usage = type("U", (), {"prompt_tokens": 2, "completion_tokens": 1})()
            yield type("C", (), {"usage": usage, "choices": [type("Ch", (), {"text": "x"})()]})()

        return stream()


@pytest.mark.parametrize("fails,retries,ok", [(0, 2, True), (2, 2, True), (3, 2, False), (1, 0, False)])
def test_connection_errors_before_a_response_are_retried_and_counted(bench, fails, retries, ok):
    import asyncio

    client = type("Client", (), {})()
    client.completions = _FlakyCompletions(fails, openai.APIConnectionError)
    req = bench.BenchRequest("completions", {"prompt": [5, 6], "max_tokens": 1}, 2, 1)
    res = asyncio.run(bench.send(client, "m", req, 0.0, connect_retries=retries))
    assert res.ok is ok and res.connect_retries == min(fails, retries)
    if not ok:
        assert res.error.startswith("APIConnectionError")
    assert bench.summarize([res], 1.0, {})["connect_retries"] == res.connect_retries


def test_timeouts_are_never_retried(bench):
    import asyncio

    client = type("Client", (), {})()
    client.completions = _FlakyCompletions(1, openai.APITimeoutError)
    res = asyncio.run(bench.send(client, "m", bench.BenchRequest("completions", {"prompt": [5], "max_tokens": 1}, 1, 1), 0.0, 2))
    assert not res.ok and res.connect_retries == 0 and client.completions.calls == 1


def test_summary_arithmetic(bench):
    R = bench.RequestResult
    rs = [R(ok=True, prompt_tokens=10, output_tokens=5, ttft_ms=t, tpot_ms=2 * t, e2el_ms=10 * t, itl_ms=[t, t])
          for t in (1.0, 2.0, 3.0, 4.0)] + [R(ok=False, error="boom")]
    s = bench.summarize(rs, 2.0, {"ttft": 2.5})
    assert (s["completed"], s["failed"], s["errors"]) == (4, 1, ["boom"])
    assert s["request_throughput"] == 2.0 and s["output_throughput"] == 10.0 and s["input_throughput"] == 20.0
    assert s["mean_ttft_ms"] == 2.5 and s["median_ttft_ms"] == 2.5 and s["p90_ttft_ms"] == pytest.approx(3.7)
    assert s["p99_e2el_ms"] == pytest.approx(39.7) and s["median_itl_ms"] == 2.5
    assert s["goodput"] == 1.0  # two of four within 2.5 ms, over 2 s
    assert s["output_tok_s_per_user"] == pytest.approx(1e3 / 5.0)
    numpy = pytest.importorskip("numpy")
    vals = [random.Random(3).random() for _ in range(37)]
    for q in (50, 90, 99):
        assert bench.percentile(vals, q) == pytest.approx(float(numpy.percentile(vals, q)))
    assert bench.percentile([], 50) is None


@pytest.mark.parametrize("argv,needle", [
    (["--concurrency", "0"], "--concurrency"),
    (["--request-rates", "fast"], "--request-rates"),
    (["--goodput", "latency:5"], "--goodput"),
    (["--goodput", "ttft:-1"], "--goodput"),
    (["--num-prompts", "0"], "--num-prompts"),
    (["--range-ratio", "1.5"], "--range-ratio"),
    (["--connect-retries", "-1"], "--connect-retries"),
])
def test_bad_arguments_name_the_flag(bench, argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--url", "http://127.0.0.1:9", *argv])
    assert e.value.code == 2 and needle in capsys.readouterr().err


@pytest.mark.parametrize("line,needle", [
    ("{not json", "line 1: malformed JSON"),
    ('{"text": "x"}', "line 1: expected an object with 'prompt' or 'messages'"),
    ('{"prompt": "x", "max_tokens": 0}', "line 1: max_tokens must be a positive integer"),
])
def test_bad_dataset_lines_name_the_line(bench, tmp_path, line, needle, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(line + "\n")
    with pytest.raises(SystemExit):
        bench.main(["--url", "http://127.0.0.1:9", "--dataset", str(data)])
    assert needle in capsys.readouterr().err


def test_sweep_points(bench):
    args = bench.build_parser().parse_args(["--request-rates", "1,inf", "--max-concurrency", "8"])
    args.concurrency = None
    assert bench.sweep_points(args) == [(1.0, 8), (math.inf, 8)]
    args = bench.build_parser().parse_args(["--concurrency", "2,4"])
    assert bench.sweep_points(args) == [(math.inf, 2), (math.inf, 4)]


def test_completions_ignore_eos_runs_to_max_tokens(start_server):
    """vLLM's ``ignore_eos`` on /v1/completions: a model that ends almost every answer at once still gives
    max_tokens tokens; without it the answer stops early; a non-bool is refused naming the field."""
    server = start_server(LLM(FakeModel(FakeConfig(eos_every=1)), num_blocks=64))
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    kw = dict(model=server.llm.served_model_name, prompt=[7, 8, 9], max_tokens=6, temperature=0)
    assert client.completions.create(**kw).usage.completion_tokens < 6
    r = client.completions.create(**kw, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 6 and r.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**kw, extra_body={"ignore_eos": "yes"})
    assert e.value.body["param"] == "ignore_eos"
    server.wait_idle()
