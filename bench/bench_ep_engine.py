"""Engine prefill and decode tok/s per GPU with expert parallelism on and off (``LLM(data_parallel_size,
expert_parallel_size)``), one configuration after another in one run.

GPUs: python bench/bench_ep_engine.py [--model /path/v4-flash-shapes] [--configs dp8ep8,dp8ep1]
    (default configs: dpNepN,dpNep1 over the N visible GPUs; without --model a v4-flash-shapes checkpoint of
    --num-layers / --num-experts is made in a temporary folder and deleted after; the issue's run is
    `deepinfer make-checkpoint --preset v4-flash-shapes --num-layers 43 --num-experts 256`, about 165 GiB;
    dpNep1 holds every expert on every GPU, so it needs a checkpoint that fits one GPU)
CPU smoke: python bench/bench_ep_engine.py --model tiny --device cpu --configs dp2ep2 --num-requests 4 \\
    --prompt-len 16 --max-tokens 4 --out-dir /tmp/ep   (never written under bench/results/h200)

Per configuration: a warm-up generate, then prefill (every request with max_tokens=1) and decode (max_tokens=N,
ignore_eos) runs; tok/s are the ranks' sum (``EngineStats.merged``), ``*_per_gpu`` divide by the ranks. Writes
``bench_ep_engine.json`` (rows ``engine_ep``) to --out-dir (default bench/results/<gpu>).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.timer import commit_id, gpu_tag  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint folder or preset (default: a v4-flash-shapes one)")
    p.add_argument("--num-layers", type=int, default=4, help="of the generated checkpoint")
    p.add_argument("--num-experts", type=int, default=64, help="of the generated checkpoint")
    p.add_argument("--work-dir", default=None, help="where the generated checkpoint goes (default: /tmp)")
    p.add_argument("--configs", default=None, help="comma-separated dp<N>ep<M> (M = 1 or N); default: "
                   "dpNepN,dpNep1 over the visible GPUs")
    p.add_argument("--device", choices=("cuda", "cpu"), default=None)
    p.add_argument("--num-requests", type=int, default=256, help="requests in all (shared out over the ranks)")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--num-blocks", type=int, default=None, help="cache blocks per rank (default: derived)")
    p.add_argument("--num-redundant-experts", type=int, default=0)
    p.add_argument("--gemm", choices=("auto", "fp8", "dequant"), default="auto")
    p.add_argument("--out-dir", type=Path, default=None)
    args = p.parse_args(argv)
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.configs is None:
        n = torch.cuda.device_count() if args.device == "cuda" else 2
        if n < 2:  # tools/gpu_check.sh runs every bench: on one GPU there is nothing to compare
            print("bench_ep_engine: fewer than 2 GPUs visible: nothing measured (use a machine with several GPUs)")
            raise SystemExit(0)
        args.configs = f"dp{n}ep{n},dp{n}ep1"
    configs = []
    for c in args.configs.split(","):
        m = re.fullmatch(r"dp(\d+)ep(\d+)", c.strip())
        if not m:
            p.error(f"--configs: {c!r} is not dp<N>ep<M>")
        configs.append((int(m[1]), int(m[2])))
    args.configs = configs
    out = args.out_dir or RESULTS / (gpu_tag() if args.device == "cuda" else "cpu")
    if args.device == "cpu" and out.resolve().is_relative_to((RESULTS / "h200").resolve()):
        p.error("CPU figures are not H200 results: choose another --out-dir")
    args.out_dir = out
    return args


def run_config(dp: int, ep: int, args) -> dict:
    from deepinfer import LLM, SamplingParams

    kw = dict(device=args.device, max_num_seqs=max(1, -(-args.num_requests // dp)), num_blocks=args.num_blocks,
              max_num_batched_tokens=args.max_num_batched_tokens, gemm=args.gemm,
              max_model_len=args.prompt_len + args.max_tokens + 128)
    if ep > 1:
        kw.update(expert_parallel_size=ep, num_redundant_experts=args.num_redundant_experts)
    with LLM(args.model, data_parallel_size=dp, **kw) as llm:
        rng = random.Random(0)
        prompts = [[rng.randrange(3, llm.vocab_size) for _ in range(args.prompt_len)]
                   for _ in range(args.num_requests)]
        llm.generate(prompts[:2 * dp], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        pre = llm.last_stats.summary()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True))
        dec = llm.last_stats.summary()
        startup = llm.startup
    return {"op": "engine_ep",
            "shape": {"data_parallel_size": dp, "expert_parallel_size": ep, "num_requests": args.num_requests,
                      "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                      **({"model": "v4-flash-shapes", "num_layers": args.num_layers, "num_experts": args.num_experts}
                         if args.generated else {"model": args.model}),
                      "num_redundant_experts": args.num_redundant_experts if ep > 1 else 0},
            "prefill_tok_s": pre["prefill_tok_s"], "decode_tok_s": dec["decode_tok_s"],
            "prefill_tok_s_per_gpu": pre["prefill_tok_s"] / dp, "decode_tok_s_per_gpu": dec["decode_tok_s"] / dp,
            "decode_step_ms_median": dec["decode_step_ms_median"], "ttft_ms": dec["ttft_ms"],
            "tpot_ms": dec["tpot_ms"], "cache_blocks_per_rank": startup["cache_blocks"]}


def main(argv=None) -> Path:
    import shutil
    import tempfile

    args = parse_args(argv)
    tmp = None
    args.generated = args.model is None
    if args.generated:
        from deepinfer.presets import make_checkpoint

        tmp = tempfile.mkdtemp(prefix="bench-ep-v4fs-", dir=args.work_dir)
        make_checkpoint("v4-flash-shapes", tmp, 0, num_layers=args.num_layers, num_experts=args.num_experts,
                        progress=False)
        args.model = tmp
    rows = []
    try:
        for dp, ep in args.configs:
            rows.append(run_config(dp, ep, args))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    import torch

    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = args.out_dir / "bench_ep_engine.json"
    doc = {"gpu": torch.cuda.get_device_name() if args.device == "cuda" else "cpu", "device": args.device,
           "torch": torch.__version__, "commit": commit_id(), "rows": rows}
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")
    return out


if __name__ == "__main__":
    main()
