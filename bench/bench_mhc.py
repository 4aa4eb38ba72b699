"""Benchmark the mHC ops (hc_mix, hc_collapse, hc_post) against the torch-eager code they replace (same run).

V4 shapes: hc = 4 streams of hidden 4096 (bf16), hc_mix with M = 24 (a sublayer's pre / post / comb mixes).
Peers: hc_mix -- float32 copy of the streams, rms_norm, F.linear on the float32 mixing matrix (the model's former
path); hc_collapse -- ``(pre[..., None] * streams.float()).sum(1)``; hc_post -- ``post * x + comb^T @ streams`` as a
bf16 batched matmul (the model's former default-mode path).
Bytes: hc_mix reads the streams (2 * 4 * 4096 B per token) and writes 24 float32; hc_collapse reads the streams and
writes one row; hc_post reads the streams and x and writes 4 rows. Memory-bound: compare with the 4.24 TB/s copy.

Run on a GPU: python bench/bench_mhc.py [--quick] [--out-dir DIR]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.timer import bench_args, metrics, time_cuda, write_results  # noqa: E402

import deepinfer_ops  # noqa: E402

HC, HIDDEN, MIX = 4, 4096, 24


def main() -> None:
    args = bench_args(__doc__.splitlines()[0])
    torch.manual_seed(0)
    tokens = [64, 2048, 16384] if args.quick else [1, 64, 512, 2048, 8192, 16384]
    rows = []
    for t in tokens:
        streams = torch.randn(t, HC, HIDDEN, device="cuda", dtype=torch.bfloat16)
        fn = torch.randn(MIX, HC * HIDDEN, device="cuda") * 0.01
        x = torch.randn(t, HIDDEN, device="cuda", dtype=torch.bfloat16)
        pre, post = torch.rand(t, HC, device="cuda"), torch.rand(t, HC, device="cuda")
        comb = torch.rand(t, HC, HC, device="cuda")
        sb = t * HC * HIDDEN * 2
        shape = {"tokens": t, "hc": HC, "hidden": HIDDEN, "dtype": "bf16"}

        flat = streams.view(t, -1)
        us = time_cuda(lambda: deepinfer_ops.hc_mix(flat, fn, 1e-6))
        peer = time_cuda(lambda: F.linear(deepinfer_ops.rms_norm(flat.float(), None, 1e-6), fn))
        nbytes = sb + 4 * t * MIX
        peers = {"torch_eager": metrics(peer, bytes_moved=nbytes)}
        # the FMA kernel, which the tensor-core kernel replaces for bf16 (kept for the other dtypes)
        ref = deepinfer_ops.hc_mix(flat, fn, 1e-6)
        os.environ["DEEPINFER_HC_MIX_MMA"] = "0"
        try:
            fma = time_cuda(lambda: deepinfer_ops.hc_mix(flat, fn, 1e-6))
            diff = (deepinfer_ops.hc_mix(flat, fn, 1e-6) - ref).abs().max().item()
        finally:
            del os.environ["DEEPINFER_HC_MIX_MMA"]
        peers["ours_fma_kernel"] = {**metrics(fma, bytes_moved=nbytes), "max_abs_diff": diff}
        rows.append({"op": "hc_mix", "shape": {**shape, "M": MIX}, **metrics(us, bytes_moved=nbytes),
                     "peers": peers})

        us = time_cuda(lambda: deepinfer_ops.hc_collapse(streams, pre))
        peer = time_cuda(lambda: (pre.unsqueeze(-1) * streams.float()).sum(dim=1).to(streams.dtype))
        nbytes = sb + 2 * t * HIDDEN
        rows.append({"op": "hc_collapse", "shape": shape, **metrics(us, bytes_moved=nbytes),
                     "peers": {"torch_eager": metrics(peer, bytes_moved=nbytes)}})

        us = time_cuda(lambda: deepinfer_ops.hc_post(streams, x, post, comb))
        peer = time_cuda(lambda: post.to(streams.dtype).unsqueeze(-1) * x.unsqueeze(-2)
                         + torch.matmul(comb.to(streams.dtype).transpose(-1, -2), streams))
        nbytes = 2 * sb + 2 * t * HIDDEN
        rows.append({"op": "hc_post", "shape": shape, **metrics(us, bytes_moved=nbytes),
                     "peers": {"torch_eager": metrics(peer, bytes_moved=nbytes)}})
    write_results("bench_mhc", rows, args.out_dir)


if __name__ == "__main__":
    main()
