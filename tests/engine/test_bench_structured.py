"""bench/bench_structured.py in its --tiny mode (CPU), at small sizes: both runs decode every step, the rows carry
the mask-fill time of the constrained run only, and the JSON is written."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_structured.py"

pytestmark = pytest.mark.usefixtures("one_cpu_thread")
pytest.importorskip("xgrammar")


def test_tiny_run_writes_a_row_per_batch(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_structured_under_test", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["--tiny", "--batches", "1,3", "--prompt-len", "8", "--max-tokens", "6", "--repeats", "1",
              "--out-dir", str(tmp_path)])
    doc = json.loads((tmp_path / "bench_structured.json").read_text())
    assert [r["shape"]["batch"] for r in doc["rows"]] == [1, 3]
    for r in doc["rows"]:
        free = r["peers"]["unconstrained"]
        assert r["op"] == "structured_decode" and r["shape"]["async_scheduling"] is True
        assert r["mask_fill_ms"] > 0 and free["mask_fill_ms"] == 0
        assert r["steps"] == free["steps"] and r["step_ms"] > 0 and free["step_ms"] > 0
        assert r["overhead_pct"] == pytest.approx(100 * (r["step_ms"] / free["step_ms"] - 1), abs=0.01)
    assert mod.schema(5)["properties"]["records"]["minItems"] == 5
