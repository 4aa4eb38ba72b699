"""Benchmark EP dispatch / combine (``deepinfer.parallel.dispatch``) per rank, against a raw all_to_all of the same
bytes (the measured link bandwidth through the same backend).

One process per rank (torch.multiprocessing spawn, one GPU each, NCCL; or gloo on the CPU for a smoke run). Each
rank routes ``T`` tokens of ``hidden`` to ``top_k`` distinct experts drawn uniformly from ``num_experts``, placed
contiguously over the ranks; rows are FP8 with float32 1x128 scales or bf16. Dispatch is timed up to its layout
(contiguous per expert); combine sends one bf16 row per (token, expert) pair back and reduces it.

Bytes per rank (what ``gbps`` counts): dispatch: the rows this rank sends to *other* ranks, hidden codes plus
scales (a token goes once to each rank holding one of its experts); combine: the bf16 rows other ranks send back
to this rank (one per pair). Times: per op, the median over iterations of the slowest rank (every iteration starts
after a barrier). ``link`` is ``all_to_all_single`` of the dispatch's byte count split evenly, the reference of
the issue's "70% of measured NVLink bandwidth" (DeepEP on H800: 153 GB/s intranode; 77 / 114 us low-latency
dispatch / combine at EP8 with 128 tokens).

GPUs: python bench/bench_ep.py --world 8            (writes bench/results/<gpu>/bench_ep.json; --results-name
    bench_ep_w4 with --world 4 keeps both)
CPU smoke: python bench/bench_ep.py --device cpu --world 2 --tokens 16 --hidden 256 --num-experts 8 --top-k 2 \
    --out-dir /tmp/ep   (CPU figures are not GPU results: they are never written under bench/results/h200)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.timer import commit_id, gpu_tag  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=None, help="ranks (default: the visible GPUs, 2 on the CPU)")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when available")
    p.add_argument("--tokens", default="128,4096", help="comma-separated tokens per rank")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--num-experts", type=int, default=256)
    p.add_argument("--dtypes", default="fp8,bf16", help="comma-separated: fp8 (with scales), bf16")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--quick", action="store_true", help="fewer iterations (smoke run)")
    p.add_argument("--out-dir", type=Path, default=None, help="default: bench/results/<gpu>")
    p.add_argument("--results-name", default="bench_ep", help="JSON file name without .json (one per --world)")
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.world is None:
        args.world = torch.cuda.device_count() if args.device == "cuda" else 2
        if args.world < 2:  # tools/gpu_check.sh runs every bench: on one GPU there is nothing to measure
            print("bench_ep: fewer than 2 GPUs visible: nothing measured (use a machine with several GPUs)")
            raise SystemExit(0)
    if args.world < 2:
        p.error(f"--world must be >= 2, got {args.world}")
    if args.device == "cuda" and args.world > torch.cuda.device_count():
        p.error(f"--world {args.world}: only {torch.cuda.device_count()} GPUs are visible")
    if args.num_experts % args.world:
        p.error(f"--num-experts {args.num_experts} must be a multiple of --world {args.world}")
    if not 1 <= args.top_k <= args.num_experts:
        p.error(f"--top-k must be in [1, --num-experts], got {args.top_k}")
    if args.quick:
        args.warmup, args.iters = 1, 3
    args.tokens = [int(t) for t in args.tokens.split(",")]
    args.dtypes = args.dtypes.split(",")
    for d in args.dtypes:
        if d not in ("fp8", "bf16"):
            p.error(f"--dtypes: unknown {d!r}")
    out = args.out_dir or RESULTS / (gpu_tag() if args.device == "cuda" else "cpu")
    if args.device == "cpu" and out.resolve().is_relative_to((RESULTS / "h200").resolve()):
        p.error("CPU figures are not H200 results: choose another --out-dir")
    args.out_dir = out
    return args


def _routing(T: int, E: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """``[T, k]`` distinct uniform experts per token."""
    return torch.rand(T, E, generator=gen).argsort(dim=1)[:, :k].contiguous()


def _timed(fn, device, warmup: int, iters: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append(time.perf_counter() - t)
    return out


def _slowest_median(times: list[float], device) -> float:
    """Median over iterations of the slowest rank's time (seconds)."""
    t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return statistics.median(t.cpu().tolist())


def _rank(rank: int, world: int, store: str, args, out_json: str) -> None:
    from deepinfer.parallel import ExpertPlacement
    from deepinfer.parallel.dispatch import combine, dispatch

    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        H, k, E = args.hidden, args.top_k, args.num_experts
        placement = ExpertPlacement.contiguous(E, world)
        per_rank = E // world
        rows = []
        for T in args.tokens:
            gen = torch.Generator().manual_seed(1000 * rank + T)
            idx = _routing(T, E, k, gen).to(device)
            weights = torch.rand(T, k, generator=gen).to(device)
            dest = idx // per_rank  # [T, k] the rank of each pair
            hit = torch.zeros(T, world, dtype=torch.bool, device=device).scatter_(1, dest, True)
            remote_rows = int(hit.sum()) - int(hit[:, rank].sum())
            remote_pairs_back = int((dest != rank).sum())  # = the rows other ranks' combine sends back to us
            for dt in args.dtypes:
                xb = torch.randn(T, H, generator=gen).to(device, torch.bfloat16)
                if dt == "fp8":
                    x = xb.to(torch.float8_e4m3fn)
                    scale = torch.rand(T, -(-H // 128), generator=gen).to(device)
                    row_bytes = H + 4 * scale.shape[1]
                else:
                    x, scale, row_bytes = xb, None, 2 * H
                state = {}

                def run_dispatch():
                    state["d"] = dispatch(x, idx, placement, x_scale=scale)

                run_dispatch()
                y = state["d"].x.to(torch.bfloat16) if dt == "fp8" else state["d"].x.clone()

                def run_combine():
                    combine(y, state["d"], weights)

                t_d = _slowest_median(_timed(run_dispatch, device, args.warmup, args.iters), device)
                t_c = _slowest_median(_timed(run_combine, device, args.warmup, args.iters), device)
                stats = torch.tensor([remote_rows * row_bytes, remote_pairs_back * 2 * H], dtype=torch.float64,
                                     device=device)
                dist.all_reduce(stats)
                d_bytes, c_bytes = (stats / world).cpu().tolist()  # per rank, the ranks' mean
                # the link: all_to_all_single sending the dispatch's mean bytes to the other ranks, evenly
                chunk = max(1, int(d_bytes) // (world - 1))
                send = torch.empty(chunk * world, dtype=torch.uint8, device=device)
                recv = torch.empty_like(send)
                t_l = _slowest_median(_timed(lambda: dist.all_to_all_single(recv, send), device, args.warmup,
                                             args.iters), device)
                l_bytes = chunk * (world - 1)
                shape = {"world": world, "tokens_per_rank": T, "hidden": H, "top_k": k, "num_experts": E,
                         "dtype": dt}
                link_gbps = l_bytes / t_l / 1e9
                link = {"us": round(t_l * 1e6, 1), "bytes_per_rank": l_bytes, "gbps": round(link_gbps, 3)}
                for op, t, b in (("dispatch", t_d, d_bytes), ("combine", t_c, c_bytes),
                                 ("dispatch+combine", t_d + t_c, d_bytes + c_bytes)):
                    gbps = b / t / 1e9
                    rows.append({"op": op, "shape": shape, "us": round(t * 1e6, 1), "bytes_per_rank": int(b),
                                 "gbps": round(gbps, 3), "link": link,
                                 "fraction_of_link": round(gbps / link_gbps, 3)})
                if rank == 0:
                    for r in rows[-3:]:
                        print(f"{r['op']:16s} T={T:5d} {dt:4s} {r['us']:9.1f} us {r['gbps']:8.2f} GB/s per rank "
                              f"(link {link['gbps']:.2f} GB/s, x{r['fraction_of_link']})", flush=True)
        if rank == 0:
            doc = {"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                   "device": device.type, "backend": dist.get_backend(), "torch": torch.__version__,
                   "commit": commit_id(), "rows": rows}
            Path(out_json).write_text(json.dumps(doc, indent=1) + "\n")
    finally:
        dist.destroy_process_group()


def main(argv=None) -> Path:
    import torch.multiprocessing as mp

    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / f"{args.results_name}.json"
    with tempfile.TemporaryDirectory(prefix="bench-ep-") as tmp:
        mp.start_processes(_rank, args=(args.world, os.path.join(tmp, "store"), args, str(out)),
                           nprocs=args.world, join=True, start_method="spawn")
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
