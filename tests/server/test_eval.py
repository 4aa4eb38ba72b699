"""``deepinfer eval --url``: the same scoring through a running server (the official openai client)."""

from __future__ import annotations

import json
from pathlib import Path

from deepinfer import LLM
from deepinfer.cli import main
from fake_model import ScriptedModel

SAMPLES = Path(__file__).resolve().parents[2] / "examples" / "eval"


def test_eval_through_a_server(start_server, tmp_path, capsys):
    ids = LLM(ScriptedModel([0]), num_blocks=16).encode("Hmm.</think>Explanation: known.\nExact Answer: 12\n"
                                                       "Confidence: 90%")
    server = start_server(LLM(ScriptedModel(ids), num_blocks=64, max_num_seqs=8))
    argv = ["eval", "--task", "hle", "--data", str(SAMPLES / "hle.jsonl"), "-n", "3", "--max-tokens", "64",
            "--url", server.url, "--concurrency", "4", "--log", str(tmp_path / "hle.log"), "--no-progress"]
    assert main(argv) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["model"] == server.url and rep["num_samples"] == 12
    assert rep["per_item"] == {"di-hle-1": 0.0, "di-hle-2": 0.0, "di-hle-3": 0.0, "di-hle-4": 1.0}
    log = [json.loads(x) for x in (tmp_path / "hle.log").read_text().splitlines()]
    assert {r["extracted"] for r in log} == {"12"} and all(r["finish_reason"] == "stop" for r in log)
    # a model name the server does not serve: every sample is a failed request, counted wrong, never a crash
    assert main([*argv, "--model", "nope", "--log", str(tmp_path / "other.log")]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["pass@1"] == 0.0 and rep["num_errors"] == 12
    server.wait_idle()
