"""Engine throughput: prefill and decode tok/s of `deepinfer.LLM` (batch-invariant mode off and/or on).

Usage (GPU machine):
    deepinfer make-checkpoint --preset v4-flash-shapes --out /tmp/v4fs
    python bench/bench_engine.py --model /tmp/v4fs --modes off,on
Prefill: every request with max_tokens=1, tok/s = prompt tokens / prefill step time. Decode: the same requests with
max_tokens=N and ignore_eos, tok/s = decode tokens / decode step time (steps are split between prefill and decode in
proportion to their tokens; see `deepinfer.llm.EngineStats`). A warm-up generate runs first and is not counted.
Writes bench/results/<gpu>/bench_engine.json, and bench_batch_invariant.json when both modes run (the "on" row carries
prefill_overhead_pct / decode_overhead_pct = off tok/s / on tok/s - 1, and the "off" time as its peer).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run_mode(model, batch_invariant: bool, args) -> dict:
    from deepinfer import LLM, SamplingParams

    llm = LLM(model, batch_invariant=batch_invariant, max_num_seqs=args.num_requests,
              max_num_batched_tokens=args.max_num_batched_tokens, num_blocks=args.num_blocks,
              max_model_len=args.prompt_len + args.max_tokens + 128)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, llm.vocab_size) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    llm.generate(prompts[: min(4, len(prompts))], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    prefill = llm.last_stats.summary()
    llm.generate(prompts, SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True, seed=1))
    decode = llm.last_stats.summary()
    row = {
        "op": "engine_generate",
        "shape": {"num_requests": args.num_requests, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                  "batch_invariant": batch_invariant, "max_num_batched_tokens": args.max_num_batched_tokens},
        # "us": microseconds per decoded token over the whole batch (1e6 / decode tok/s), the timer's unit
        "us": round(1e6 / decode["decode_tok_s"], 3) if decode["decode_tok_s"] else float("nan"),
        "prefill_tok_s": prefill["prefill_tok_s"], "decode_tok_s": decode["decode_tok_s"],
        "ttft_ms": decode["ttft_ms"], "tpot_ms": decode["tpot_ms"], "wall_s": decode["wall_s"],
        "preemptions": decode["preemptions"],
    }
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="checkpoint folder (e.g. from `deepinfer make-checkpoint --preset v4-flash-shapes`)")
    p.add_argument("--modes", default="off,on", help="batch-invariant modes to run: off, on or off,on")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--out-dir", type=Path, default=None)
    args = p.parse_args()

    from deepinfer.llm import _load_checkpoint

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = _load_checkpoint(args.model, device, batch_invariant=False)
    rows = []
    for mode in args.modes.split(","):
        rows.append(run_mode(model, mode.strip() == "on", args))
        print(json.dumps(rows[-1]))
    if len(rows) == 2 and not rows[0]["shape"]["batch_invariant"] and rows[1]["shape"]["batch_invariant"]:
        off, on = rows
        on["peers"] = {"batch_invariant_off": {"us": off["us"]}}
        on["prefill_overhead_pct"] = 100 * (off["prefill_tok_s"] / on["prefill_tok_s"] - 1) if on["prefill_tok_s"] else None
        on["decode_overhead_pct"] = 100 * (off["decode_tok_s"] / on["decode_tok_s"] - 1) if on["decode_tok_s"] else None
        print(json.dumps({k: on[k] for k in ("prefill_overhead_pct", "decode_overhead_pct")}))
    from bench.timer import write_results

    write_results("bench_engine", rows, args.out_dir)
    if len(rows) == 2:
        write_results("bench_batch_invariant", rows, args.out_dir)

if __name__ == "__main__":
    main()
