"""Speculative decoding: decode throughput and acceptance with MTP drafts, spec off / fixed k / confidence-scheduled.

Usage (from the repository root, PYTHONPATH=python:engine):
    python bench/bench_spec.py --model /path/to/checkpoint --prompts held_out.txt   # a trained model
    python bench/bench_spec.py --model v4-flash-shapes                            # cost only (random weights)
    python bench/bench_spec.py --model tiny --batches 1,4 --ks 1,3 --max-tokens 16  # CPU smoke run

Per batch size (--batches, default 1,8,64,256) and mode (``off``; ``fixed-k`` for each k of --ks, default 1..5;
``scheduled``: spec_schedule="confidence" with k = the largest of --ks; off and scheduled run --repeats times,
alternating, and keep their fastest run, ``decode_tok_s_runs`` holding all): one warm-up generate, then requests
that decode --max-tokens tokens each (greedy unless --temperature; ignore_eos): at batch 1, --batch1-requests of them
one after another, spread evenly over the prompts (one prompt's acceptance is noise, and the held-out prompts
begin with every file opening); past it, --waves x batch of them, at most batch at a time. A single wave would
measure how a static batch drains: speculating requests finish unevenly and the slowest one sets
the time, while spec off finishes them together. Prompts: lines of --prompts (tokenized with the model's tokenizer,
cycled), else random token ids of --prompt-len.

Each row: decode tok/s (emitted tokens / decode step time, ``deepinfer.stats.EngineStats``), the same from the first
to the last step at full batch (``decode_tok_s_at_peak``: the steady state, without the last wave's drain, where
speculating requests finish one by one while spec off's finish together), its median over pure decode steps, TPOT,
and with speculation the acceptance length (mean tokens per verification = 1 + accepted drafts), the acceptance rate
per draft position (accepted / verified at that position), the verification overhead (median decode step time over
the spec-off median at the same batch size, minus 1, in percent) and the speedups over spec off (``speedup``,
``speedup_at_peak``); greedy rows also record whether the tokens equal spec off's (``greedy_identical``); with
--phases, the spec rows also hold ``phase_ms_per_step`` (each phase synchronised: a diagnosis of where a step's time
goes). Every row also holds the median host and GPU ms of a pure decode step (the GPU figure: CUDA events
around the forward), its decode seconds (``decode_s``, what ``decode_tok_s`` divides by), the garbage
collections inside its run (``gc``), its slow decode steps (:func:`step_tail`) and its time by step kind
(``time_by_kind``: graph or eager, speculative or plain, with prompt tokens or not, below the run's largest batch
or not). Writes bench/results/<device>/bench_spec.json (--out to override).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def make_prompts(llm, args) -> list[list[int]]:
    """``args.batch_max`` prompts: the lines of ``args.prompts`` (cut to ``args.prompt_len`` tokens, cycled), else
    random ids. A ``.jsonl`` file holds one object per line with ``prompt_token_ids`` (the training script's
    ``heldout_prompts.jsonl``); any other file, one text prompt per line."""
    n = args.batch_max
    if args.prompts:
        lines = [ln for ln in Path(args.prompts).read_text().splitlines() if ln.strip()]
        if not lines:
            raise ValueError(f"--prompts: {args.prompts} has no non-empty line")
        if str(args.prompts).endswith(".jsonl"):
            ids = []
            for i, ln in enumerate(lines, 1):
                try:
                    obj = json.loads(ln)
                except ValueError:
                    obj = None
                toks = obj.get("prompt_token_ids") if isinstance(obj, dict) else None
                if not (isinstance(toks, list) and toks and all(isinstance(t, int) and not isinstance(t, bool)
                                                                and 0 <= t < llm.vocab_size for t in toks)):
                    raise ValueError(f"--prompts: line {i} of {args.prompts} has no prompt_token_ids list of token "
                                     f"ids in [0, {llm.vocab_size})")
                ids.append(toks[:args.prompt_len])
        else:
            ids = [llm.encode(ln)[:args.prompt_len] or [1] for ln in lines]
        args.distinct_prompts = len(ids)
        return [ids[i % len(ids)] for i in range(n)]
    args.distinct_prompts = n
    rng = random.Random(0)
    return [[rng.randrange(3, llm.vocab_size) for _ in range(args.prompt_len)] for _ in range(n)]


def run(model, batch: int, mode: str, k: int, args, prompts: list[list[int]]) -> tuple[dict, list[list[int]]]:
    """One (batch size, mode) row and the generated token ids."""
    from deepinfer import LLM, SamplingParams

    spec = {} if mode == "off" else {"speculative_method": "mtp", "num_speculative_tokens": k,
                                     "spec_schedule": "confidence" if mode == "scheduled" else "fixed"}
    if spec and args.spec_admit_hold is not None:
        spec["spec_admit_hold"] = args.spec_admit_hold
    llm = LLM(model, max_num_seqs=batch, device=args.device, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=args.prompt_len + args.max_tokens + 128, **spec)
    sp = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True, seed=1)
    llm.generate(prompts[:min(batch, 4)], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    stats0 = _spec_counters(llm)
    n_req = batch * args.waves if batch > 1 else args.batch1_requests
    todo = prompts[:n_req]
    if batch == 1:  # spread over the prompt set, as the larger batches cover it (its head is all file openings)
        m = min(args.distinct_prompts, len(prompts))
        todo = [prompts[i * m // n_req] for i in range(n_req)]
    with phase_timer(args.phases and bool(spec)) as phases, timeline(args.timeline and bool(spec)) as trace, \
            gc_timer() as gcs, step_kinds(llm.runner) as kinds:
        outs = llm.generate(todo, sp)
    s = llm.last_stats.summary()
    row = {"op": "spec_decode", "mode": mode, "shape": {"batch": batch, "prompt_len": args.prompt_len,
                                                        "max_tokens": args.max_tokens, "k": k if spec else 0,
                                                        "requests": n_req, "waves": args.waves if batch > 1 else 1,
                                                        "spec_admit_hold": llm.config.spec_admit_hold if spec else None,
                                                        "temperature": args.temperature},
           "decode_tok_s": s["decode_tok_s"], "decode_tok_s_at_peak": s["decode_tok_s_at_peak"],
           "peak_steps": s["peak_steps"], "decode_tok_s_median": s["decode_tok_s_median"],
           "decode_step_ms_median": s["decode_step_ms_median"], "tpot_ms": s["tpot_ms"],
           "decode_host_ms_median": s["decode_host_ms_median"], "decode_gpu_ms_median": s["decode_gpu_ms_median"],
           "us": round(1e6 / s["decode_tok_s"], 3) if s["decode_tok_s"] else float("nan"),
           "decode_s": round(llm.last_stats.decode_time, 4), "gc": gcs, **step_tail(llm.last_stats.steps),
           "time_by_kind": time_by_kind(llm.last_stats.steps, llm.last_stats.step_seqs, kinds)}
    if spec:
        st = _spec_counters(llm)
        ver = st["verifications"] - stats0["verifications"]
        acc = st["accepted"] - stats0["accepted"]
        at = [a - b for a, b in zip(st["accepted_at"], stats0["accepted_at"])]
        vat = [a - b for a, b in zip(st["verified_at"], stats0["verified_at"])]
        row.update({"verifications": ver, "acceptance_length": 1 + acc / ver if ver else 1.0,
                    "acceptance_per_position": [a / v if v else None for a, v in zip(at, vat)],
                    "drafts_verified_per_step": (st["drafted"] - stats0["drafted"]) / ver if ver else 0.0,
                    "plain_steps": st["plain_steps"] - stats0["plain_steps"],
                    "graph_steps": st["graph_steps"] - stats0["graph_steps"]})
        if phases is not None:
            row["phase_ms_per_step"] = phases.per_step()
        if trace is not None:
            row["timeline"] = trace
        spec_dec = llm.runner.spec
        # per bucket, ms: the first five and the last five samples of step time past the replays (start to next
        # start; the schedule's estimate reads the last five, and an engine's first steps carry one-time costs)
        first = spec_dec.stats.first_overheads
        row["host_overhead_ms"] = {str(b): {"first": [round(1e3 * x, 3) for x in first.get(b, [])],
                                            "last": [round(1e3 * x, 3) for x in v]}
                                   for b, v in spec_dec.overhead_samples.items()}
        sec = spec_dec.graph_step_seconds(batch, k)
        row["graph_step_ms"] = None if sec is None else 1e3 * sec  # replays at k drafts + measured host time
        # the schedule's step cost at the end of the run, verifying 0..k drafts (its choice weighs these)
        row["cost_model_ms"] = None if sec is None else [
            round(1e3 * spec_dec.graph_step_seconds(batch, d), 3) for d in range(k + 1)]
    return row, [o.token_ids for o in outs]


def step_tail(steps) -> dict:
    """Where a run's pure decode steps go past the typical one: ``slow_steps`` (those over 1.5x the median) and
    ``slow_extra_s`` (their time past the median)."""
    pure = sorted(dt for d, p, dt, *_ in steps if d and not p)
    med = pure[len(pure) // 2] if pure else 0.0
    slow = [dt - med for dt in pure if dt > 1.5 * med]
    return {"slow_steps": len(slow), "slow_extra_s": round(sum(slow), 4)}


@contextlib.contextmanager
def step_kinds(runner):
    """A list filled while the block runs: per step the runner enqueued, in order, ``"spec-graph"``,
    ``"spec-eager"``, ``"plain-graph"`` or ``"plain-eager"`` (the engine applies steps in that order: entry ``i``
    is the ``i``-th step of the run's stats)."""
    out: list[str] = []
    real = runner.execute

    def execute(output, *a, **kw):
        res = real(output, *a, **kw)
        out.append(("spec-" if getattr(output, "speculative", False) and runner.spec is not None else "plain-")
                    + ("graph" if getattr(res, "graph", False) else "eager"))
        return res

    runner.execute = execute
    try:
        yield out
    finally:
        del runner.execute  # the class's method again


def time_by_kind(steps, step_seqs, kinds: list[str]) -> dict | None:
    """Where a run's time went by step kind (:func:`step_kinds`), each split by whether the step ran prompt tokens
    (``+prefill``) and whether it ran fewer sequences than the run's largest batch (``<peak``): per key, steps,
    seconds, the decode share of them and decode tokens. None when the kinds do not line up with the steps."""
    if len(kinds) != len(steps) or len(step_seqs) != len(steps):
        return None
    peak = max(step_seqs, default=0)
    out: dict[str, dict] = {}
    for kind, (d, p, dt, *_), n in zip(kinds, steps, step_seqs):
        key = kind + ("+prefill" if p else "") + ("<peak" if n < peak else "")
        e = out.setdefault(key, {"steps": 0, "seconds": 0.0, "decode_s": 0.0, "decode_tokens": 0})
        e["steps"] += 1
        e["seconds"] += dt
        e["decode_s"] += dt * d / (d + p) if d + p else 0.0
        e["decode_tokens"] += d
    for e in out.values():
        e["seconds"], e["decode_s"] = round(e["seconds"], 4), round(e["decode_s"], 4)
    return out


@contextlib.contextmanager
def gc_timer():
    """A dict filled when the block ends: per generation, the garbage collections inside it (``collections``)
    and their milliseconds (``ms``); ``frozen_at_start``, the objects frozen when it began (``gc.freeze``)."""
    out = {"collections": [0, 0, 0], "ms": [0.0, 0.0, 0.0], "frozen_at_start": gc.get_freeze_count()}
    start: list[float] = []

    def cb(phase, info):
        if phase == "start":
            start[:] = [time.perf_counter()]
        elif start:
            g = info["generation"]
            out["collections"][g] += 1
            out["ms"][g] += 1e3 * (time.perf_counter() - start[0])

    gc.callbacks.append(cb)
    try:
        yield out
    finally:
        gc.callbacks.remove(cb)
        out["ms"] = [round(x, 2) for x in out["ms"]]


class _Phases:
    """Wall time of a speculative step's phases, the device synchronised around each (a synchronised step is
    slower than a free-running one). Phases nest: ``chain`` and ``mtp_pass`` hold their draws, loads and
    replays."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def per_step(self) -> dict[str, float]:
        n = self.seconds.get("_count", 0)
        return {k: round(1e3 * v / n, 3) for k, v in self.seconds.items() if k != "_count"} if n else {}


def _timed_methods() -> list[tuple]:
    """``(owner, method name, phase label)`` of the speculative step's phases that :func:`phase_timer` and
    :func:`timeline` wrap."""
    import deepinfer.spec_decode as sd
    import deepinfer.spec_graphs as sg
    from deepinfer.models.deepseek_v4 import plan

    return [(sd.SpecDecoder, "execute", "step"), (sd.SpecDecoder, "_chain", "chain"),
            (sd.SpecDecoder, "_sample", "sample_accept"), (sd.SpecDecoder, "_mtp_pass", "mtp_pass"),
            (sd.SpecDecoder, "_draw", "draw"), (sg.SpecGraph, "load", "graph_load"),
            (sg.SpecGraph, "replay", "graph_replay"), (plan.PlanBuilder, "state_commit", "state_commit")]


@contextlib.contextmanager
def phase_timer(on: bool):
    """With ``on``: a :class:`_Phases` timing ``SpecDecoder`` steps (``step``), the draft chain, sampling and
    acceptance, the MTP pass, drafts' draws, graph plan loads and replays and the ring-state commit lists, by
    wrapping those methods for the block; else None."""
    if not on:
        yield None
        return
    out = _Phases()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    wrapped = _timed_methods()
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in wrapped]

    def timed(real, label):
        def f(*a, **kw):
            sync()
            t = time.perf_counter()
            try:
                return real(*a, **kw)
            finally:
                sync()
                out.seconds[label] = out.seconds.get(label, 0.0) + time.perf_counter() - t
                if label == "step":
                    out.seconds["_count"] = out.seconds.get("_count", 0) + 1
        return f

    for (owner, name, label), (_, _, real) in zip(wrapped, saved):
        setattr(owner, name, timed(real, label))
    try:
        yield out
    finally:
        for owner, name, real in saved:
            setattr(owner, name, real)




@contextlib.contextmanager
def timeline(on: bool):
    """With ``on``: a dict filled when the block ends with where the device idled during speculative steps,
    from a torch.profiler trace (nothing synchronised): per step window (one ``SpecDecoder.execute`` start to the
    next), the mean window, device-busy time (the union of kernels and copies) and the device-idle ms that fall
    inside each host phase of :func:`phase_timer` (nested: ``step`` holds the others) and between steps (the
    engine's scheduling and applying). Else None."""
    if not on:
        yield None
        return
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    saved = [(owner, name, getattr(owner, name), label) for owner, name, label in _timed_methods()]

    def labelled(real, label):
        def f(*a, **kw):
            with record_function(f"spec:{label}"):
                return real(*a, **kw)
        return f

    for owner, name, real, label in saved:
        setattr(owner, name, labelled(real, label))
    out: dict = {}
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    try:
        with profile(activities=acts) as prof:
            yield out
    finally:
        for owner, name, real, _ in saved:
            setattr(owner, name, real)
    events = prof.events()
    busy = _union([(e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA])
    labels: dict[str, list] = {}
    for e in events:
        if e.device_type == DeviceType.CPU and e.name.startswith("spec:"):
            labels.setdefault(e.name[5:], []).append((e.time_range.start, e.time_range.end))
    starts = sorted(a for a, _ in labels.get("step", []))
    windows = list(zip(starts, starts[1:]))
    if not windows:
        return
    idle = [gap for w0, w1 in windows for gap in _minus((w0, w1), busy)]
    n = len(windows)
    per = {lab: _overlap(idle, _union(r)) / n / 1e3 for lab, r in labels.items()}
    out.update({"steps": n, "window_ms": sum(b - a for a, b in windows) / n / 1e3,
                "device_busy_ms": sum(_overlap([w], busy) for w in windows) / n / 1e3,
                "device_idle_ms_in": {k: round(v, 3) for k, v in sorted(per.items())},
                "device_idle_ms_between_steps": (sum(b - a for a, b in idle) / n / 1e3) - per.get("step", 0.0)})


def _union(spans: list) -> list:
    """Sorted disjoint union of ``(start, end)`` spans."""
    out: list = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _minus(window, spans: list) -> list:
    """Parts of ``window`` outside the disjoint sorted ``spans``."""
    gaps, t = [], window[0]
    for a, b in spans:
        if b <= t or a >= window[1]:
            continue
        if a > t:
            gaps.append((t, a))
        t = max(t, b)
    if t < window[1]:
        gaps.append((t, window[1]))
    return gaps


def _overlap(spans: list, others: list) -> float:
    """Total length of the intersection of two span lists (``others`` disjoint)."""
    return sum(max(0.0, min(b, d) - max(a, c)) for a, b in spans for c, d in others)


def _spec_counters(llm) -> dict:
    spec = llm.runner.spec
    if spec is None:
        return {}
    s = spec.stats
    return {"verifications": s.verifications, "accepted": s.accepted, "drafted": s.drafted,
            "accepted_at": list(s.accepted_at), "verified_at": list(s.verified_at), "plain_steps": s.plain_steps,
            "graph_steps": s.graph_steps}


def sweep(model, args, on_row=None) -> list[dict]:
    """Every (batch, mode) row; spec rows carry the speedup and overhead against the spec-off row.
    ``on_row(rows)`` runs after each row (the result file is rewritten as rows come: a run cut short keeps them)."""
    from deepinfer import LLM

    ks = [int(x) for x in args.ks.split(",")]
    # scheduled right after off: both then start from the same allocator state (the fixed rows' eager
    # verifications past the graph buckets leave large cached blocks)
    # off and scheduled alternate --repeats times, each keeping its fastest run: a process's engines do not all
    # run at one speed (docs/speculative.md), and the comparison of those two is the schedule's acceptance
    paired = [("off", 0)] + ([("scheduled", max(ks))] if not args.no_scheduled else [])
    rows = []
    probe = LLM(model, max_num_seqs=1, device=args.device, num_blocks=2)
    prompts = make_prompts(probe, args)
    del probe

    def measure(batch, mode, k):
        out = run(model, batch, mode, k, args, prompts)
        gc.collect()  # the row's engine and its cache go before the next one is sized
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return out

    for batch in [int(b) for b in args.batches.split(",")]:
        runs: dict[str, list] = {}
        for _ in range(args.repeats):
            for mode, k in paired:
                runs.setdefault(mode, []).append(measure(batch, mode, k))
        chosen = {}
        for mode, rts in runs.items():
            row, tokens = max(rts, key=lambda rt: rt[0]["decode_tok_s"])
            row["decode_tok_s_runs"] = [r["decode_tok_s"] for r, _ in rts]
            chosen[mode] = (row, tokens)
        base = base_tokens = None
        for mode, k in [*paired, *((f"fixed-{k}", k) for k in ([] if args.no_fixed else ks))]:
            row, tokens = chosen[mode] if mode in chosen else measure(batch, mode, k)
            if mode == "off":
                base, base_tokens = row, tokens
            else:
                row["speedup"] = row["decode_tok_s"] / base["decode_tok_s"] if base["decode_tok_s"] else None
                row["speedup_at_peak"] = row["decode_tok_s_at_peak"] / base["decode_tok_s_at_peak"] \
                    if base["decode_tok_s_at_peak"] else None
                if base["decode_step_ms_median"]:
                    row["verification_overhead_pct"] = 100 * (row["decode_step_ms_median"]
                                                              / base["decode_step_ms_median"] - 1)
                if args.temperature == 0:
                    row["greedy_identical"] = tokens == base_tokens
            rows.append(row)
            print(json.dumps(row), flush=True)
            if on_row is not None:
                on_row(rows)
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="checkpoint directory or preset (default: tiny)")
    p.add_argument("--prompts", default=None,
                   help="text file, one prompt per line, or .jsonl with prompt_token_ids (default: random token ids)")
    p.add_argument("--batches", default="1,8,64,256")
    p.add_argument("--ks", default="1,2,3,4,5")
    p.add_argument("--no-scheduled", action="store_true", help="skip the confidence-scheduled rows")
    p.add_argument("--no-fixed", action="store_true", help="skip the fixed-length rows")
    p.add_argument("--batch1-requests", type=int, default=16,
                   help="requests run one after another at batch 1, spread evenly over the prompts (default 16)")
    p.add_argument("--waves", type=int, default=4,
                   help="past batch 1, requests per row = waves x batch, at most batch at once (default 4)")
    p.add_argument("--repeats", type=int, default=2, help="runs of the off and scheduled rows (the fastest kept)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--spec-admit-hold", type=int, default=None,
                   help="the spec rows' spec_admit_hold (default: the engine's; 0 admits at once)")
    p.add_argument("--device", default=None)
    p.add_argument("--phases", action="store_true",
                   help="time each speculative step's phases (synchronised: slower rows, for diagnosis)")
    p.add_argument("--timeline", action="store_true",
                   help="trace the speculative rows (torch.profiler): where the device idles per step")
    p.add_argument("--out", type=Path, default=None, help="result JSON (default bench/results/<device>/bench_spec.json)")
    args = p.parse_args(argv)
    if args.batch1_requests < 1 or args.repeats < 1 or args.waves < 1:
        raise SystemExit("--batch1-requests, --repeats and --waves: must be at least 1")
    args.batch_max = max([int(b) * args.waves for b in args.batches.split(",")] + [args.batch1_requests])
    from deepinfer.presets import PRESETS

    model = args.model
    if model not in PRESETS and not Path(model).is_dir():
        raise SystemExit(f"--model: {model!r} is neither a preset nor a checkpoint directory")
    dev = "h200" if torch.cuda.is_available() and "H200" in torch.cuda.get_device_name() else \
        ("cuda" if torch.cuda.is_available() else "cpu")
    out = args.out or ROOT / "bench" / "results" / dev / "bench_spec.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    from bench.timer import commit_id

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    head = {"model": str(args.model), "gpu": gpu, "torch": torch.__version__, "commit": commit_id()}

    def write(rows: list[dict]) -> None:
        out.write_text(json.dumps({**head, "rows": rows}, indent=1) + "\n")

    write(sweep(model, args, write))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
