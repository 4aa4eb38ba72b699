"""Structured output: the cost of the grammar masks per decode step, JSON-schema requests against unconstrained.

Usage (from the repository root, PYTHONPATH=python:engine):
    python bench/bench_structured.py --tiny                # the tiny preset on the CPU (32 + 16 tokens; minutes)
    python bench/bench_structured.py --device cuda         # v4-flash-shapes (43 layers, 8 experts) in a temp dir
    python bench/bench_structured.py --model /tmp/v4fs     # an existing checkpoint

Method: one engine with asynchronous scheduling on (CUDA graphs as the engine configures them), the model loaded
once. Per batch size (--batches, default 1,64,256) the same B prompts of --prompt-len random tokens decode
--max-tokens tokens twice: unconstrained (greedy, ``ignore_eos``) and each request with the JSON schema ``SCHEMA``
(greedy; an array of records whose ``minItems`` no output of --max-tokens tokens can reach, so every constrained
request also decodes all --max-tokens tokens, through strings, enums, integers and booleans). The two runs are
interleaved --repeats times; each keeps its run with the lowest median step. Per row, from the engine's step stats
(``LLM.last_stats``, pure decode steps only): the median step, its host time and its time until the forward was
queued; the median host time per step that the runner spends filling the bitmask (``ModelRunner._grammar_masks``,
timed around the call); ``overhead_pct`` = constrained / unconstrained median step - 1, in percent; and
``overhead_pct_cpu``, the same from the process CPU time per step (prefill included; steadier than wall time on a
shared CPU, meaningless on a GPU).

Writes bench/results/<gpu>/bench_structured.json (``bench/timer.py`` ``write_results``): rows ``structured_decode``
with ``us`` the constrained median step in microseconds and the unconstrained one as the peer.
"""

from __future__ import annotations

import argparse
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


def schema(min_items: int) -> dict:
    """The benchmark's JSON schema: ``{"records": [...]}`` of at least ``min_items`` records."""
    record = {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 1000000},
        "name": {"type": "string", "maxLength": 32},
        "kind": {"enum": ["alpha", "beta", "gamma", "delta"]},
        "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "active": {"type": "boolean"}},
        "required": ["id", "name", "kind", "active"], "additionalProperties": False}
    return {"type": "object", "properties": {"records": {"type": "array", "items": record, "minItems": min_items}},
            "required": ["records"], "additionalProperties": False}


class MaskTimer:
    """Times ``ModelRunner._grammar_masks`` (the host fill of the step's bitmask rows and their copy up)."""

    def __init__(self, runner) -> None:
        self.runner, self.inner, self.seconds = runner, runner._grammar_masks, []

    def __enter__(self) -> "MaskTimer":
        def timed(states, vocab):
            t0 = time.perf_counter()
            out = self.inner(states, vocab)
            if out is not None:
                self.seconds.append(time.perf_counter() - t0)
            return out

        self.runner._grammar_masks = timed
        return self

    def __exit__(self, *exc) -> None:
        del self.runner._grammar_masks  # back to the class's method


def run_once(llm, prompts: list, constrained: bool, max_tokens: int) -> dict:
    from deepinfer import SamplingParams
    from deepinfer.structured import StructuredOutputsParams

    if constrained:
        p = SamplingParams(temperature=0, max_tokens=max_tokens,
                           structured_outputs=StructuredOutputsParams(json=schema(max_tokens)))
    else:
        p = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with MaskTimer(llm.runner) as timer:
        cpu0 = time.process_time()
        outs = llm.generate(prompts, p)
        cpu = time.process_time() - cpu0
    bad = [o.error for o in outs if o.error is not None]
    if bad:
        raise RuntimeError(f"bench_structured: a request failed: {bad[0]}")
    if any(len(o.token_ids) != max_tokens for o in outs):
        raise RuntimeError("bench_structured: a request ended before max_tokens (the schema must not let it)")
    st = llm.last_stats.summary()
    return {"step_ms": st["decode_step_ms_median"], "host_ms": st["decode_host_ms_median"],
            "enqueue_ms": st["decode_enqueue_ms_median"], "gpu_ms": st["decode_gpu_ms_median"],
            "decode_tok_s": st["decode_tok_s_median"], "steps": st["steps"],
            "process_cpu_ms_per_step": 1e3 * cpu / max(1, st["steps"]),
            "mask_fill_ms": 1e3 * statistics.median(timer.seconds) if timer.seconds else 0.0}


def run(llm, args, shape_extra: dict) -> list[dict]:
    rng = random.Random(0)
    batches = [int(b) for b in args.batches.split(",")]
    pool = [[rng.randrange(3, llm.vocab_size) for _ in range(args.prompt_len)] for _ in range(max(batches))]
    run_once(llm, pool[:2], False, 4)  # warm-up: both paths, and the schema compiled once
    run_once(llm, pool[:2], True, 4)
    run_once(llm, pool[:2], True, args.max_tokens)
    rows = []
    for b in batches:
        best: dict[bool, dict] = {}
        for _ in range(args.repeats):  # interleaved: slow drifts of the host hit both alike
            for constrained in (False, True):
                r = run_once(llm, pool[:b], constrained, args.max_tokens)
                if constrained not in best or r["step_ms"] < best[constrained]["step_ms"]:
                    best[constrained] = r
        on, off = best[True], best[False]
        row = {"op": "structured_decode",
               "shape": {**shape_extra, "batch": b, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                         "async_scheduling": llm.config.async_scheduling, "cuda_graphs": bool(llm.runner.graphs),
                         "torch_threads": torch.get_num_threads(),
                         "schema": "records"},
               "us": round(1e3 * on["step_ms"], 3),
               "overhead_pct": round(100 * (on["step_ms"] / off["step_ms"] - 1), 2) if off["step_ms"] else None,
               "overhead_pct_cpu": round(100 * (on["process_cpu_ms_per_step"] / off["process_cpu_ms_per_step"] - 1),
                                         2),
               **on,
               "peers": {"unconstrained": {"us": round(1e3 * off["step_ms"], 3), **off}}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="the tiny preset on the CPU, short prompts")
    p.add_argument("--model", default=None, help="checkpoint folder (default: generate v4-flash-shapes)")
    p.add_argument("--num-layers", type=int, default=43, help="v4-flash-shapes depth (default: V4-Flash's 43)")
    p.add_argument("--num-experts", type=int, default=8, help="routed experts of the generated checkpoint")
    p.add_argument("--work-dir", default=None, help="where the generated checkpoint goes (default: the temp dir)")
    p.add_argument("--gemm", choices=("auto", "fp8", "dequant"), default="auto")
    p.add_argument("--device", default=None)
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--out-dir", type=Path, default=None)
    args = p.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.repeats < 1:
        p.error(f"--repeats: expected >= 1, got {args.repeats}")
    from deepinfer import LLM

    batches = [int(b) for b in args.batches.split(",")]
    common = dict(max_num_seqs=max(batches), async_scheduling=True, enforce_eager=args.enforce_eager,
                  max_num_batched_tokens=max(8192, args.prompt_len),
                  max_model_len=args.prompt_len + args.max_tokens + 128)
    tmp = None
    if args.tiny:
        args.device = "cpu"
        args.prompt_len, args.max_tokens = min(args.prompt_len, 32), min(args.max_tokens, 16)
        common["max_model_len"] = args.prompt_len + args.max_tokens + 128
        llm = LLM("tiny", device="cpu", **common)
        shape_extra = {"checkpoint": "tiny"}
    else:
        from deepinfer.llm import _load_checkpoint
        from deepinfer.presets import make_checkpoint

        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        path, shape_extra = args.model, {"checkpoint": args.model}
        if path is None:
            tmp = path = tempfile.mkdtemp(prefix="bench-v4fs-", dir=args.work_dir)
            make_checkpoint("v4-flash-shapes", tmp, 0, num_layers=args.num_layers, num_experts=args.num_experts,
                            progress=False)
            shape_extra = {"checkpoint": "v4-flash-shapes", "num_experts": args.num_experts}
        try:
            model = _load_checkpoint(path, device, batch_invariant=False, gemm=args.gemm)
            llm = LLM(model, device=str(device), **common)  # the packaged tokenizer, as the preset's
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
        shape_extra.update({"num_layers": model.config.num_hidden_layers, "gemm": model.gemm})
    from bench.timer import write_results

    write_results("bench_structured", run(llm, args, shape_extra), args.out_dir)


if __name__ == "__main__":
    main()
