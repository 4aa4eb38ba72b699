"""The one timer and result writer every benchmark uses.

Timing: CUDA events around each call, after a warm-up, with the L2 cache flushed before every timed call
(a 256 MB buffer is *read*, so the 60 MB L2 holds only clean lines: inputs come from HBM, and no write-back of the
flush competes with the timed kernel); the median of ``iters`` calls is
reported. Results: ``bench/results/<gpu>/<bench>.json`` = ``{"gpu", "torch", "commit", "rows": [...]}`` where each
row is ``{"op", "shape": {...}, "us", "tflops"?, "gbps"?, "peers": {name: {"us", "tflops"?, "gbps"?}}}``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
from pathlib import Path
from typing import Callable

import torch

_L2_FLUSH_BYTES = 256 << 20
_flush_buf: torch.Tensor | None = None


def _flush_l2() -> None:
    global _flush_buf
    if _flush_buf is None:
        _flush_buf = torch.ones(_L2_FLUSH_BYTES // 4, dtype=torch.float32, device="cuda")
    _flush_buf.sum()  # a read-only pass: evicts the L2 without leaving dirty lines behind


#: GPU cycles of the sleep before each timed call with ``hide_launch`` (about 100 us at H100 / H200 clocks)
_SLEEP_CYCLES = 200_000


def time_cuda(fn: Callable[[], object], *, warmup: int = 5, iters: int = 50, flush_l2: bool = True,
              hide_launch: bool = False) -> float:
    """Median time of ``fn()`` in microseconds (CUDA events; L2 flushed before each timed call).

    ``hide_launch``: a sleep kernel (``torch.cuda._sleep``) runs between the flush and the start event, so the
    host has enqueued ``fn``'s kernels before the interval opens. Without it a call whose host side outlasts the
    flush (about 60 us) is timed with the GPU idle waiting for its launch: a diagnosis for short ops."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        if flush_l2:
            _flush_l2()
        if hide_launch:
            torch.cuda._sleep(_SLEEP_CYCLES)
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))


def gpu_tag() -> str:
    """Short name of the current GPU for the results folder (``h200``, ``h100``, ...)."""
    name = torch.cuda.get_device_name().lower() if torch.cuda.is_available() else "cpu"
    for tag in ("h200", "h100", "h800", "b200", "gb200", "a100"):
        if tag in name:
            return tag
    return "".join(c if c.isalnum() else "_" for c in name)


def commit_id() -> str:
    """``DEEPINFER_COMMIT`` (set by tools/gpu_check.sh, whose tree travels without .git) or ``git rev-parse HEAD``."""
    env = os.environ.get("DEEPINFER_COMMIT")
    if env:
        return env
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def bench_args(description: str) -> argparse.Namespace:
    """Common CLI of every bench script: ``--out-dir`` (default bench/results/<gpu>) and ``--quick`` (fewer shapes)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out-dir", type=Path, default=None, help="folder for the JSON (default bench/results/<gpu>)")
    p.add_argument("--quick", action="store_true", help="a few shapes only (smoke run)")
    return p.parse_args()


def metrics(us: float, flops: float | None = None, bytes_moved: float | None = None) -> dict:
    """``{"us", "tflops"?, "gbps"?}`` from a time and the op's flop and byte counts."""
    out = {"us": round(us, 3)}
    if flops is not None:
        out["tflops"] = round(flops / (us * 1e-6) / 1e12, 2)
    if bytes_moved is not None:
        out["gbps"] = round(bytes_moved / (us * 1e-6) / 1e9, 1)
    return out


def format_row(row: dict) -> str:
    """``shape | us | TFLOPS | GB/s | x peer`` (speed-up of ours over each peer)."""
    shape = ",".join(f"{k}={v}" for k, v in row["shape"].items())
    parts = [f"{row['op']} {shape}", f"{row['us']:.2f} us",
             f"{row.get('tflops', float('nan')):.1f} TFLOPS", f"{row.get('gbps', float('nan')):.0f} GB/s"]
    for name, peer in row.get("peers", {}).items():
        parts.append(f"x{peer['us'] / row['us']:.2f} vs {name}")
    return " | ".join(parts)


def write_results(bench_name: str, rows: list[dict], out_dir: Path | None = None) -> Path:
    """Print one line per row plus the geometric-mean speed-up per peer, and write the JSON file."""
    for row in rows:
        print(format_row(row))
    peers = sorted({name for row in rows for name in row.get("peers", {})})
    for name in peers:
        ratios = [row["peers"][name]["us"] / row["us"] for row in rows if name in row.get("peers", {})]
        if ratios:
            gm = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
            print(f"geomean speed-up vs {name}: x{gm:.3f} over {len(ratios)} shapes")
    out_dir = out_dir or Path(__file__).resolve().parent / "results" / gpu_tag()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{bench_name}.json"
    doc = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
           "torch": torch.__version__, "commit": commit_id(), "rows": rows}
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {path}")
    return path
