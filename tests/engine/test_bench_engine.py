"""bench/bench_engine.py on the tiny model (CPU): both modes in one run, the overhead rows, the alone-vs-batched flag."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench" / "bench_engine.py"


def _bench_module():
    spec = importlib.util.spec_from_file_location("bench_engine_under_test", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_run_mode_both_modes_and_overhead_rows():
    from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM

    mod = _bench_module()
    model = DeepseekV4ForCausalLM.from_checkpoint().eval()
    args = argparse.Namespace(num_requests=3, prompt_len=20, max_tokens=3, temperature=0.0,
                              max_num_batched_tokens=128, num_blocks=16, device="cpu")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        off = mod.run_mode(model, False, args, {"checkpoint": "tiny"})
        on = mod.run_mode(model, True, args, {"checkpoint": "tiny"})
    finally:
        torch.set_num_threads(n)
    for row in (off, on):
        assert row["prefill_tok_s"] > 0 and row["decode_tok_s"] > 0
        assert row["prefill_tok_s_median"] > 0 and row["decode_tok_s_median"] > 0
        # a step's time runs from the previous step's result to its own: with asynchronous scheduling (the default)
        # it can be shorter than the host time of one enqueue, so only both being measured is checked
        assert row["decode_enqueue_ms_median"] > 0 and row["decode_step_ms_median"] > 0
        assert row["us"] == pytest.approx(1e6 / row["decode_tok_s"], rel=1e-3)
    assert on["shape"]["batch_invariant"] and not off["shape"]["batch_invariant"]
    assert on["alone_equals_batched"] and on["alone_max_abs_logprob_diff"] == 0.0
    rows = mod.overhead_rows(off, on)
    assert [r["op"] for r in rows] == ["engine_prefill", "engine_decode"]
    for r, phase in zip(rows, ("prefill", "decode")):
        med, mean = f"{phase}_tok_s_median", f"{phase}_tok_s"
        assert r["tok_s"] == on[med] and r["tok_s_mean"] == on[mean]
        assert r["peers"]["batch_invariant_off"]["tok_s"] == off[med]
        assert r["peers"]["batch_invariant_off"]["tok_s_mean"] == off[mean]
        assert r["overhead_pct"] == pytest.approx(100 * (off[med] / on[med] - 1), abs=0.01)
        assert r["overhead_pct_mean"] == pytest.approx(100 * (off[mean] / on[mean] - 1), abs=0.01)
        assert "batch_invariant" not in r["shape"]


def test_engine_stats_medians_take_pure_steps_only():
    from deepinfer.stats import EngineStats

    st = EngineStats(steps=[(0, 100, 0.1, 0.05, 0.06, 0.09), (0, 100, 0.2, 0.1, 0.1, 0.1), (0, 100, 10.0, 0.1, 0.1, 0.1),
                            (4, 0, 0.01, 0.008, 0.009, 0.004), (4, 0, 0.02, 0.006, 0.007, 0.006),
                            (2, 50, 0.5, 0.4, 0.4, 0.4)])
    s = st.summary()
    assert s["prefill_tok_s_median"] == pytest.approx(500.0)  # 1000, 500, 10 tok/s: the middle one
    assert s["decode_tok_s_median"] == pytest.approx(300.0)  # 400 and 200: their mean; the mixed step is left out
    assert s["decode_step_ms_median"] == pytest.approx(15.0) and s["decode_enqueue_ms_median"] == pytest.approx(7.0)
    assert s["decode_host_ms_median"] == pytest.approx(8.0) and s["decode_gpu_ms_median"] == pytest.approx(5.0)
    assert s["prefill_gpu_ms_median"] == pytest.approx(100.0)
    empty = EngineStats().summary()
    assert empty["decode_tok_s_median"] == 0.0 and empty["decode_enqueue_ms_median"] == 0.0


def test_engine_stats_at_peak_takes_the_largest_batch_steps_only():
    """decode_tok_s_at_peak: decode tokens over decode time from the first to the last step at the run's largest
    batch (a mixed step's time split by its tokens); the ramp and the drain, with fewer sequences, are left out."""
    from deepinfer.stats import EngineStats

    steps = [(0, 400, 0.5, 0, 0, 0), (8, 0, 0.01, 0, 0, 0), (6, 6, 0.02, 0, 0, 0), (3, 0, 0.01, 0, 0, 0),
             (1, 0, 0.01, 0, 0, 0)]
    s = EngineStats(steps=steps, step_seqs=[4, 4, 4, 3, 1]).summary()
    assert s["peak_seqs"] == 4 and s["peak_steps"] == 3
    assert s["decode_tok_s_at_peak"] == pytest.approx(14 / 0.02)  # 8 in 0.01 s, 6 in half of 0.02 s
    # the window runs from the first to the last step at the peak: a step below it in between counts
    s = EngineStats(steps=steps, step_seqs=[4, 4, 3, 4, 1]).summary()
    assert s["peak_steps"] == 4 and s["decode_tok_s_at_peak"] == pytest.approx(17 / 0.03)
    # stats without per-step batch sizes (built from steps alone, or merged ranks) measure no peak
    assert EngineStats(steps=steps).summary()["decode_tok_s_at_peak"] == 0.0
    merged = EngineStats.merged([EngineStats(steps=steps, step_seqs=[4, 4, 4, 3, 1])] * 2).summary()
    assert merged["decode_tok_s_at_peak"] == 0.0 and merged["peak_steps"] == 0


def test_overhead_rows_without_a_measured_rate_report_no_overhead():
    """A run with no pure decode (or prefill) step has a median rate of 0 (EngineStats: not measured): the overhead
    is None on either side, not -100% (off side 0) -- and a measured pair still gives its percentage."""
    mod = _bench_module()

    def row(pre_med, dec_med, bi):
        return {"shape": {"batch_invariant": bi}, "prefill_tok_s_median": pre_med, "decode_tok_s_median": dec_med,
                "prefill_tok_s": 100.0, "decode_tok_s": 10.0, "alone_equals_batched": True}

    rows = mod.overhead_rows(row(200.0, 0.0, False), row(100.0, 20.0, True))
    assert rows[0]["overhead_pct"] == 100.0 and rows[1]["overhead_pct"] is None
    rows = mod.overhead_rows(row(0.0, 20.0, False), row(0.0, 0.0, True))
    assert rows[0]["overhead_pct"] is None and rows[1]["overhead_pct"] is None
    assert rows[0]["overhead_pct_mean"] == 0.0


def test_sweep_rows_and_rooflines():
    """The engine-core sweep on the CPU: a decode row per batch size and a prefill row per step size, per mode,
    each with its roofline."""
    from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM

    mod = _bench_module()
    model = DeepseekV4ForCausalLM.from_checkpoint().eval()
    args = argparse.Namespace(prompt_len=16, max_tokens=3, max_num_batched_tokens=64, device="cpu",
                              decode_batches="1,2", prefill_tokens="32", core_modes="async,eager", profile=False)
    rows = mod.sweep(model, args, {"checkpoint": "tiny"})
    assert [(r["op"], r["shape"]["async_scheduling"]) for r in rows] == [
        ("engine_decode", True), ("engine_decode", True), ("engine_prefill", True),
        ("engine_decode", False), ("engine_decode", False), ("engine_prefill", False)]
    for r in rows:
        assert r["step_ms"] > 0 and r["roofline_ms"] > 0 and not r["shape"]["cuda_graphs"]
    assert rows[1]["roofline_ms"] > rows[0]["roofline_ms"]  # more sequences read more KV


def test_bench_host_runs_both_plan_paths():
    """bench/bench_host.py: the stand-in model runs real plans, eager and into captured-bucket buffers (a plan
    that does not fit its bucket raises), with drawn rows, with one cache group and with the window group, and
    reports both timings."""
    spec = importlib.util.spec_from_file_location("bench_host_under_test", BENCH.parent / "bench_host.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for window_group in (False, True):  # with the window group, 300 tokens: decodes release their first block
        args = argparse.Namespace(vocab=64, prompt_len=300 if window_group else 130, steps=3, warmup=1, temperature=0.7, profile=False,
                                  window_group=window_group)
        for graphs in (False, True):
            row, _ = mod.run(5, graphs, args)
            assert row["shape"]["batch"] == 5 and row["shape"]["graph_plans"] == graphs
            assert row["shape"]["window_group"] == window_group
            assert row["host_ms"] > 0 and row["host_cpu_ms"] > 0
    # whole speculative graph steps of a small random checkpoint, replays stubbed
    args = argparse.Namespace(vocab=64, prompt_len=20, steps=3, warmup=1, temperature=0.0, profile=False,
                              draft_tokens=2, spec_layers=4)
    row, _ = mod.spec_steps(2, args)
    assert row["shape"]["layers"] == 4 and row["graph_steps"] >= 3 and row["host_ms"] > 0


def test_make_checkpoint_vocab_size_is_for_the_tiny_preset_only(tmp_path):
    from deepinfer.presets import make_checkpoint

    for preset, value in (("v4-flash-shapes", 512), ("tiny", 1), ("tiny", True)):
        with pytest.raises(ValueError, match="vocab_size"):
            make_checkpoint(preset, tmp_path / "x", vocab_size=value)


def test_kept_rows_keep_other_checkpoints_with_their_commit(tmp_path):
    import json

    mod = _bench_module()
    assert mod.kept_rows(tmp_path, "bench_engine", "v41-flash-shapes") == []
    rows = [{"op": "engine_generate", "shape": {"checkpoint": c}, "us": 1.0} for c in ("v4-flash-shapes",
                                                                                   "v41-flash-shapes")]
    rows[0]["commit"] = "old"
    (tmp_path / "bench_engine.json").write_text(json.dumps({"commit": "doc", "rows": rows + [dict(rows[1])]}))
    assert mod.kept_rows(tmp_path, "bench_engine", "v41-flash-shapes") == [{**rows[0], "commit": "old"}]
    assert [r["commit"] for r in mod.kept_rows(tmp_path, "bench_engine", "v4-flash-shapes")] == ["doc", "doc"]
    for bad in ("{not json", "[1, 2]", '{"rows": [1]}', '{"rows": null}', '{"commit": "x"}'):
        (tmp_path / "bench_engine.json").write_text(bad)
        assert mod.kept_rows(tmp_path, "bench_engine", "v41-flash-shapes") == []
