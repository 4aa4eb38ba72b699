"""bench/bench_prefix_cache.py in its --tiny smoke mode (CPU): every scenario runs and the JSON carries the hits."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_prefix_cache.py"

pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def test_tiny_smoke_run_writes_every_row(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_prefix_cache_under_test", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["--tiny", "--out-dir", str(tmp_path)])
    doc = json.loads((tmp_path / "bench_prefix_cache.json").read_text())
    rows = {(r["op"], r["shape"].get("turn")): r for r in doc["rows"]}
    cold, hit = rows["shared_prefix_cold", None], rows["shared_prefix_hit", None]
    assert cold["cached_tokens"] == 0 and cold["computed_prefill_tokens"] == cold["prompt_tokens"]
    assert hit["cached_tokens"] == 4 * 1024 and hit["computed_prefill_tokens"] == 4 * 64
    assert rows["shared_prefix_hit_sibling", None]["cached_tokens"] >= 3 * 1024
    assert rows["multi_turn", 0]["cached_tokens"] == 0 and rows["multi_turn", 2]["hit_rate_resent"] > 0.5
    mem = rows["memory", None]
    assert mem["single_request_peak_blocks"]["on"] == mem["single_request_peak_blocks"]["off"]
    assert mem["full_bytes_per_cached_token"] > 0 and mem["window_snapshot_bytes"] > 0
    for op in ("host_tier", "host_tier_scattered"):
        assert rows[op, None]["out_GBps"] > 0 and rows[op, None]["in_GBps"] > 0


def test_only_host_tier_writes_its_own_file(tmp_path):
    spec = importlib.util.spec_from_file_location("bench_prefix_cache_only", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["--tiny", "--only", "host_tier", "--host-blocks", "8", "--out-dir", str(tmp_path)])
    doc = json.loads((tmp_path / "bench_prefix_cache_host_tier.json").read_text())
    assert [r["op"] for r in doc["rows"]] == ["host_tier", "host_tier_scattered"]
    assert all(r["shape"]["blocks"] == 8 for r in doc["rows"])
    assert not (tmp_path / "bench_prefix_cache.json").exists()
