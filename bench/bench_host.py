"""Host time per decode step of the engine on the CPU: scheduling, step plan, enqueue, sampling, applying results.

Usage (from the repository root, PYTHONPATH=python:engine):
    python bench/bench_host.py                      # 1, 64 and 256 decoding sequences, eager and graph-mode plans
    python bench/bench_host.py --batches 64 --profile  # also a cProfile table of the decode steps

The model is a stand-in with the tiny preset's DeepSeek-V4 config (every layer kind, so every compressor list of the
plan is built) and a vocabulary of ``--vocab`` tokens: the real :class:`PlanBuilder` and sampler run, the forward
returns zero logits. So the figures are the host work of the engine alone, on this CPU (not the H200's).
``--paths spec-plain`` runs graph-mode decode steps of an engine configured to speculate whose verification
never pays (plain steps, as the schedule gives where speculation loses).
``--paths spec-plans`` times a speculative graph step's plan work alone (``spec_plans``); ``--paths spec-steps``
whole speculative graph steps of a random checkpoint, replays stubbed (``spec_steps``).
``--window-group`` gives the stand-in DeepSeek-V4's two cache groups (the default is one group, as the committed
figures were measured). ``--graphs`` also runs the graph-mode path: every decode step builds its plan into a captured bucket's buffer
(``ModelRunner`` with stand-in graphs whose replay does nothing), as decode steps do on CUDA.

Method: ``batch`` requests of ``--prompt-len`` tokens are prefilled and decode ``--warmup`` tokens, then
``--steps`` decode steps of ``LLMEngine.step`` (asynchronous scheduling: scheduling, plan, enqueue, sampling and
applying the step before) are timed one by one: ``host_ms`` is the median wall time per step, ``host_cpu_ms`` the
median CPU time of this thread (robust to other processes on a shared machine). One JSON line per (batch, path);
``--out`` also writes them as a list.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import statistics
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class HostOnlyModel:
    """The engine contract of a DeepSeek-V4 model with a step plan, without the model: ``forward`` returns
    ``[num_logits, vocab]`` zero logits."""

    def __init__(self, vocab: int, block_size: int = 128) -> None:
        from deepinfer.models.deepseek_v4 import DeepseekV4Config, PlanBuilder
        from deepinfer.models.registry import model_family

        tiny = dict(model_family("deepseek_v4").tiny_config)
        tiny["vocab_size"] = vocab
        self.config = DeepseekV4Config.from_dict(tiny)
        self.config_block_size = block_size
        self.gemm = "fp8"
        self._builder_class = PlanBuilder
        self._builders: dict = {}

    def parameters(self):
        return iter(())

    def allocate_cache(self, num_blocks: int):
        return types.SimpleNamespace(block_size=self.config_block_size, num_blocks=num_blocks,
                                     device=torch.device("cpu"))

    def plan_builder(self, cache):
        key = (cache.block_size, cache.num_blocks)
        if key not in self._builders:
            self._builders[key] = self._builder_class(self.config, cache.block_size, cache.num_blocks, cache.device)
        return self._builders[key]

    def step_pad(self, batch_invariant: bool, device) -> int:
        return 0

    def forward(self, plan, cache):
        return torch.zeros(plan.num_logits, self.config.vocab_size)


class _NoGraph:
    def replay(self) -> None:
        pass


def install_graphs(llm) -> None:
    """Stand-in CUDA graphs for every bucket: decode steps take the graph-mode plan path, replay does nothing."""
    from deepinfer.model_runner import _Graph, graph_buckets

    runner = llm.runner
    vocab = llm.model.config.vocab_size
    for bucket in graph_buckets(llm.config.max_num_seqs):
        cap, plan = runner.dummy_plan(bucket, llm.max_model_len)
        st = plan.input_ids.untyped_storage()
        flat = torch.empty(0, dtype=torch.int64).set_(st, 0, (st.nbytes() // 8,))
        runner.graphs[bucket] = _Graph(bucket, cap, plan, _NoGraph(), torch.zeros(bucket, vocab), flat, {})
    runner.max_model_len = llm.max_model_len


def use_window_group(llm) -> None:
    """DeepSeek-V4's two cache groups for the stand-in (``LLM`` gives a model outside the registry one group): a
    ``window`` group that releases blocks after the sliding window, so steps carry released ids and the plans read
    window tables, as with the real model."""
    from deepinfer.block_manager import FULL_GROUP, WINDOW_GROUP, BlockManager, CacheGroup, window_blocks_needed
    from deepinfer.models.deepseek_v4.cache import window_lookback

    cfg = llm.config
    lookback = window_lookback(llm.model.config)
    window = min(window_blocks_needed(lookback, cfg.block_size, cfg.max_num_seqs, cfg.max_num_batched_tokens),
                 cfg.num_blocks)
    llm.block_manager = llm.scheduler.block_manager = BlockManager(
        cfg.num_blocks, cfg.block_size, [CacheGroup(FULL_GROUP, cfg.num_blocks),
                                         CacheGroup(WINDOW_GROUP, window, lookback)])


def run(batch: int, graphs: bool, args, spec_plain: bool = False) -> tuple[dict, pstats.Stats | None]:
    from deepinfer import LLM

    model = HostOnlyModel(args.vocab)
    max_len = args.prompt_len + args.steps + 2 * args.warmup + 128
    spec = {}
    if spec_plain:  # speculation configured (an MTP stand-in that never runs), verification never pays
        model.mtp, model.forward_mtp = [None], lambda *a, **k: None
        spec = dict(speculative_method="mtp", num_speculative_tokens=args.draft_tokens, spec_schedule="confidence")
    llm = LLM(model, max_num_seqs=batch, max_model_len=max_len, max_num_batched_tokens=max(2048, batch),
              num_blocks=batch * -(-max_len // 128), **spec)
    if spec_plain:
        llm.runner.spec.plain_cost = {1 << i: 1e-9 for i in range(12)}
        llm.scheduler.spec_pays = llm.runner.spec.pays
    window_group = getattr(args, "window_group", False)
    if window_group:
        use_window_group(llm)
    if graphs:
        install_graphs(llm)
    check = None
    if spec_plain:
        def check():
            if llm.runner.spec.stats.verifications:
                raise RuntimeError("spec-plain: a step verified drafts")
    wall, cpu, prof = _time_steps(llm, batch, args, check)
    row = {"op": "engine_host_decode", "device": "cpu", "shape": {"batch": batch, "graph_plans": graphs,
           "prompt_len": args.prompt_len, "vocab": args.vocab, "temperature": args.temperature,
           "window_group": window_group, "spec_configured": spec_plain},
           "host_ms": round(1e3 * statistics.median(wall), 4), "host_cpu_ms": round(1e3 * statistics.median(cpu), 4)}
    return row, (pstats.Stats(prof) if prof is not None else None)


def _time_steps(llm, batch: int, args, check=None):
    """``batch`` requests of random prompts prefilled and decoded ``--warmup`` tokens, then ``--steps`` engine
    steps timed one by one: ``(wall seconds, thread CPU seconds, cProfile or None)``; ``check()`` after each."""
    from deepinfer import SamplingParams
    from deepinfer.sequence import Sequence

    rng = random.Random(0)
    sp = SamplingParams(temperature=args.temperature, max_tokens=args.steps + 2 * args.warmup, ignore_eos=True)
    seqs = [Sequence(i, [rng.randrange(3, args.vocab) for _ in range(args.prompt_len)], sp, seed=i)
            for i in range(batch)]
    engine = llm.engine
    for seq in seqs:
        engine.add_request(seq)
    while min(s.num_output_tokens for s in seqs) < args.warmup:  # prefill, then a few decode steps
        engine.step()
    prof = cProfile.Profile() if args.profile else None
    wall, cpu = [], []
    for _ in range(args.steps):
        if prof is not None:
            prof.enable()
        t, c = time.perf_counter(), time.thread_time()
        engine.step()
        cpu.append(time.thread_time() - c)
        if check is not None:
            check()
        wall.append(time.perf_counter() - t)
        if prof is not None:
            prof.disable()
    return wall, cpu, prof


def spec_steps(batch: int, args) -> tuple[dict, pstats.Stats | None]:
    """Host time of speculative graph steps (fixed ``--draft-tokens``): a random checkpoint of the tiny preset's
    shape at ``--spec-layers`` layers and a vocabulary of ``--vocab``, its steps through ``SpecGraphs`` whose
    replays hand back their first replay's outputs (so only the host work runs; drafts are mostly rejected, one
    or two tokens a step). ``host_ms``: median wall time of an engine step, as :func:`run`."""
    import tempfile

    from deepinfer import LLM
    from deepinfer.presets import make_checkpoint
    from deepinfer.spec_graphs import SpecGraph, SpecGraphs, spec_buckets

    max_len = args.prompt_len + args.steps * (args.draft_tokens + 1) + 2 * args.warmup + 128
    with tempfile.TemporaryDirectory() as d:
        make_checkpoint("tiny", d, num_layers=args.spec_layers, vocab_size=args.vocab, progress=False)
        llm = LLM(d, speculative_method="mtp", num_speculative_tokens=args.draft_tokens, spec_schedule="fixed",
                  max_num_seqs=batch, max_model_len=max_len, max_num_batched_tokens=max(2048, batch))
    llm.runner.spec.graphs = SpecGraphs(llm.runner, args.draft_tokens, spec_buckets(batch), max_len)
    real, first = SpecGraph.replay, {}

    def replay(g) -> None:
        if id(g) not in first:
            real(g)
            first[id(g)] = (g.logits, g.streams, g.deferred, g.greedy)
        g.logits, g.streams, g.deferred, g.greedy = first[id(g)]

    SpecGraph.replay = replay
    try:
        wall, cpu, prof = _time_steps(llm, batch, args)
    finally:
        SpecGraph.replay = real
    stats = llm.runner.spec.stats
    row = {"op": "engine_host_spec_step", "device": "cpu", "shape": {"batch": batch, "layers": args.spec_layers,
           "draft_tokens": args.draft_tokens, "prompt_len": args.prompt_len, "vocab": args.vocab,
           "temperature": args.temperature}, "graph_steps": stats.graph_steps,
           "host_ms": round(1e3 * statistics.median(wall), 4), "host_cpu_ms": round(1e3 * statistics.median(cpu), 4)}
    return row, (pstats.Stats(prof) if prof is not None else None)


def spec_plans(batch: int, args) -> list[dict]:
    """Host time of a speculative graph step's plan work at ``batch`` sequences of ``--draft-tokens`` + 1 tokens
    (positions near ``--prompt-len``, two cache groups): the captured plan's buffer written by ``build(...,
    capacity=, out=)`` (numpy, the reference) and by ``fill`` (C++; with and without its checks, which a step makes
    once: ``check_arrays``), and ``state_commit`` of random kept lengths. Median of ``--steps`` calls each."""
    import numpy as np

    from deepinfer.models.deepseek_v4 import Capacity, PlanBuilder
    from deepinfer.models.deepseek_v4.plan import StepSeqs

    model = HostOnlyModel(args.vocab)
    q = args.draft_tokens + 1
    B = 128
    nb = -(-(args.prompt_len + 2 * B) // B)
    b = PlanBuilder(model.config, B, batch * nb, "cpu", window_blocks=batch * nb)
    cap = Capacity(batch, nb, nb * B, q)
    rng = random.Random(0)
    c0 = np.array([args.prompt_len + rng.randrange(0, B) for _ in range(batch)], dtype=np.int64)
    bt = np.arange(batch * nb, dtype=np.int64).reshape(batch, nb)
    wt = bt.copy()
    for i, p in enumerate(c0):
        wt[i, :b.first_window_block(int(p))] = -1
    seqs = StepSeqs(c0, np.full(batch, q, dtype=np.int64), bt, wt)
    ids, rows = [5] * (batch * q), list(range(batch * q))
    out = b.build(seqs, ids, rows, capacity=cap, finalize=False)
    st = out.input_ids.untyped_storage()
    flat = torch.empty(0, dtype=torch.int64).set_(st, 0, (st.nbytes() // 8,))
    kept = StepSeqs(c0, np.array([rng.randrange(1, q + 1) for _ in range(batch)], dtype=np.int64), bt, wt)
    row_starts = np.arange(batch, dtype=np.int64) * q
    calls = {"build": lambda: b.build(seqs, ids, rows, capacity=cap, out=flat, finalize=False),
             "fill": lambda: b.fill(seqs, ids, rows, cap, flat),
             "check_arrays": lambda: b.check_arrays(seqs),  # a step checks once, then loads with checked=True
             "fill_checked": lambda: b.fill(seqs, ids, rows, cap, flat, checked=True),
             "state_commit": lambda: b.state_commit(kept, row_starts)}
    out_rows = []
    for name, fn in calls.items():
        try:
            fn()
        except (ValueError, TypeError) as e:  # code without a C++ fill for several tokens per sequence
            print(f"{name}: {e}", file=sys.stderr)
            continue
        wall = []
        for _ in range(args.steps):
            t = time.perf_counter()
            fn()
            wall.append(time.perf_counter() - t)
        out_rows.append({"op": "spec_plan_host", "device": "cpu", "shape": {"batch": batch, "tokens_per_seq": q,
                         "prompt_len": args.prompt_len, "call": name},
                         "host_ms": round(1e3 * statistics.median(wall), 4)})
    return out_rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,64,256")
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--steps", type=int, default=60, help="measured decode steps")
    p.add_argument("--warmup", type=int, default=4, help="decode steps before the measured ones")
    p.add_argument("--vocab", type=int, default=512, help="small: the stand-in's sampling work stays negligible")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy rows; > 0: drawn rows")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--paths", default="eager,graphs",
                   help="eager, graphs (engine decode steps), spec-plain (graphs, speculation configured but never "
                        "paying: plain steps), spec-plans (a speculative step's plan work), spec-steps "
                        "(whole speculative graph steps, replays stubbed)")
    p.add_argument("--draft-tokens", type=int, default=3, help="spec-plans, spec-steps: drafts per sequence")
    p.add_argument("--spec-layers", type=int, default=16, help="spec-steps: the random checkpoint's layers")
    p.add_argument("--window-group", action="store_true",
                   help="DeepSeek-V4's two cache groups (window blocks released after the sliding window)")
    p.add_argument("--profile", action="store_true", help="cProfile table of the measured run (stdout)")
    p.add_argument("--out", type=Path, help="also write the rows as a JSON list here")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        for path in args.paths.split(","):
            if path == "spec-plans":
                for row in spec_plans(b, args):
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                continue
            if path == "spec-steps":
                row, stats = spec_steps(b, args)
            else:
                row, stats = run(b, path in ("graphs", "spec-plain"), args, path == "spec-plain")
            rows.append(row)
            print(json.dumps(row), flush=True)
            if stats is not None:
                s = io.StringIO()
                stats.stream = s
                stats.sort_stats("cumulative").print_stats(40)
                print(s.getvalue())
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
