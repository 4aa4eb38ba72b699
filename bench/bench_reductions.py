"""Benchmark the batch-invariant reductions against their torch-eager equivalents (same run).

* ``logsumexp_rows`` (the sampler's log-probability normaliser) on [rows, 129,280] float32 logits vs
  ``torch.logsumexp(dim=-1)`` (which splits a row over several blocks when rows are few, so it is not batch-invariant).
  Bytes: 4 * rows * V read (the kernel reads a row twice; the second pass mostly hits L2) + 4 * rows written.
* ``compressor_pool`` (V4 compressor window pooling) on [windows, slots, 512] bf16 kv + float32 gates vs the torch
  code it replaced (``softmax(gate, dim=1)``, weighted ``sum(dim=1)``). Bytes: 6 * windows * slots * 512 read +
  2 * windows * 512 written.
Both are memory-bound; the copy ceiling of the H200 is 4.24 TB/s.

Run on a GPU: python bench/bench_reductions.py [--quick] [--out-dir DIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.timer import bench_args, metrics, time_cuda, write_results  # noqa: E402

import deepinfer_ops  # noqa: E402

VOCAB = 129280


def torch_pool(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return (kv * gate.softmax(dim=1).to(kv.dtype)).sum(dim=1)


def main() -> None:
    args = bench_args(__doc__.splitlines()[0])
    torch.manual_seed(0)
    rows = []
    for r in ([64] if args.quick else [1, 8, 64, 256]):
        x = torch.randn(r, VOCAB, device="cuda") * 4
        nbytes = 4 * r * VOCAB + 4 * r
        us = time_cuda(lambda: deepinfer_ops.logsumexp_rows(x))
        peers = {"torch_eager": metrics(time_cuda(lambda: torch.logsumexp(x, dim=-1)), bytes_moved=nbytes)}
        rows.append({"op": "logsumexp_rows", "shape": {"rows": r, "V": VOCAB, "dtype": "fp32"},
                     **metrics(us, bytes_moved=nbytes), "peers": peers})
    # CSA: 8 slots (2 x ratio 4), HCA: 128 slots; windows = decode (64 sequences) and an 8192-token prefill step
    for n, s in ([(2048, 8)] if args.quick else [(64, 8), (2048, 8), (1, 128), (64, 128)]):
        kv = torch.randn(n, s, 512, device="cuda", dtype=torch.bfloat16)
        gate = torch.randn(n, s, 512, device="cuda") * 3
        nbytes = 6 * n * s * 512 + 2 * n * 512
        us = time_cuda(lambda: deepinfer_ops.compressor_pool(kv, gate))
        peers = {"torch_eager": metrics(time_cuda(lambda: torch_pool(kv, gate)), bytes_moved=nbytes)}
        rows.append({"op": "compressor_pool", "shape": {"windows": n, "slots": s, "head_dim": 512, "dtype": "bf16"},
                     **metrics(us, bytes_moved=nbytes), "peers": peers})
    write_results("bench_reductions", rows, args.out_dir)


if __name__ == "__main__":
    main()
