"""``bench/bench_ep.py`` as a CPU smoke run (2 gloo ranks, tiny sizes): every (op, tokens, dtype) row, with the
byte counts the routing implies. The figures themselves mean nothing on the CPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from bench import bench_ep  # noqa: E402


def test_bench_ep_smoke(tmp_path):
    out = bench_ep.main(["--device", "cpu", "--world", "2", "--tokens", "0,24", "--hidden", "256",
                         "--num-experts", "8", "--top-k", "3", "--quick", "--out-dir", str(tmp_path)])
    doc = json.loads(out.read_text())
    assert doc["backend"] == "gloo" and doc["device"] == "cpu"
    rows = {(r["op"], r["shape"]["tokens_per_rank"], r["shape"]["dtype"]): r for r in doc["rows"]}
    assert len(rows) == 3 * 2 * 2
    for (op, T, dt), r in rows.items():
        assert r["us"] > 0 and r["bytes_per_rank"] >= 0 and r["link"]["us"] > 0
        if T == 0:
            assert r["bytes_per_rank"] == 0
    # 24 tokens x 3 distinct experts of 8 over 2 ranks (the ranks' mean): a token meets the other rank at most once,
    # an FP8 row is 256 codes + 2 float32 scales; combine returns one bf16 row per remote pair
    d, c = rows[("dispatch", 24, "fp8")], rows[("combine", 24, "fp8")]
    assert 0 < d["bytes_per_rank"] <= 24 * (256 + 2 * 4) and 0 < c["bytes_per_rank"] <= 24 * 3 * 2 * 256
    assert abs(rows[("dispatch", 24, "bf16")]["bytes_per_rank"] / 512 - d["bytes_per_rank"] / 264) < 1
    assert c["bytes_per_rank"] >= d["bytes_per_rank"] / 264 * 512  # every remote row carries at least one pair


def test_bench_ep_refuses_cpu_figures_as_h200_results():
    with pytest.raises(SystemExit):
        bench_ep.parse_args(["--device", "cpu", "--out-dir", str(ROOT / "bench" / "results" / "h200")])


def test_bench_ep_engine_smoke(tmp_path):
    from bench import bench_ep_engine

    out = bench_ep_engine.main(["--model", "tiny", "--device", "cpu", "--configs", "dp2ep2", "--num-requests", "3",
                                "--prompt-len", "8", "--max-tokens", "3", "--num-blocks", "8",
                                "--out-dir", str(tmp_path)])
    (row,) = json.loads(out.read_text())["rows"]
    assert row["shape"]["data_parallel_size"] == row["shape"]["expert_parallel_size"] == 2
    assert row["prefill_tok_s"] > 0 and row["decode_tok_s"] > 0
    assert row["decode_tok_s_per_gpu"] == row["decode_tok_s"] / 2 and row["cache_blocks_per_rank"] == 8
    with pytest.raises(SystemExit):
        bench_ep_engine.parse_args(["--model", "tiny", "--configs", "dp2ep3x"])
