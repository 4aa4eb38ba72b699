"""bench/plot_curves.py: the points, Pareto frontiers and CSV files of the throughput-latency curves; the PNG plots
where matplotlib is installed."""

from __future__ import annotations

import csv
import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "plot_curves.py"


@pytest.fixture(scope="module")
def plot():
    spec = importlib.util.spec_from_file_location("plot_curves_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


def _engine_doc() -> dict:
    rows = []
    for graphs in (True, False):
        for batch, step_ms in ((1, 10.0), (8, 12.0), (64, 20.0), (256, 50.0)):
            rows.append({"op": "engine_decode", "shape": {"batch": batch, "cuda_graphs": graphs,
                                                          "async_scheduling": graphs},
                         "decode_tok_s": batch * 1e3 / (step_ms * (1 if graphs else 2)), "step_ms": step_ms})
        for tokens, step_ms in ((1024, 40.0), (4096, 100.0), (65536, 1600.0)):
            rows.append({"op": "engine_prefill", "shape": {"step_tokens": tokens, "cuda_graphs": graphs,
                                                           "async_scheduling": graphs}, "step_ms": step_ms})
    return {"gpu": "x", "rows": rows}


def _serve_doc() -> dict:
    rows = [{"op": "serve", "shape": {"request_rate": "inf", "max_concurrency": c}, "median_tpot_ms": tpot,
             "output_throughput": c * 1e3 / tpot, "request_throughput": c / 2, "p50_ttft_ms": 10.0 * c,
             "p99_ttft_ms": 20.0 * c} for c, tpot in ((1, 10.0), (16, 20.0), (64, 40.0))]
    return {"gpu": "x", "rows": rows + [{"op": "serve", "shape": {"request_rate": 2.0, "max_concurrency": None},
                                         "median_tpot_ms": None, "output_throughput": 0.0}]}


def test_points_per_gpu_and_pareto(plot):
    dec = plot.decode_points(_engine_doc()["rows"], num_gpus=2)
    assert len(dec) == 8 and {p["series"] for p in dec} == {"graphs+async", "eager"}
    p256 = next(p for p in dec if p["batch"] == 256 and p["series"] == "graphs+async")
    assert p256["tok_s_per_gpu"] == pytest.approx(256 * 1e3 / 50 / 2) and p256["tok_s_per_user"] == 20.0
    pre = plot.prefill_points(_engine_doc()["rows"])
    assert [p["tok_s_per_gpu"] for p in pre[:3]] == [25600.0, 40960.0, 40960.0]
    pts = [{"x": 1, "y": 5}, {"x": 2, "y": 4}, {"x": 3, "y": 1}, {"x": 2.5, "y": 0.5}]
    assert [p["x"] for p in plot.pareto(pts, "x", "y")] == [1, 2, 3]  # (2.5, 0.5) is beaten by (3, 1)
    assert [p["x"] for p in plot.pareto(pts, "x", "y", x_larger_better=False)] == [1]
    serve = plot.serve_points(_serve_doc()["rows"])
    assert [p["label"] for p in serve] == ["c=1", "c=16", "c=64"]  # the row without a TPOT is left out


def test_csv_files_without_matplotlib(plot, tmp_path):
    (tmp_path / "bench_engine_core.json").write_text(json.dumps(_engine_doc()))
    (tmp_path / "bench_serve.json").write_text(json.dumps(_serve_doc()))
    written = plot.main([str(tmp_path), "--no-png"])
    assert [p.name for p in written] == ["bench_engine_core_decode.csv", "bench_engine_core_prefill.csv",
                                         "bench_serve.csv"]
    rows = list(csv.DictReader(open(tmp_path / "bench_engine_core_decode.csv")))
    assert len(rows) == 8 and rows[0]["series"] == "graphs+async" and float(rows[0]["tok_s_per_user"]) == 100.0


def test_bad_inputs_are_clear_errors(plot, tmp_path, capsys):
    with pytest.raises(SystemExit):
        plot.main([str(tmp_path)])
    assert "nothing to draw" in capsys.readouterr().err
    bad = tmp_path / "bench_serve.json"
    bad.write_text('{"rows": [{"op": "engine_decode"}]}')
    with pytest.raises(SystemExit) as e:
        plot.main(["--serve", str(bad), "--no-png"])
    assert e.value.code == 2 and "no serve rows" in capsys.readouterr().err
    bad.write_text("[1]")
    with pytest.raises(SystemExit):
        plot.main(["--serve", str(bad)])
    assert "expected a benchmark document" in capsys.readouterr().err


def test_png_plots(plot, tmp_path):
    pytest.importorskip("matplotlib")
    (tmp_path / "bench_engine_core.json").write_text(json.dumps(_engine_doc()))
    (tmp_path / "bench_serve.json").write_text(json.dumps(_serve_doc()))
    written = plot.main([str(tmp_path)])
    pngs = [p for p in written if p.suffix == ".png"]
    assert [p.name for p in pngs] == ["bench_engine_core_decode.png", "bench_engine_core_prefill.png",
                                      "bench_serve.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
