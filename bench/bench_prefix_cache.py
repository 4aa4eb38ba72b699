"""Prefix caching: TTFT and prefill tok/s with cache hits vs cold, a multi-turn replay, memory per cached token.

Usage (GPU machine, from the repository root, PYTHONPATH=python:engine):
    python bench/bench_prefix_cache.py                    # v4-flash-shapes at full depth (43 layers), temp dir
    python bench/bench_prefix_cache.py --model /tmp/v4fs  # an existing checkpoint
    python bench/bench_prefix_cache.py --tiny             # the tiny preset on the CPU (smoke test, seconds)

Scenarios, each on a fresh engine (empty cache), the model loaded once:
* shared prefix: --num-requests requests of one --prefix-len prefix and distinct --suffix-len suffixes, all queued at
  once, max_tokens 1 (the time to the first token is the whole request). ``cold``: prefix caching off. ``hit``:
  the cache warmed by the prefix alone (a system prompt sent once; its window snapshot ends at the prefix, so every
  request resumes there without a replay). ``hit_sibling``: warmed by the prefix with another suffix (no snapshot at
  the prefix: the first request replays the exact bound, layers x window, and leaves a snapshot for the others).
  Per row: TTFT mean / median (queueing included), prefill tok/s of the computed tokens, prompt tok/s (prompt tokens
  / wall time), cached tokens and the hit rate. ``us`` is the mean TTFT; the hit rows carry ``cold`` as the peer.
* multi-turn: one conversation of --turns turns; each re-sends the whole history (previous prompt, its output, then
  --turn-len new tokens) and generates --turn-output tokens. Per turn: TTFT with caching on and off, cached tokens,
  the hit rate of the re-sent tokens.
* memory: bytes per cached token per cache kind (the ``full`` group's pools: what a hit reuses) and per window
  snapshot (one per kept boundary), the cache held after the shared-prefix run per cached token, and the peak blocks
  one request holds with caching on and off.
* host tier: copy bandwidth of the host-memory tier (``--host-blocks`` blocks out to pinned host memory and back),
  to consecutive slots and to scattered ones; ``--only host_tier`` runs these rows alone.
Writes bench/results/<gpu>/bench_prefix_cache.json (``bench/timer.py`` ``write_results``) after each scenario; a run
cut short keeps its finished rows, each marked ``partial_run``.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _ids(seed: int, n: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, min(vocab, 100000)) for _ in range(n)]


def _llm(model, args, caching: bool):
    from deepinfer import LLM

    return LLM(model, device=args.device, enable_prefix_caching=caching, num_blocks=args.num_blocks,
               max_num_seqs=args.num_requests, max_num_batched_tokens=args.max_num_batched_tokens,
               max_model_len=args.max_model_len, prefix_replay_tokens=args.prefix_replay_tokens)


def _timed(llm, prompts: list[list[int]], max_tokens: int) -> tuple[list, dict]:
    from deepinfer import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    st = llm.last_stats
    prompt = sum(len(p) for p in prompts)
    cached = sum(o.num_cached_tokens for o in outs)
    ttft = [1000 * t for t in st.ttft]
    return outs, {"ttft_ms_mean": statistics.fmean(ttft), "ttft_ms_median": statistics.median(ttft),
                  "prefill_tok_s": st.prefill_tokens / st.prefill_time if st.prefill_time > 0 else 0.0,
                  "prompt_tok_s": prompt / wall, "prompt_tokens": prompt, "cached_tokens": cached,
                  "computed_prefill_tokens": st.prefill_tokens, "hit_rate": cached / prompt, "wall_s": wall}


def shared_prefix(model, args, vocab: int, save=lambda rows: None) -> tuple[list[dict], object]:
    prefix = _ids(1, args.prefix_len, vocab)
    prompts = [prefix + _ids(100 + i, args.suffix_len, vocab) for i in range(args.num_requests)]
    shape = {"requests": args.num_requests, "prefix": args.prefix_len, "suffix": args.suffix_len}
    rows, cold_us, held = [], None, None
    for name, caching, warm in (("cold", False, None), ("hit", True, prefix),
                                ("hit_sibling", True, prefix + _ids(99, args.suffix_len, vocab))):
        llm = _llm(model, args, caching)
        _timed(llm, [_ids(7, 2 * llm.config.block_size, vocab)], 2)  # warm-up (kernels, allocator); a distinct prompt
        if warm is not None:
            _timed(llm, [warm], 1)
        outs, m = _timed(llm, prompts, 1)
        row = {"op": f"shared_prefix_{name}", "shape": shape, "us": 1000 * m["ttft_ms_mean"], **m}
        if cold_us is None:
            cold_us = row["us"]
        else:
            row["peers"] = {"cold": {"us": cold_us}}
            row["ttft_vs_cold"] = row["us"] / cold_us
        rows.append(row)
        print(row, flush=True)
        save(rows)  # a run cut short keeps its finished scenarios
        if name == "hit":
            held = llm
    return rows, held


def multi_turn(model, args, vocab: int) -> list[dict]:
    runs = {}
    for caching in (False, True):
        llm = _llm(model, args, caching)
        _timed(llm, [_ids(7, 2 * llm.config.block_size, vocab)], 2)
        history: list[int] = []
        turns = []
        for t in range(args.turns):
            prompt = history + _ids(1000 + t, args.turn_len, vocab)
            outs, m = _timed(llm, [prompt], args.turn_output)
            m["resent_tokens"] = len(history)
            turns.append(m)
            history = prompt + outs[0].token_ids
        runs[caching] = turns
    rows = []
    for t, (off, on) in enumerate(zip(runs[False], runs[True])):
        rows.append({"op": "multi_turn", "shape": {"turn": t, "prompt_tokens": on["prompt_tokens"]},
                     "us": 1000 * on["ttft_ms_mean"], "peers": {"cold": {"us": 1000 * off["ttft_ms_mean"]}},
                     "ttft_ms": on["ttft_ms_mean"], "ttft_ms_cold": off["ttft_ms_mean"],
                     "cached_tokens": on["cached_tokens"], "resent_tokens": on["resent_tokens"],
                     "hit_rate_resent": on["cached_tokens"] / on["resent_tokens"] if on["resent_tokens"] else None,
                     "hit_rate_prompt": on["hit_rate"]})
        print(rows[-1], flush=True)
    resent = sum(r["resent_tokens"] for r in rows)
    total = {"op": "multi_turn_total", "shape": {"turns": args.turns, "turn_len": args.turn_len,
                                                 "turn_output": args.turn_output},
             "us": sum(r["us"] for r in rows), "peers": {"cold": {"us": sum(r["peers"]["cold"]["us"] for r in rows)}},
             "hit_rate_resent": sum(r["cached_tokens"] for r in rows) / resent if resent else None}
    return rows + [total]


def memory(model, args, held, vocab: int) -> dict:
    """Bytes per cached token by kind; the cache the shared-prefix hit run keeps; one request's peak blocks."""
    from deepinfer import SamplingParams
    from deepinfer.block_manager import FULL_GROUP, WINDOW_GROUP, blocks_for
    from deepinfer.sequence import Sequence

    spec = held.cache.spec
    B = spec.block_size
    per_block = spec.group_bytes_per_block()
    kinds = spec.report(1, 1)["groups"][FULL_GROUP]["pools_bytes_per_token"]
    bm = held.block_manager
    n_full, n_win = bm.num_cached(FULL_GROUP), bm.num_cached(WINDOW_GROUP)
    peaks = {}
    for caching in (False, True):
        llm = _llm(model, args, caching)
        eng, lbm = llm.engine, llm.block_manager
        seq = Sequence(1, _ids(3, args.prefix_len, vocab), SamplingParams(temperature=0, max_tokens=4,
                                                                          ignore_eos=True), 0)
        eng.add_request(seq)
        peak = {g.name: 0 for g in lbm.groups}
        while eng.has_unfinished_requests():
            eng.step()
            for g in lbm.groups:
                peak[g.name] = max(peak[g.name], lbm.num_referenced(g.name))
        peaks["on" if caching else "off"] = peak
    row = {"op": "memory", "shape": {"kv_cache_dtype": spec.kv_cache_dtype}, "us": 0.0,
           "full_bytes_per_cached_token": per_block[FULL_GROUP] / B, "full_pools_bytes_per_token": kinds,
           "window_snapshot_bytes": per_block[WINDOW_GROUP] * blocks_for(spec.lookback, B),
           "cached_blocks": {FULL_GROUP: n_full, WINDOW_GROUP: n_win},
           "held_bytes_per_cached_token": (n_full * per_block[FULL_GROUP] + n_win * per_block[WINDOW_GROUP])
           / max(1, n_full * B),
           "single_request_peak_blocks": peaks}
    print(row, flush=True)
    return row


def host_tier(args, held, scattered: bool = False) -> dict:
    """Copy bandwidth of the host-memory tier: ``--host-blocks`` full-group blocks copied out to host slots, then
    back into the same blocks (their content is unchanged), timed with the device synchronised around each. Slot
    ``b`` for block ``b`` (one run of consecutive slots: a fresh tier), or with ``scattered`` every other slot of a
    tier twice as large, in a random order (after LRU churn; one host copy per block and tensor)."""
    from deepinfer.block_manager import FULL_GROUP
    from deepinfer.host_cache import HostCacheTier, SwapOp

    cache = held.cache
    n = min(args.host_blocks, cache.num_blocks)
    slots = list(range(n))
    if scattered:
        slots = random.Random(0).sample(range(0, 2 * n, 2), n)
    tier = HostCacheTier({FULL_GROUP: cache.group_tensors(FULL_GROUP)}, {FULL_GROUP: 2 * n if scattered else n})
    sync = torch.cuda.synchronize if tier.cuda else (lambda: None)
    row = {"op": "host_tier_scattered" if scattered else "host_tier",
           "shape": {"blocks": n, "block_bytes": tier.block_bytes(FULL_GROUP),
                     "tensors_per_block": len(tier.host[FULL_GROUP]), "pinned": tier.cuda}}
    for kind in ("out", "in", "out", "in"):  # the first pair warms up
        ops = [SwapOp(kind, FULL_GROUP, b, s) for b, s in zip(range(n), slots)]
        sync()
        t0 = time.perf_counter()
        tier.apply(ops)
        sync()
        dt = time.perf_counter() - t0
        row[f"{kind}_GBps"] = n * tier.block_bytes(FULL_GROUP) / dt / 1e9
        row[f"{kind}_us_per_block"] = dt / n * 1e6
    row["us"] = row["in_us_per_block"]
    print(row, flush=True)
    return row


def run(args) -> list[dict]:
    from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM

    tmp = None
    if args.tiny:
        model = DeepseekV4ForCausalLM.from_checkpoint().eval()
    else:
        from deepinfer.llm import _load_checkpoint
        from deepinfer.presets import make_checkpoint

        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        args.device = str(device)
        path = args.model
        if path is None:
            tmp = path = tempfile.mkdtemp(prefix="bench-v4fs-", dir=args.work_dir)
            make_checkpoint("v4-flash-shapes", tmp, 0, num_layers=args.num_layers, num_experts=args.num_experts,
                            progress=False)
        try:
            model = _load_checkpoint(path, device, batch_invariant=False, gemm=args.gemm)
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
    vocab = model.config.vocab_size
    args.max_model_len = args.max_model_len or max(args.prefix_len + 2 * args.suffix_len,
                                                   args.turns * (args.turn_len + args.turn_output)) + 256
    from bench.timer import write_results

    def save(rows: list[dict], partial: bool = True) -> None:
        shape = {"layers": model.config.num_hidden_layers, "gemm": getattr(model, "gemm", None)}
        out = [dict(r, shape=dict(r["shape"], **shape), **({"partial_run": True} if partial else {})) for r in rows]
        write_results("bench_prefix_cache", out, args.out_dir)

    if args.only == "host_tier":  # the copy rows alone, over a small engine's cache
        args.num_blocks = args.num_blocks or 2 * args.host_blocks
        held = _llm(model, args, caching=True)
        rows = [host_tier(args, held), host_tier(args, held, scattered=True)]
        write_results("bench_prefix_cache_host_tier", [dict(r, shape=dict(
            r["shape"], layers=model.config.num_hidden_layers, gemm=getattr(model, "gemm", None))) for r in rows],
            args.out_dir)
        return rows
    rows, held = shared_prefix(model, args, vocab, save)
    rows += multi_turn(model, args, vocab)
    save(rows)
    rows.append(memory(model, args, held, vocab))
    rows.append(host_tier(args, held))
    rows.append(host_tier(args, held, scattered=True))
    save(rows, partial=False)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint folder (default: generate v4-flash-shapes)")
    p.add_argument("--tiny", action="store_true", help="the tiny preset, short prompts (CPU smoke test)")
    p.add_argument("--num-layers", type=int, default=43, help="v4-flash-shapes depth (default: V4-Flash's 43)")
    p.add_argument("--num-experts", type=int, default=16, help="routed experts of the generated checkpoint")
    p.add_argument("--work-dir", default=None)
    p.add_argument("--gemm", choices=("auto", "fp8", "dequant"), default="auto")
    p.add_argument("--device", default=None)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prefix-len", type=int, default=16384)
    p.add_argument("--suffix-len", type=int, default=512)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--turn-len", type=int, default=1024)
    p.add_argument("--turn-output", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--prefix-replay-tokens", type=int, default=None, help="default: the model's exact bound")
    p.add_argument("--host-blocks", type=int, default=64, help="blocks the host-tier bandwidth row copies")
    p.add_argument("--only", choices=("host_tier",), default=None,
                   help="host_tier: only the copy rows (bench_prefix_cache_host_tier.json)")
    p.add_argument("--out-dir", type=Path, default=None)
    args = p.parse_args(argv)
    if args.tiny:
        args.device = "cpu"
        args.num_requests, args.prefix_len, args.suffix_len = 4, 1024, 64
        args.turns, args.turn_len, args.turn_output = 3, 200, 8
        args.max_num_batched_tokens = 512
    run(args)


if __name__ == "__main__":
    main()
