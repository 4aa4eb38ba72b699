"""Benchmark the FP8 block-scaled GEMM family against its peers, measured in the same run.

Dense ``fp8_gemm_nt`` vs cuBLASLt block-scaled ``torch._scaled_mm`` (1x128 activation / 128x128 weight scales);
grouped ``m_grouped_fp8_gemm_nt_contiguous`` / ``_masked`` vs bf16 ``torch._grouped_mm`` over the same rows; and,
at the issue's reference shapes, DeepGEMM (``deep_gemm``, the ``deepinfer-gemm`` registry package) when it imports
(it JIT-compiles one kernel per shape on first use, so only those shapes). The whole ``fused_moe_fp8`` path is
timed against itself with the torch sort-based token permutation it used before ``moe_permute``.
Shapes: V4-Flash projections and experts at M = 1, 64, 128, 512, 4096, 16384, the issue's reference shapes
(4096x7168x16384 etc.), grouped with 4 to 256 experts; plus the whole ``fused_moe_fp8`` path.

Arithmetic (comment per the conventions): flops = 2 M N K; bytes = M K (A e4m3) + N K (B e4m3) + 2 M N (D bf16)
+ 4 M ceil(K/128) + 4 ceil(N/128) ceil(K/128) (scales); grouped: sums over groups, B counted once per non-empty
group. Targets (issue 5): dense >= cuBLASLt at every shape and >= 1400 TFLOPS at 4096x7168x16384; M <= 128 at
>= 80% of the 4.24 TB/s copy ceiling; grouped contiguous >= 1200 TFLOPS at 4 x 8192 rows with N,K = 4096,7168.

Run on a GPU: python bench/bench_fp8_gemm.py [--quick] [--out-dir DIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.timer import bench_args, metrics, time_cuda, write_results  # noqa: E402

import deepinfer_ops  # noqa: E402
import deepinfer_ops.moe as moe  # noqa: E402
from deepinfer_ops.quant import scale_buffer  # noqa: E402
from deepinfer_ops.testing import refs  # noqa: E402

try:  # optional peer
    import deep_gemm  # type: ignore[import-not-found]
except Exception as e:  # noqa: BLE001 -- any import failure (missing, built for another torch) means "no peer"
    deep_gemm = None
    _DEEPGEMM_ERROR = f"deep_gemm does not import: {str(e).splitlines()[0][:120] if str(e) else type(e).__name__}"

FP8 = torch.float8_e4m3fn
DENSE_NK = {  # V4-Flash FP8 projections (N, K)
    "wq_a": (1024, 4096), "wq_b": (32768, 1024), "wkv": (512, 4096), "wo_b": (4096, 8192),
    "expert_w13": (4096, 4096), "expert_w2": (4096, 2048), "indexer_wq_b": (8192, 1024),
}
REFERENCE_MNK = [(4096, 7168, 16384), (4096, 4096, 7168), (4096, 7168, 2048), (128, 7168, 16384), (64, 7168, 16384)]
MS = [1, 64, 128, 512, 4096, 16384]


def _cdiv(a, b):
    return -(-a // b)


def _fp8(shape):
    return (torch.randn(shape, device="cuda") * 30).clamp(-448, 448).to(FP8)


def _scales(shape):
    return torch.rand(shape, device="cuda") * 0.01 + 0.001


def _dense_bytes(m, n, k):
    return m * k + n * k + 2 * m * n + 4 * m * _cdiv(k, 128) + 4 * _cdiv(n, 128) * _cdiv(k, 128)


def _peer(peers, name, fn, flops, nbytes):
    """Times ``fn`` as peer ``name``; a peer that rejects the shape is recorded as an error instead."""
    try:
        fn()
        peers[name] = metrics(time_cuda(fn), flops, nbytes)
    except Exception as e:  # noqa: BLE001 -- a peer's failure at one shape must not end the benchmark
        peers[name] = {"us": float("nan"), "error": (str(e).splitlines() or [type(e).__name__])[0][:160]}


def _split_peers(peers):
    return {"peers": {k: v for k, v in peers.items() if "error" not in v},
            "peer_errors": {k: v["error"] for k, v in peers.items() if "error" in v}}


def bench_dense(m, n, k, name):
    a, b = _fp8((m, k)), _fp8((n, k))
    sa = _scales((_cdiv(k, 128), m)).t()  # column-major [M, K/128] (cuBLASLt's layout)
    sa_ours = scale_buffer(m, _cdiv(k, 128), "cuda", column_major=True).copy_(sa)  # what the quant ops return
    sb = _scales((_cdiv(n, 128), _cdiv(k, 128)))
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    flops, nbytes = 2.0 * m * n * k, _dense_bytes(m, n, k)
    us = time_cuda(lambda: deepinfer_ops.fp8_gemm_nt(a, sa_ours, b, sb, out=out))
    peers = {}
    tiles = _cdiv(m, 128) * _cdiv(n, 128)
    split = min(_cdiv(k, 128), max(1, torch.cuda.get_device_properties(0).multi_processor_count // tiles))
    if split > 1:  # our opt-in split-K schedule, reported as a second line-item ("ours_split_k")
        split_us = time_cuda(lambda: deepinfer_ops.fp8_gemm_nt(a, sa_ours, b, sb, out=out, split_k=split))
        peers[f"ours_split_k{split}"] = metrics(split_us, flops, nbytes)
    _peer(peers, "cublaslt_scaled_mm", lambda: torch._scaled_mm(a, b.t(), sa, sb.t(), out_dtype=torch.bfloat16),
          flops, nbytes)
    _deepgemm_peer(peers, name, lambda: deep_gemm.fp8_gemm_nt((a, sa_ours), (b, sb), out), flops, nbytes)
    return {"op": "fp8_gemm_nt", "shape": {"name": name, "M": m, "N": n, "K": k}, **metrics(us, flops, nbytes),
            **_split_peers(peers)}


def _grouped_bf16_peer(peers, sizes, n, k, flops, nbytes):
    """bf16 torch._grouped_mm over the same groups (rows packed, offsets = cumulative group ends)."""
    g = len(sizes)
    a = torch.randn(sum(sizes), k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(g, n, k, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor(sizes, device="cuda", dtype=torch.int32).cumsum(0, dtype=torch.int32)
    _peer(peers, "bf16_grouped_mm", lambda: torch._grouped_mm(a, b.transpose(-2, -1), offs=offs,
                                                              out_dtype=torch.bfloat16), flops, 2 * nbytes)


def _deepgemm_peer(peers, name, fn, flops, nbytes):
    """DeepGEMM, timed at the reference shapes only (one JIT compile per shape); its absence is recorded there."""
    if name != "reference":
        return
    if deep_gemm is None:
        peers["deepgemm"] = {"us": float("nan"), "error": _DEEPGEMM_ERROR}
    else:
        _peer(peers, "deepgemm", fn, flops, nbytes)


def bench_contiguous(sizes, n, k, name):
    g = len(sizes)
    m = sum(sizes)
    m_idx = torch.repeat_interleave(torch.arange(g, device="cuda", dtype=torch.int32),
                                    torch.tensor(sizes, device="cuda"))
    a = _fp8((m, k))
    sa = _scales((_cdiv(k, 128), m)).t()
    b = _fp8((g, n, k))
    sb = _scales((g, _cdiv(n, 128), _cdiv(k, 128)))
    out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    used = sum(1 for s in sizes if s)
    flops = 2.0 * m * n * k
    nbytes = m * k + used * n * k + 2 * m * n + 4 * m * _cdiv(k, 128)
    us = time_cuda(lambda: deepinfer_ops.m_grouped_fp8_gemm_nt_contiguous(a, sa, b, sb, m_idx, out=out))
    peers = {}
    _grouped_bf16_peer(peers, sizes, n, k, flops, nbytes)
    # DeepGEMM's contiguous layout: a group index per row, each group aligned to its M block (128 rows on sm90)
    _deepgemm_peer(peers, name, lambda: deep_gemm.m_grouped_fp8_gemm_nt_contiguous((a, sa), (b, sb), out, m_idx),
                   flops, nbytes)
    return {"op": "m_grouped_fp8_gemm_nt_contiguous", "shape": {"name": name, "G": g, "rows": m, "N": n, "K": k},
            **metrics(us, flops, nbytes), **_split_peers(peers)}


def bench_masked(g, max_m, expected_m, n, k, name):
    masked = torch.full((g,), expected_m, device="cuda", dtype=torch.int32)
    a = _fp8((g, max_m, k))
    sa = _scales((g, _cdiv(k, 128), max_m)).transpose(1, 2)  # M-major per group
    b = _fp8((g, n, k))
    sb = _scales((g, _cdiv(n, 128), _cdiv(k, 128)))
    out = torch.empty(g, max_m, n, dtype=torch.bfloat16, device="cuda")
    m = g * expected_m
    flops = 2.0 * m * n * k
    nbytes = m * k + g * n * k + 2 * m * n + 4 * m * _cdiv(k, 128)
    us = time_cuda(lambda: deepinfer_ops.m_grouped_fp8_gemm_nt_masked(a, sa, b, sb, masked, out=out))
    peers = {}
    _grouped_bf16_peer(peers, [expected_m] * g, n, k, flops, nbytes)
    _deepgemm_peer(peers, name,
                   lambda: deep_gemm.m_grouped_fp8_gemm_nt_masked((a, sa), (b, sb), out, masked, expected_m),
                   flops, nbytes)
    return {"op": "m_grouped_fp8_gemm_nt_masked",
            "shape": {"name": name, "G": g, "max_m": max_m, "masked_m": expected_m, "N": n, "K": k},
            **metrics(us, flops, nbytes), **_split_peers(peers)}


def bench_moe(tokens, experts=256, top_k=6, hidden=4096, inter=2048):
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
    idx = torch.rand(tokens, experts, device="cuda").topk(top_k, dim=-1).indices
    w = torch.rand(tokens, top_k, device="cuda")
    w13, s13 = _fp8((experts, 2 * inter, hidden)), _scales((experts, 2 * inter // 128, hidden // 128))
    w2, s2 = _fp8((experts, hidden, inter)), _scales((experts, hidden // 128, inter // 128))
    rows = tokens * top_k
    used = min(experts, rows)
    flops = 2.0 * rows * (2 * inter * hidden + hidden * inter)
    nbytes = used * 3 * inter * hidden + 2 * tokens * hidden * 2
    fn = lambda: deepinfer_ops.fused_moe_fp8(x, idx, w, w13, s13, w2, s2)  # noqa: E731
    us = time_cuda(fn)
    peers = {}
    try:  # the same path with the torch sort-based permutation (what fused_moe_fp8 ran before moe_permute)
        moe.moe_permute = refs.moe_permute_ref
        _peer(peers, "torch_sort_permutation", fn, flops, nbytes)
    finally:
        moe.moe_permute = deepinfer_ops.moe_permute
    shape = {"tokens": tokens, "experts": experts, "top_k": top_k, "hidden": hidden, "inter": inter}
    return {"op": "fused_moe_fp8", "shape": shape, **metrics(us, flops, nbytes), **_split_peers(peers)}


def main() -> None:
    args = bench_args(__doc__.splitlines()[0])
    torch.manual_seed(0)
    rows = []
    if args.quick:
        rows.append(bench_dense(4096, 7168, 16384, "reference"))
        rows.append(bench_contiguous([8192] * 4, 4096, 7168, "reference"))
        rows.append(bench_masked(4, 256, 256, 4096, 7168, "reference"))
    else:
        for m, n, k in REFERENCE_MNK:
            rows.append(bench_dense(m, n, k, "reference"))
        for name, (n, k) in DENSE_NK.items():
            for m in MS:
                rows.append(bench_dense(m, n, k, name))
        rows.append(bench_contiguous([8192] * 4, 4096, 7168, "reference"))
        for g, per in [(8, 512), (32, 256), (64, 128), (256, 64), (256, 16)]:
            for name, (n, k) in (("expert_w13", (4096, 4096)), ("expert_w2", (4096, 2048))):
                rows.append(bench_contiguous([per] * g, n, k, name))
        for g, max_m, exp_m in [(1, 1024, 1024), (4, 256, 256), (8, 128, 64), (32, 64, 32), (256, 32, 6)]:
            rows.append(bench_masked(g, max_m, exp_m, 4096, 7168, "reference"))
            rows.append(bench_masked(g, max_m, exp_m, 4096, 4096, "expert_w13"))
        for t in (1, 64, 512, 4096):
            rows.append(bench_moe(t))
    write_results("bench_fp8_gemm", rows, args.out_dir)


if __name__ == "__main__":
    main()
