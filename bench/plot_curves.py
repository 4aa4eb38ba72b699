"""Throughput-latency curves from benchmark JSON: CSV tables always, PNG Pareto plots with matplotlib.

Usage (from the repository root):
    python bench/plot_curves.py bench/results/h200          # every known JSON in the folder, outputs beside them
    python bench/plot_curves.py --engine E.json --serve S.json --out-dir DIR [--num-gpus 1] [--no-png]

Inputs: the engine-core sweep (`bench/bench_engine.py --sweep`, default name bench_engine_core.json: rows
engine_decode and engine_prefill) and the serving sweep (`bench/bench_serve.py`, bench_serve.json: rows serve).

Curves (the axes of DeepInfer's charts; every throughput per GPU = measured / --num-gpus):
- decode: x = tok/s per user (decode tok/s / batch: each running request gains one token per step), y = output tok/s
  per GPU; one point per batch size (requests per GPU), one series per core mode (CUDA graphs, async scheduling);
- prefill: x = step latency in ms, y = non-cached input tok/s per GPU; one point per step size (tokens per step);
- serve: x = tok/s per user (1000 / median TPOT), y = output tok/s per GPU; one point per sweep point, and a second
  panel with TTFT p50 / p99 against request throughput.
Each plot draws every point and joins its series' Pareto frontier (the points no other point beats on both axes).
Writes <stem>_decode.csv / .png, <stem>_prefill.csv / .png (stem: the engine JSON's) and <stem>.csv / .png for the
serving JSON.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

ENGINE_NAMES = ("bench_engine_core.json",)
SERVE_NAMES = ("bench_serve.json",)


def load_rows(path: Path) -> list[dict]:
    try:
        doc = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: not JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
        raise ValueError(f"{path}: expected a benchmark document {{'rows': [...]}} (bench/timer.py write_results)")
    return doc["rows"]


def _mode(shape: dict) -> str:
    graphs, async_ = shape.get("cuda_graphs"), shape.get("async_scheduling")
    return ("graphs" if graphs else "eager") + ("+async" if async_ else "")


def decode_points(rows: list[dict], num_gpus: int = 1) -> list[dict]:
    """One point per engine_decode row: ``{"series", "batch", "tok_s_per_user", "tok_s_per_gpu", "step_ms"}``."""
    out = []
    for r in rows:
        if r.get("op") != "engine_decode":
            continue
        batch, tok_s = int(r["shape"]["batch"]), float(r.get("decode_tok_s") or 0.0)
        if tok_s <= 0:
            continue
        out.append({"series": _mode(r["shape"]), "batch": batch, "requests_per_gpu": batch / num_gpus,
                    "tok_s_per_user": round(tok_s / batch, 3), "tok_s_per_gpu": round(tok_s / num_gpus, 3),
                    "step_ms": r.get("step_ms")})
    return out


def prefill_points(rows: list[dict], num_gpus: int = 1) -> list[dict]:
    """One point per engine_prefill row: ``{"series", "step_tokens", "step_ms", "tok_s_per_gpu"}``."""
    out = []
    for r in rows:
        if r.get("op") != "engine_prefill" or not r.get("step_ms"):
            continue
        tokens = int(r["shape"]["step_tokens"])
        out.append({"series": _mode(r["shape"]), "step_tokens": tokens, "step_ms": float(r["step_ms"]),
                    "tok_s_per_gpu": round(tokens * 1e3 / float(r["step_ms"]) / num_gpus, 3)})
    return out


def serve_points(rows: list[dict], num_gpus: int = 1) -> list[dict]:
    """One point per serve row (a sweep point with a measured TPOT)."""
    out = []
    for r in rows:
        if r.get("op") != "serve" or not r.get("median_tpot_ms"):
            continue
        s = r["shape"]
        label = f"c={s['max_concurrency']}" if s.get("request_rate") == "inf" else f"{s['request_rate']} req/s"
        out.append({"series": "serve", "label": label, "request_rate": s.get("request_rate"),
                    "max_concurrency": s.get("max_concurrency"),
                    "tok_s_per_user": round(1e3 / float(r["median_tpot_ms"]), 3),
                    "tok_s_per_gpu": round(float(r["output_throughput"]) / num_gpus, 3),
                    "request_throughput": r.get("request_throughput"), "p50_ttft_ms": r.get("p50_ttft_ms"),
                    "p99_ttft_ms": r.get("p99_ttft_ms"), "goodput": r.get("goodput")})
    return out


def pareto(points: list[dict], x: str, y: str, x_larger_better: bool = True) -> list[dict]:
    """The points no other point beats on both ``x`` and ``y`` (y: larger is better), sorted by x."""
    key = (lambda p: -p[x]) if x_larger_better else (lambda p: p[x])
    front, best = [], float("-inf")
    for p in sorted(points, key=lambda p: (key(p), -p[y])):
        if p[y] > best:
            front.append(p)
            best = p[y]
    return sorted(front, key=lambda p: p[x])


def write_csv(path: Path, points: list[dict]) -> Path:
    cols = list(dict.fromkeys(k for p in points for k in p))
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(points)
    print(f"wrote {path}")
    return path


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("PNG plots need matplotlib (pip install matplotlib); the CSV files were written, "
                           "--no-png skips the plots") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_curve(path: Path, points: list[dict], x: str, y: str, xlabel: str, ylabel: str, title: str,
               annotate: str | None, x_larger_better: bool = True, log_x: bool = False) -> Path:
    """A scatter of every point and its series' Pareto frontier as a line; ``annotate``: the key printed by each
    point (batch, step tokens)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 5), dpi=120)
    for series in dict.fromkeys(p["series"] for p in points):
        pts = [p for p in points if p["series"] == series]
        front = pareto(pts, x, y, x_larger_better)
        line, = ax.plot([p[x] for p in front], [p[y] for p in front], marker="o", label=series)
        ax.scatter([p[x] for p in pts], [p[y] for p in pts], color=line.get_color(), s=12)
        if annotate:
            for p in pts:
                ax.annotate(str(p[annotate]), (p[x], p[y]), textcoords="offset points", xytext=(4, 4), fontsize=7)
    if log_x:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    print(f"wrote {path}")
    return path


def plot_serve(path: Path, points: list[dict], title: str) -> Path:
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 5), dpi=120)
    front = pareto(points, "tok_s_per_user", "tok_s_per_gpu")
    a.plot([p["tok_s_per_user"] for p in front], [p["tok_s_per_gpu"] for p in front], marker="o")
    a.scatter([p["tok_s_per_user"] for p in points], [p["tok_s_per_gpu"] for p in points], s=12)
    for p in points:
        a.annotate(p["label"], (p["tok_s_per_user"], p["tok_s_per_gpu"]), textcoords="offset points",
                   xytext=(4, 4), fontsize=7)
    a.set_xlabel("tok/s per user (1000 / median TPOT ms)")
    a.set_ylabel("output tok/s per GPU")
    a.set_title(title)
    pts = sorted(points, key=lambda p: p["request_throughput"] or 0)
    for key in ("p50_ttft_ms", "p99_ttft_ms"):
        b.plot([p["request_throughput"] for p in pts], [p[key] for p in pts], marker="o", label=key[:3] + " TTFT")
    b.set_xlabel("request throughput (req/s)")
    b.set_ylabel("TTFT (ms)")
    b.set_title("time to first token")
    b.legend()
    for ax in (a, b):
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    print(f"wrote {path}")
    return path


def draw(engine: Path | None, serve: Path | None, out_dir: Path, num_gpus: int = 1, png: bool = True) -> list[Path]:
    """Write the CSV (and PNG) files of the given JSON files into ``out_dir``; returns their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    if engine is not None:
        rows, stem = load_rows(engine), engine.stem
        dec, pre = decode_points(rows, num_gpus), prefill_points(rows, num_gpus)
        if not dec and not pre:
            raise ValueError(f"{engine}: no engine_decode / engine_prefill rows (bench_engine.py --sweep writes them)")
        if dec:
            written.append(write_csv(out_dir / f"{stem}_decode.csv", dec))
            if png:
                written.append(plot_curve(out_dir / f"{stem}_decode.png", dec, "tok_s_per_user", "tok_s_per_gpu",
                                          "tok/s per user", "output tok/s per GPU",
                                          "decode: throughput vs interactivity (labels: requests per GPU)", "batch"))
        if pre:
            written.append(write_csv(out_dir / f"{stem}_prefill.csv", pre))
            if png:
                written.append(plot_curve(out_dir / f"{stem}_prefill.png", pre, "step_ms", "tok_s_per_gpu",
                                          "step latency (ms)", "non-cached input tok/s per GPU",
                                          "prefill: throughput vs step latency (labels: tokens per step)",
                                          "step_tokens", x_larger_better=False, log_x=True))
    if serve is not None:
        pts = serve_points(load_rows(serve), num_gpus)
        if not pts:
            raise ValueError(f"{serve}: no serve rows with a measured TPOT (bench_serve.py writes them)")
        written.append(write_csv(out_dir / f"{serve.stem}.csv", pts))
        if png:
            written.append(plot_serve(out_dir / f"{serve.stem}.png", pts, "serving: throughput vs interactivity"))
    return written


def main(argv: list[str] | None = None) -> list[Path]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", nargs="?", type=Path, default=None,
                   help=f"a results folder: its {', '.join(ENGINE_NAMES + SERVE_NAMES)}")
    p.add_argument("--engine", type=Path, default=None, help="engine-core sweep JSON (bench_engine.py --sweep)")
    p.add_argument("--serve", type=Path, default=None, help="serving sweep JSON (bench_serve.py)")
    p.add_argument("--out-dir", type=Path, default=None, help="where the CSV / PNG go (default: beside the JSON)")
    p.add_argument("--num-gpus", type=int, default=1, help="GPUs of the measured run (throughputs are per GPU)")
    p.add_argument("--no-png", action="store_true", help="CSV only (no matplotlib needed)")
    args = p.parse_args(argv)
    if args.num_gpus < 1:
        p.error(f"--num-gpus: expected >= 1, got {args.num_gpus}")
    engine, serve = args.engine, args.serve
    if args.folder is not None:
        if not args.folder.is_dir():
            p.error(f"{args.folder}: not a folder")
        engine = engine or next((args.folder / n for n in ENGINE_NAMES if (args.folder / n).is_file()), None)
        serve = serve or next((args.folder / n for n in SERVE_NAMES if (args.folder / n).is_file()), None)
    if engine is None and serve is None:
        p.error("nothing to draw: give a results folder holding bench_engine_core.json / bench_serve.json, "
                "or --engine / --serve")
    for flag, path in (("--engine", engine), ("--serve", serve)):
        if path is not None and not path.is_file():
            p.error(f"{flag} {path}: no such file")
    out_dir = args.out_dir or (engine or serve).parent
    try:
        return draw(engine, serve, out_dir, args.num_gpus, png=not args.no_png)
    except (ValueError, RuntimeError) as e:
        print(f"plot_curves: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
