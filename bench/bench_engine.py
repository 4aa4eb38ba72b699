"""Engine throughput: prefill and decode tok/s of `deepinfer.LLM`, batch-invariant mode off and on, in one run.

Usage (GPU machine, from the repository root, PYTHONPATH=python:engine):
    python bench/bench_engine.py                    # makes a v4-flash-shapes checkpoint in a temp dir, deletes it after
    python bench/bench_engine.py --model /tmp/v4fs  # an existing one (`deepinfer make-checkpoint --preset ...`)
    python bench/bench_engine.py --num-experts 256  # the full preset (~20 GB on disk, ~66 GB of bf16 weights)
    python bench/bench_engine.py --preset v41-flash-shapes --num-experts 8  # DeepSeek-V4.1 rows (merged in)
Without --model the checkpoint is `v4-flash-shapes` (V4-Flash hidden 4096, 64 heads x 512, q_lora 1024, o 8 x 1024,
experts of 2048, indexer 64 x 128 top-512, hc 4, vocab 129,280) at --num-layers (default 4: sliding, sliding, CSA,
HCA) and --num-experts routed experts (default 64 instead of 256, to keep the checkpoint near 7 GB and its
generation / loading to about a minute; per-expert shapes are unchanged, top-6 routing).

GEMM path: --gemm (default auto = fp8 on CUDA: FP8 weights, FP8 GEMMs, fused FP8 MoE; dequant = bf16 weights and
torch GEMMs); recorded as shape.gemm.

Method: the model is loaded once and shared by both modes (the mode travels in each ForwardBatch); the modes run
--repeats times, interleaved (off, on, off, on), and each mode reports its best prefill and decode throughput (every
run is kept under "runs"). Per run: a warm-up
generate (not counted), then prefill -- every request with max_tokens=1, tok/s = prompt tokens / prefill step time --
then decode -- the same requests with max_tokens=N and ignore_eos, tok/s = decode tokens / decode step time (step
times are split between prefill and decode in proportion to their tokens, see `deepinfer.stats.EngineStats`; every step
ends with a device synchronisation). Then request 0 runs alone for a few tokens and its logprobs are compared bitwise
with its logprobs in the batched decode run (`alone_equals_batched`: expected true with the mode on; with the mode off
it records whether cuBLAS's choice by batch size changed anything).
Each run also reports the median throughput of its pure prefill and pure decode steps (``*_tok_s_median``), and of
its pure decode steps the median step time and the median host time until the forward was queued
(``decode_step_ms_median`` / ``decode_enqueue_ms_median``: close together = host-bound).
Writes bench/results/<gpu>/bench_engine.json (one row per mode: prefill_tok_s, decode_tok_s, us = 1e6 / decode tok/s,
the medians) and, when both modes ran, bench_batch_invariant.json (rows engine_prefill / engine_decode, us per token
with the mode on, the mode-off time as the peer, overhead_pct = off tok/s / on tok/s - 1 in percent from the median
steps, overhead_pct_mean from the whole-run means).
"""

from __future__ import annotations

import argparse
import gc
import json
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

ALONE_TOKENS = 8  # decode steps of the lone-request comparison


def run_mode(model, batch_invariant: bool, args, shape_extra: dict, profile: bool = False) -> dict:
    from deepinfer import LLM, SamplingParams

    llm = LLM(model, batch_invariant=batch_invariant, max_num_seqs=args.num_requests, device=args.device,
              max_num_batched_tokens=args.max_num_batched_tokens, num_blocks=args.num_blocks,
              max_model_len=args.prompt_len + args.max_tokens + 128)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, llm.vocab_size) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    llm.generate(prompts[: min(4, len(prompts))], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    prefill = llm.last_stats.summary()
    dec_params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True, seed=1)
    outs = llm.generate(prompts, dec_params)
    decode = llm.last_stats.summary()
    alone_params = SamplingParams(temperature=args.temperature, max_tokens=min(ALONE_TOKENS, args.max_tokens),
                                  ignore_eos=True, seed=1)
    alone = llm.generate(prompts[:1], alone_params)[0]
    n = len(alone.logprobs)
    if profile:
        profile_mode(llm, prompts, batch_invariant, args)
    row = {
        "op": "engine_generate",
        "shape": {"num_requests": args.num_requests, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                  "batch_invariant": batch_invariant, "max_num_batched_tokens": args.max_num_batched_tokens,
                  **shape_extra},
        # "us": microseconds per decoded token over the whole batch (1e6 / decode tok/s), the timer's unit
        "us": round(1e6 / decode["decode_tok_s"], 3) if decode["decode_tok_s"] else float("nan"),
        "prefill_tok_s": prefill["prefill_tok_s"], "decode_tok_s": decode["decode_tok_s"],
        "prefill_tok_s_median": prefill["prefill_tok_s_median"], "decode_tok_s_median": decode["decode_tok_s_median"],
        "decode_step_ms_median": decode["decode_step_ms_median"],
        "decode_enqueue_ms_median": decode["decode_enqueue_ms_median"],
        "prefill_time_s": prefill["prompt_tokens"] / prefill["prefill_tok_s"] if prefill["prefill_tok_s"] else None,
        "ttft_ms": decode["ttft_ms"], "tpot_ms": decode["tpot_ms"], "wall_s": decode["wall_s"],
        "preemptions": decode["preemptions"],
        "alone_equals_batched": alone.token_ids == outs[0].token_ids[:n] and alone.logprobs == outs[0].logprobs[:n],
        "alone_max_abs_logprob_diff": max((abs(a - b) for a, b in zip(alone.logprobs, outs[0].logprobs)), default=0.0),
    }
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def profile_mode(llm, prompts, batch_invariant: bool, args, tag: str = "") -> None:
    """torch.profiler over one prefill step of ``max_num_batched_tokens`` tokens, then over the whole batch with 16
    output tokens (its prefill steps, then 16 decode steps at the full context); per phase the op tables sorted by
    CUDA time and by CPU time go to ``<out-dir>/profile_engine.txt`` (appended per mode)."""
    from torch.profiler import ProfilerActivity, profile

    from deepinfer import SamplingParams

    n_pre = max(1, args.max_num_batched_tokens // args.prompt_len)
    out = (args.out_dir or ROOT / "bench" / "results") / "profile_engine.txt"
    out.parent.mkdir(parents=True, exist_ok=True)
    for phase, ps, sp in (("prefill", prompts[:n_pre], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)),
                          ("prefill+decode", prompts, SamplingParams(temperature=0, max_tokens=17, ignore_eos=True))):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate(ps, sp)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        stats = llm.last_stats.summary()
        avg = prof.key_averages()
        with open(out, "a") as f:
            f.write(f"\n==== {tag} batch_invariant={batch_invariant} {phase}: {len(ps)} requests x {len(ps[0])} tokens, "
                    f"max_tokens={sp.max_tokens}; {json.dumps(stats)}\n")
            for key in ("cuda_time_total", "self_cpu_time_total"):
                f.write(f"-- sorted by {key}\n{avg.table(sort_by=key, row_limit=30, max_name_column_width=90)}\n")
    print(f"profile -> {out}", flush=True)


def model_bytes(model) -> tuple[int, int]:
    """(bytes of the non-routed-expert weights, bytes of the routed experts) the model holds."""
    expert = dense = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        n = t.numel() * t.element_size()
        if ".ffn.w13" in name or ".ffn.w2" in name or ".ffn.experts." in name:
            expert += n
        else:
            dense += n
    return dense, expert


def decode_roofline_ms(model, batch: int, context: int) -> float:
    """Lower bound of one decode step: the weights it must read (dense ones, and the routed experts its
    ``batch * top_k`` choices can touch) plus the KV it attends to (window + top-k entries per CSA layer, every
    entry per HCA layer, at ``context`` tokens), over the 4.24 TB/s copy ceiling."""
    cfg = model.config
    dense, expert = model_bytes(model)
    touched = min(1.0, batch * cfg.num_experts_per_tok / cfg.n_routed_experts)
    kv = 0
    for r in cfg.compress_ratios:
        n = min(context, cfg.sliding_window)
        if r == cfg.compress_rate_csa:
            n += min(cfg.index_topk, context // r)
        elif r:
            n += context // r
        kv += n * cfg.head_dim * 2
    return 1e3 * (dense + touched * expert + batch * kv) / 4.24e12


def prefill_roofline_ms(model, tokens: int) -> float:
    """Lower bound of one prefill step: 2 FLOPs per active weight and token (dense weights and ``top_k`` of the
    routed experts) over the measured block-scaled FP8 peak, 1305 TFLOPS."""
    cfg = model.config
    dense, expert = model_bytes(model)
    active = dense + expert * cfg.num_experts_per_tok / cfg.n_routed_experts
    return 1e3 * 2 * active * tokens / 1305e12  # FP8 weights: one byte per weight


def sweep(model, args, shape_extra: dict) -> list[dict]:
    """The engine-core rows: decode at each --decode-batches size and prefill steps of each --prefill-tokens size,
    for CUDA graphs and asynchronous scheduling on and off (--core-modes)."""
    from deepinfer import LLM, SamplingParams

    batches = [int(b) for b in args.decode_batches.split(",")]
    prefills = [int(t) for t in args.prefill_tokens.split(",")]
    rows = []
    for mode in args.core_modes.split(","):
        graphs, async_ = {"graphs+async": (True, True), "graphs": (True, False), "async": (False, True),
                          "eager": (False, False)}[mode]
        llm = LLM(model, max_num_seqs=max(batches), device=args.device, enforce_eager=not graphs,
                  async_scheduling=async_, max_num_batched_tokens=max(prefills + [args.max_num_batched_tokens]),
                  max_model_len=args.prompt_len + args.max_tokens + 128)
        print(json.dumps({"mode": mode, "startup": llm.startup}), flush=True)
        rng = random.Random(0)
        pool = [[rng.randrange(3, llm.vocab_size) for _ in range(args.prompt_len)] for _ in range(max(batches))]
        llm.generate(pool[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
        if args.profile:
            profile_mode(llm, pool[:min(64, len(pool))], False, args, tag=mode)
        common = {**shape_extra, "prompt_len": args.prompt_len, "cuda_graphs": graphs, "async_scheduling": async_,
                  "graph_capture_s": llm.startup["graph_capture_s"],
                  "graph_memory_gib": round(llm.startup["graph_memory_bytes"] / 2**30, 3)}
        for b in batches:
            llm.generate(pool[:b], SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True))
            st = llm.last_stats.summary()
            step = st["decode_step_ms_median"]
            roof = decode_roofline_ms(model, b, args.prompt_len + args.max_tokens // 2)
            rows.append({"op": "engine_decode", "shape": {**common, "batch": b, "max_tokens": args.max_tokens},
                         "us": round(1e3 * step, 3), "decode_tok_s": st["decode_tok_s_median"],
                         "tpot_ms": st["tpot_ms"], "step_ms": step, "host_ms": st["decode_host_ms_median"],
                         "enqueue_ms": st["decode_enqueue_ms_median"], "gpu_ms": st["decode_gpu_ms_median"],
                         "roofline_ms": round(roof, 4), "roofline_ratio": round(roof / step, 4) if step else None})
            print(json.dumps(rows[-1]), flush=True)
        if args.profile and llm.runner.graphs:
            profile_replays(llm, max(b for b in llm.runner.graphs if b <= max(batches)), args, mode)
        for t in prefills:
            n = max(1, t // args.prompt_len)
            ps = [[rng.randrange(3, llm.vocab_size) for _ in range(args.prompt_len)] for _ in range(n)]
            llm.generate(ps, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
            st = llm.last_stats.summary()
            step = st["prefill_step_ms_median"]
            roof = prefill_roofline_ms(model, n * args.prompt_len)
            rows.append({"op": "engine_prefill", "shape": {**common, "step_tokens": n * args.prompt_len},
                         "us": round(1e3 * step, 3), "prefill_tok_s": st["prefill_tok_s_median"], "step_ms": step,
                         "gpu_ms": st["prefill_gpu_ms_median"], "roofline_ms": round(roof, 4),
                         "roofline_ratio": round(roof / step, 4) if step else None})
            print(json.dumps(rows[-1]), flush=True)
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return rows


def profile_replays(llm, bucket: int, args, tag: str) -> None:
    """Kernel table of 10 replays of the captured decode graph of ``bucket`` sequences (its plan as the last decode
    step left it), appended to ``<out-dir>/profile_engine.txt``."""
    from torch.profiler import ProfilerActivity, profile

    g = llm.runner.graphs[bucket]
    torch.cuda.synchronize()
    launch = []
    for _ in range(10):  # the host cost of one replay call (the launch of every node), the GPU idle before it
        t0 = time.perf_counter()
        g.graph.replay()
        launch.append(1e3 * (time.perf_counter() - t0))
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            g.graph.replay()
        torch.cuda.synchronize()
    avg = prof.key_averages()
    kernels = sum(e.count for e in avg if e.device_type == torch.autograd.DeviceType.CUDA)
    out = (args.out_dir or ROOT / "bench" / "results") / "profile_engine.txt"
    with open(out, "a") as f:
        f.write(f"\n==== {tag}: 10 replays of the decode graph of {bucket} sequences; {kernels / 10:.0f} kernels "
                f"per replay; host ms per replay call: {statistics.median(launch):.3f}\n{avg.table(sort_by='cuda_time_total', row_limit=40, max_name_column_width=90)}\n")


def best_of(runs: list[dict]) -> dict:
    """One row from repeated runs of a mode: the highest prefill and decode tok/s (the engine is host-bound, so a
    run's throughput also carries the host's jitter; the best run is the least disturbed one), every run's numbers
    kept under ``runs``; ``alone_equals_batched`` only if it held in every run."""
    row = dict(max(runs, key=lambda r: r["decode_tok_s"]))
    for key in ("prefill_tok_s", "prefill_tok_s_median", "decode_tok_s_median"):
        row[key] = max(r[key] for r in runs)
    row["us"] = round(1e6 / row["decode_tok_s"], 3) if row["decode_tok_s"] else float("nan")
    row["alone_equals_batched"] = all(r["alone_equals_batched"] for r in runs)
    row["runs"] = [{k: r[k] for k in ("prefill_tok_s", "decode_tok_s", "prefill_tok_s_median", "decode_tok_s_median",
                                      "decode_step_ms_median", "decode_enqueue_ms_median", "tpot_ms", "wall_s")}
                   for r in runs]
    return row


def overhead_rows(off: dict, on: dict) -> list[dict]:
    """bench_batch_invariant.json rows: per phase, us per token with the mode on and the mode off as its peer, from the
    median step throughput (``*_tok_s_median``: pure prefill / pure decode steps; the host's jitter moves the
    whole-run means by up to +-20% between identical runs on the GPU machine), with the whole-run means alongside
    (``tok_s_mean``, ``overhead_pct_mean``)."""
    def overhead(t_on: float, t_off: float) -> float | None:
        # a rate of 0 means "not measured" (no pure step of that phase, or no time): no overhead, not -100%
        return round(100 * (t_off / t_on - 1), 2) if t_on and t_off else None

    rows = []
    for phase in ("prefill", "decode"):
        t_on, t_off = on[f"{phase}_tok_s_median"], off[f"{phase}_tok_s_median"]
        m_on, m_off = on[f"{phase}_tok_s"], off[f"{phase}_tok_s"]
        rows.append({
            "op": f"engine_{phase}",
            "shape": {k: v for k, v in on["shape"].items() if k != "batch_invariant"},
            "us": round(1e6 / t_on, 3) if t_on else float("nan"),
            "tok_s": t_on,
            "tok_s_mean": m_on,
            "peers": {"batch_invariant_off": {"us": round(1e6 / t_off, 3) if t_off else float("nan"), "tok_s": t_off,
                                              "tok_s_mean": m_off}},
            "overhead_pct": overhead(t_on, t_off),
            "overhead_pct_mean": overhead(m_on, m_off),
            "alone_equals_batched": on["alone_equals_batched"],
            "alone_equals_batched_mode_off": off["alone_equals_batched"],
        })
    return rows


def kept_rows(out_dir: Path | None, bench_name: str, checkpoint: str) -> list[dict]:
    """The rows of ``<bench_name>.json`` measured on another checkpoint (another preset's rows stay when one preset
    is re-run), each with its own commit recorded. An unreadable file keeps nothing (with a warning): the new rows
    are written all the same."""
    from bench.timer import gpu_tag

    path = (out_dir or ROOT / "bench" / "results" / gpu_tag()) / f"{bench_name}.json"
    if not path.is_file():
        return []
    try:
        doc = json.loads(path.read_text())
        rows = doc["rows"]
        kept = [{**r, "commit": r.get("commit", doc.get("commit"))} for r in rows
                if r.get("shape", {}).get("checkpoint") != checkpoint]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        print(f"warning: {path} is not a results file ({type(e).__name__}: {e}); its rows are not kept", flush=True)
        return []
    return kept


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None,
                   help="checkpoint folder; default: make a --preset checkpoint in a temp dir (deleted after)")
    p.add_argument("--preset", choices=("v4-flash-shapes", "v41-flash-shapes"), default="v4-flash-shapes",
                   help="the generated checkpoint's preset; bench_engine.json keeps the rows of other checkpoints")
    p.add_argument("--num-layers", type=int, default=None,
                   help="depth of the generated checkpoint (default: the preset's 4)")
    p.add_argument("--num-experts", type=int, default=64,
                   help="routed experts of the generated checkpoint (the preset has 256)")
    p.add_argument("--work-dir", default=None,
                   help="where the generated checkpoint goes (default: the system temp dir)")
    p.add_argument("--keep-checkpoint", action="store_true", help="do not delete the generated checkpoint")
    p.add_argument("--modes", default="off,on", help="batch-invariant modes to run: off, on or off,on")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--gemm", choices=("auto", "fp8", "dequant"), default="auto",
                   help="GEMM path of the loaded model (default auto: fp8 on CUDA)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 2 layers, 16 experts, 8 requests of 256 + 16 tokens")
    p.add_argument("--repeats", type=int, default=2,
                   help="runs per mode, modes interleaved; the best prefill / decode throughput of each is reported")
    p.add_argument("--profile", action="store_true",
                   help="also profile one prefill step and a 16-token generate of the whole batch per mode "
                        "(profile_engine.txt in --out-dir)")
    p.add_argument("--out-dir", type=Path, default=None)
    p.add_argument("--sweep", action="store_true",
                   help="engine-core rows instead (bench_engine_core.json): decode batches x prefill step sizes x "
                        "--core-modes")
    p.add_argument("--decode-batches", default="1,8,64,256")
    p.add_argument("--prefill-tokens", default="4096,16384")
    p.add_argument("--core-modes", default="graphs+async,eager",
                   help="comma list of graphs+async, graphs, async, eager")
    p.add_argument("--results-name", default="bench_engine_core")
    args = p.parse_args()
    v41_preset = args.model is None and args.preset == "v41-flash-shapes"
    if v41_preset and args.num_layers is not None:
        p.error("--num-layers: the v41-flash-shapes preset has a fixed depth (one layer of each V4.1 block type)")
    if args.quick:
        args.num_layers, args.num_experts = (None if v41_preset else args.num_layers or 2), min(args.num_experts, 16)
        args.num_requests, args.prompt_len, args.max_tokens = 8, 256, 16
    if args.repeats < 1:
        p.error(f"--repeats: expected >= 1, got {args.repeats}")
    modes = [m.strip() for m in args.modes.split(",")]
    if not modes or any(m not in ("off", "on") for m in modes):
        p.error(f"--modes: expected off, on or off,on, got {args.modes!r}")

    from deepinfer.presets import make_checkpoint
    from deepinfer.llm import _load_checkpoint

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.device = str(device)
    tmp = None
    model_path = args.model
    shape_extra: dict = {"checkpoint": model_path}
    try:
        if model_path is None:
            tmp = tempfile.mkdtemp(prefix="bench-fs-", dir=args.work_dir)
            t0 = time.perf_counter()
            make_checkpoint(args.preset, tmp, 0, num_layers=args.num_layers, num_experts=args.num_experts,
                            progress=False)
            print(f"made {args.preset} (layers={args.num_layers or 'preset'}, experts={args.num_experts}) in "
                  f"{time.perf_counter() - t0:.0f} s", flush=True)
            model_path = tmp
            shape_extra = {"checkpoint": args.preset, "num_experts": args.num_experts}
        t0 = time.perf_counter()
        model = _load_checkpoint(model_path, device, batch_invariant=False, gemm=args.gemm)
        cfg = model.config
        shape_extra.update({"num_layers": cfg.num_hidden_layers, "n_routed_experts": cfg.n_routed_experts,
                            "hidden_size": cfg.hidden_size, "gemm": model.gemm})
        print(f"loaded in {time.perf_counter() - t0:.0f} s", flush=True)
    finally:
        if tmp is not None and not args.keep_checkpoint:
            shutil.rmtree(tmp, ignore_errors=True)
    if args.sweep:
        from bench.timer import write_results

        write_results(args.results_name, sweep(model, args, shape_extra), args.out_dir)
        return
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for rep in range(args.repeats):  # modes interleaved: slow drifts of the host hit both alike
        for mode in modes:
            runs[mode].append(run_mode(model, mode == "on", args, shape_extra, profile=args.profile and rep == 0))
            print(json.dumps(runs[mode][-1]), flush=True)
    rows = [best_of(runs[m]) for m in modes]
    from bench.timer import write_results

    write_results("bench_engine", rows + kept_rows(args.out_dir, "bench_engine", shape_extra["checkpoint"]),
                  args.out_dir)
    if [r["shape"]["batch_invariant"] for r in rows] == [False, True]:
        bi_rows = overhead_rows(rows[0], rows[1])
        for r in bi_rows:
            print(f"{r['op']}: batch-invariant overhead {r['overhead_pct']}% by median step "
                  f"(on {r['tok_s']:.1f} tok/s, off {r['peers']['batch_invariant_off']['tok_s']:.1f} tok/s), "
                  f"{r['overhead_pct_mean']}% by whole-run mean")
        write_results("bench_batch_invariant",
                      bi_rows + kept_rows(args.out_dir, "bench_batch_invariant", shape_extra["checkpoint"]),
                      args.out_dir)


if __name__ == "__main__":
    main()
