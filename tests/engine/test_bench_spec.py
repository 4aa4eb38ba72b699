"""bench/bench_spec.py on the tiny model (CPU): the rows, the speculation fields, greedy identity with spec off."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import pytest

import deepinfer.spec_decode as sd

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def test_bench_spec_rows(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))  # the bench package
    mod = importlib.import_module("bench.bench_spec")
    out = tmp_path / "bench_spec.json"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The quick brown fox\n\nimport os\n")
    mod.main(["--batches", "2", "--ks", "2", "--max-tokens", "4", "--prompt-len", "8", "--prompts", str(prompts),
              "--waves", "2", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["mode"] for r in rows] == ["off", "scheduled", "fixed-2"]
    for r in rows:
        assert r["decode_tok_s"] > 0 and r["shape"]["batch"] == 2 and r["shape"]["requests"] == 4
    for r in rows[:2]:  # off and scheduled alternate twice (the default --repeats), the faster run kept
        assert len(r["decode_tok_s_runs"]) == 2 and r["decode_tok_s"] == max(r["decode_tok_s_runs"])
    assert "decode_tok_s_runs" not in rows[2]
    for r in rows:  # every step has a kind, and the kinds' decode time is the row's
        kinds = r["time_by_kind"]
        assert kinds and sum(e["decode_s"] for e in kinds.values()) == pytest.approx(r["decode_s"], abs=1e-3)
        assert all(k.startswith("plain-" if r["mode"] == "off" else "spec-") for k in kinds)
        assert r["gc"]["collections"] and r["slow_steps"] >= 0
    for r in rows[1:]:
        assert r["greedy_identical"] and r["verifications"] >= 0 and r["acceptance_length"] >= 1.0
        assert len(r["acceptance_per_position"]) == 2 and r["speedup"] > 0
        assert "cost_model_ms" in r  # None without graphs (the CPU)
    mod.main(["--batches", "1", "--ks", "1", "--max-tokens", "4", "--prompt-len", "8", "--no-scheduled", "--phases", "--timeline",
              "--batch1-requests", "2", "--repeats", "1", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["shape"]["requests"] for r in rows] == [2, 2]  # batch 1: requests one after another
    phases = rows[1]["phase_ms_per_step"]
    assert {"step", "chain", "sample_accept", "mtp_pass", "draw"} <= set(phases) and phases["step"] > 0
    trace = rows[1]["timeline"]  # on the CPU no device time: the whole window idles, inside the step phases
    assert trace["steps"] >= 1 and trace["device_busy_ms"] == 0 and trace["device_idle_ms_in"]["step"] > 0
    assert mod._minus((0, 10), mod._union([(2, 3), (1, 2.5), (5, 6)])) == [(0, 1), (3, 5), (6, 10)]
    assert sd.SpecDecoder.execute.__name__ == "execute"  # the wrappers are gone after the row
    with pytest.raises(SystemExit, match="--model"):
        mod.main(["--model", str(tmp_path / "missing")])


def test_bench_spec_reads_token_id_prompts(tmp_path, monkeypatch):
    """The training script's heldout_prompts.jsonl (``prompt_token_ids``) feeds the bench; a bad line is named."""
    monkeypatch.syspath_prepend(str(ROOT))
    mod = importlib.import_module("bench.bench_spec")
    args = mod.argparse.Namespace(batch_max=3, prompts=str(tmp_path / "p.jsonl"), prompt_len=4)

    class Tok:
        vocab_size = 100

    (tmp_path / "p.jsonl").write_text('{"file": "a.py", "prompt_token_ids": [5, 6, 7, 8, 9]}\n\n'
                                      '{"prompt_token_ids": [1, 2]}\n')
    assert mod.make_prompts(Tok(), args) == [[5, 6, 7, 8], [1, 2], [5, 6, 7, 8]]
    for bad in ('{"prompt_token_ids": [1, 200]}', '{"prompt_token_ids": []}', '[1, 2]', '{"x": 1}', '{bad'):
        (tmp_path / "p.jsonl").write_text('{"prompt_token_ids": [3]}\n' + bad + "\n")
        with pytest.raises(ValueError, match="line 2 of .*prompt_token_ids"):
            mod.make_prompts(Tok(), args)
