"""Benchmark rms_norm and per_token_group_quant_fp8 against their torch-eager equivalents (same run).

Both are memory-bound: bytes = input read + output written (+ weight / scales). rms_norm bf16 [R, H]:
4RH + 2H bytes; quant bf16 -> e4m3 [R, K] with K/128 fp32 scales per row: 3RK + 4R*ceil(K/128) bytes.
Target (issue 2): >= 70% of the 4.24 TB/s copy ceiling at [4096, 7168].

Run on a GPU: python bench/bench_norm_quant.py [--quick] [--out-dir DIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.timer import bench_args, metrics, time_cuda, write_results  # noqa: E402

import deepinfer_ops  # noqa: E402
from deepinfer_ops.testing import refs  # noqa: E402


def torch_group_quant(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch-eager peer of ``per_token_group_quant_fp8`` on x's device (``refs`` computes on the CPU for
    bit-exactness, so it is no GPU peer). Same work: amax per group, scale, e4m3 cast; K a multiple of ``group``."""
    r, k = x.shape
    xg = x.float().view(r, k // group, group)
    scale = xg.abs().amax(dim=-1).clamp(min=1e-10) / 448.0
    q = (xg * (1.0 / scale).unsqueeze(-1)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.view(r, k), scale


def main() -> None:
    args = bench_args(__doc__.splitlines()[0])
    torch.manual_seed(0)
    shapes = [(4096, 7168)] if args.quick else [(1, 7168), (128, 4096), (128, 7168), (4096, 4096), (4096, 7168), (16384, 7168)]
    rows = []
    for r, h in shapes:
        x = torch.randn(r, h, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(h, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(x)
        nbytes = 4 * r * h + 2 * h
        us = time_cuda(lambda: deepinfer_ops.rms_norm(x, w, 1e-6, out=out))
        peers = {
            "torch_eager": metrics(time_cuda(lambda: refs.rms_norm_ref(x, w, 1e-6)), bytes_moved=nbytes),
            "F.rms_norm": metrics(time_cuda(lambda: F.rms_norm(x, (h,), w, 1e-6)), bytes_moved=nbytes),
        }
        rows.append({"op": "rms_norm", "shape": {"rows": r, "hidden": h, "dtype": "bf16"},
                     **metrics(us, bytes_moved=nbytes), "peers": peers})

        groups = -(-h // 128)
        nbytes = 3 * r * h + 4 * r * groups
        us = time_cuda(lambda: deepinfer_ops.per_token_group_quant_fp8(x, 128))
        peers = {"torch_eager": metrics(time_cuda(lambda: torch_group_quant(x, 128)), bytes_moved=nbytes)}
        rows.append({"op": "per_token_group_quant_fp8", "shape": {"rows": r, "K": h, "group": 128, "dtype": "bf16"},
                     **metrics(us, bytes_moved=nbytes), "peers": peers})
    write_results("bench_norm_quant", rows, args.out_dir)


if __name__ == "__main__":
    main()
