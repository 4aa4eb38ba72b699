"""The engine core: the step plan's device-only forward, asynchronous scheduling and CUDA-graph decode.

* The forward from a built plan reads nothing back to the host: every host read of a tensor (``item``, ``tolist``,
  ``cpu``, ``numpy``, ``bool`` / ``int`` / ``float``) raises inside it (the CPU guard); on CUDA the same forward runs
  under ``torch.cuda.set_sync_debug_mode("error")``.
* Greedy outputs are token-identical with asynchronous scheduling and CUDA graphs on and off, with EOS stops,
  ``max_tokens`` ends and preemption under block exhaustion; batch-invariant mode keeps alone == batched bitwise.
"""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.models.deepseek_v4 import DeepseekV4ForCausalLM, SeqStep


@contextlib.contextmanager
def no_host_reads():
    """Every way of reading a tensor's values on the host raises inside the block."""
    names = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def trap(name):
        def f(self, *a, **k):
            raise AssertionError(f"host read in the forward: Tensor.{name}")
        return f

    for n in names:
        setattr(torch.Tensor, n, trap(n))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


def _plan_steps(model, device):
    """A prefill of two prompts (one crossing a block end), then a mixed step, then two decode steps."""
    cache = model.allocate_cache(8, device)
    b = model.plan_builder(cache)
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(3, 1000) for _ in range(n)]  # noqa: E731
    steps = [([SeqStep(0, 130, (0, 1)), SeqStep(0, 9, (2,))], ids(139), [129, 138]),
             ([SeqStep(130, 1, (0, 1)), SeqStep(9, 120, (2, 3))], ids(121), [0, 120]),
             ([SeqStep(131, 1, (0, 1)), SeqStep(129, 1, (2, 3))], ids(2), [0, 1]),
             ([SeqStep(132, 1, (0, 1)), SeqStep(130, 1, (2, 3))], ids(2), [0, 1])]
    return cache, [b.build(seqs, i, rows) for seqs, i, rows in steps]


@pytest.mark.parametrize("gemm", ["fp8", "dequant"])
def test_forward_from_a_plan_reads_nothing_on_the_host(gemm):
    """The FP8 path does device work only. The dequantised path's expert loop is data-dependent: it is the one
    place that reads the routing back (documented in MoE.forward), so it is expected to trip the guard there."""
    model = DeepseekV4ForCausalLM.from_checkpoint(gemm=gemm).eval()
    cache, plans = _plan_steps(model, "cpu")
    for plan in plans:
        if gemm == "fp8":
            with no_host_reads():
                logits = model.forward(plan, cache)
        else:
            with pytest.raises(AssertionError, match="host read"), no_host_reads():
                model.forward(plan, cache)
            logits = model.forward(plan, cache)
        assert torch.isfinite(logits).all()


def _greedy(llm, prompts, max_tokens):
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))]


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_async_scheduling_gives_the_same_tokens(batch_invariant):
    """Async on vs off, with max_tokens ends of different lengths and preemption under block exhaustion (a small
    cache): the same tokens and finish reasons; in batch-invariant mode the same logprobs bitwise too (otherwise
    they may differ in the last bits, since finished requests leave the batch one step later)."""
    rng = random.Random(3)
    # prompts just below a block end: decode steps need new blocks, which a 9-block cache cannot give all at once
    prompts = [[rng.randrange(3, 120000) for _ in range(rng.randrange(118, 128))] for _ in range(12)]
    out = {}
    for async_ in (False, True):
        llm = LLM("tiny", async_scheduling=async_, num_blocks=9, max_num_seqs=8, batch_invariant=batch_invariant)
        params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=False) for m in (3, 9, 17, 30) * 3]
        gens = llm.generate(prompts, params)
        out[async_] = [(g.token_ids, g.finish_reason, g.logprobs if batch_invariant else None) for g in gens]
        if async_:
            assert llm.last_stats.num_preemptions > 0  # the small cache forced preemption
    assert out[True] == out[False]


def test_async_scheduling_applies_stops_one_step_late_without_an_extra_token():
    """A stop token id ends a request; the step already in flight for it adds nothing."""
    llm = LLM("tiny", async_scheduling=False)
    free = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=12))[0].token_ids
    stop = free[4]
    for async_ in (False, True):
        llm = LLM("tiny", async_scheduling=async_)
        g = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=(stop,)))[0]
        assert g.token_ids == free[:free.index(stop)] and g.finish_reason == "stop" and g.stop_token_id == stop


def test_batch_invariant_alone_equals_batched_with_async():
    llm = LLM("tiny", batch_invariant=True, async_scheduling=True)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 120000) for _ in range(n)] for n in (7, 140, 33)]
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    batched = llm.generate(prompts, sp)
    for p, b in zip(prompts, batched):
        alone = llm.generate([p], sp)[0]
        assert alone.token_ids == b.token_ids and alone.logprobs == b.logprobs


@pytest.mark.cuda
def test_cuda_forward_from_a_plan_never_synchronises():
    model = DeepseekV4ForCausalLM.from_checkpoint(dtype=torch.bfloat16, device="cuda").eval()  # auto -> fp8
    cache, plans = _plan_steps(model, "cuda")
    model.forward(plans[0], cache)  # start-up work: RoPE tables (grown once per doubling of the context)
    torch.cuda.synchronize()
    for plan in plans[1:]:
        torch.cuda.set_sync_debug_mode("error")
        try:
            logits = model.forward(plan, cache)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.isfinite(logits).all()


@pytest.mark.cuda
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_cuda_graphs_and_async_give_the_same_greedy_tokens(batch_invariant):
    """Graphs + async vs eager + in order on the GPU. With the mode off every request runs to the same length, so
    each decode step has 8 sequences, a bucket size (padding rows would change the torch GEMMs' M); in
    batch-invariant mode lengths differ (bucket padding) and the logprobs must match bitwise too."""
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 120000) for _ in range(rng.randrange(1, 300))] for _ in range(8)]
    lens = (24,) * 8 if not batch_invariant else (5, 24, 9, 17, 24, 3, 11, 20)
    out = {}
    for graphs in (False, True):
        llm = LLM("tiny", device="cuda", enforce_eager=not graphs, async_scheduling=graphs, max_num_seqs=8,
                  batch_invariant=batch_invariant)
        assert bool(llm.runner.graphs) == graphs
        gens = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens])
        out[graphs] = [(g.token_ids, g.logprobs if batch_invariant else None) for g in gens]
        if graphs:
            assert llm.startup["graph_capture_s"] > 0 and llm.startup["cuda_graphs"] == [1, 2, 4, 8]
    assert out[True] == out[False]


@pytest.mark.cuda
def test_cuda_graph_steps_sample_in_graph_only_for_plain_greedy_rows():
    """Batch-invariant mode, graphs + async vs eager: plain greedy requests (sampled inside the graph), drawn ones,
    biased ones and ones asking top log-probabilities (sampled after it) give bitwise the same tokens, logprobs and
    top log-probabilities, alone in a step or mixed."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 120000) for _ in range(rng.randrange(1, 200))] for _ in range(6)]
    kinds = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=0, top_logprobs=2, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=0, logit_bias={5: 2.0}, max_tokens=12, ignore_eos=True)]
    runs = {}
    for graphs in (False, True):
        llm = LLM("tiny", device="cuda", enforce_eager=not graphs, async_scheduling=graphs, max_num_seqs=8,
                  batch_invariant=True)
        res = [llm.generate(prompts, [kinds[0]] * 6)]  # every row plain greedy: the in-graph path
        res.append(llm.generate(prompts, [kinds[i % 4] for i in range(6)]))  # mixed: sampled after the graph
        runs[graphs] = [[(g.token_ids, g.logprobs, g.top_logprobs) for g in r] for r in res]
    assert runs[True] == runs[False]


@pytest.mark.cuda
def test_cuda_graph_memory_is_measured_before_the_cache_is_sized():
    """A derived cache leaves room for the decode graphs: the profile capture's estimate is reported, positive,
    and covers what the real capture reserved; with num_blocks given no profile capture runs."""
    llm = LLM("tiny", device="cuda", enforce_eager=False, max_num_seqs=16)
    est, used = llm.startup["graph_memory_estimate_bytes"], llm.startup["graph_memory_bytes"]
    assert est > 0 and est >= 0.9 * used, (est, used)
    assert LLM("tiny", device="cuda", enforce_eager=False, max_num_seqs=16, num_blocks=64).startup[
        "graph_memory_estimate_bytes"] == 0


@pytest.mark.cuda
def test_cuda_sampler_never_synchronises_for_greedy_and_plain_draws():
    from deepinfer.sampler import Sampler
    from deepinfer.sequence import Sequence

    logits = torch.randn(3, 1000, device="cuda")
    seqs = [Sequence(i, [1, 2], SamplingParams(temperature=t, max_tokens=4), seed=i) for i, t in enumerate((0, 1, 0.7))]
    Sampler().sample_device(logits, seqs)  # warm-up (pinned staging buffers)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens, logprobs, _ = Sampler().sample_device(logits, seqs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert tokens[0].item() == int(logits[0].argmax()) and torch.isfinite(logprobs).all()


def test_model_registry_by_model_type():
    from deepinfer.models.registry import model_family

    fam = model_family("deepseek_v4")
    assert fam.model_class is DeepseekV4ForCausalLM and model_family(None) is not None
    cfg = fam.config_class.from_dict(fam.tiny_config)
    assert fam.cache_spec(cfg, torch.float32, 128).bytes_per_block > 0 and fam.expected_parameters(cfg)
    with pytest.raises(ValueError, match="model_type: 'llama'"):
        model_family("llama")


@pytest.mark.parametrize("async_", [False, True])
def test_engine_core_add_step_abort(async_):
    """The engine object on its own: requests added while others run, one aborted mid-run (its blocks freed, no
    token after the abort), the rest as LLM.generate gives them."""
    from deepinfer.sequence import Sequence

    llm = LLM("tiny", async_scheduling=async_)
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [[5, 6, 7], [8, 9] * 70, [11] * 130]
    want = [o.token_ids for o in llm.generate(prompts, sp)]
    eng = llm.engine
    seqs = [Sequence(100 + i, list(p), sp, seed=0) for i, p in enumerate(prompts)]
    victim = Sequence(200, [13] * 40, sp, seed=0)
    assert eng.add_request(seqs[0]) and eng.add_request(victim)
    eng.step()
    eng.step()
    assert eng.add_request(seqs[1]) and eng.add_request(seqs[2])
    eng.step()
    n_victim = victim.num_output_tokens
    eng.abort(victim, {"type": "invalid_request_error", "code": "aborted", "message": "test"})
    while eng.has_unfinished_requests():
        eng.step()
    assert [s.output_token_ids for s in seqs] == want
    assert victim.is_finished and victim.num_output_tokens == n_victim and victim.block_table == []
    assert eng.scheduler.block_manager.num_free_blocks == eng.scheduler.block_manager.num_blocks


def test_graph_dummy_plans_build_for_every_bucket():
    """The plans captured into CUDA graphs (built here on the CPU: capture itself needs a GPU) have the bucket's
    fixed sizes, and a real decode step's plan of fewer sequences fits the same buffer."""
    from deepinfer.model_runner import graph_buckets

    llm = LLM("tiny", max_num_seqs=24)
    runner = llm.runner
    assert graph_buckets(24) == [1, 2, 4, 8, 16, 24] and graph_buckets(1) == [1]
    for bucket in graph_buckets(24):
        cap, plan = runner.dummy_plan(bucket, llm.max_model_len)
        assert plan.num_rows == bucket and plan.graph and plan.tok_bt.shape == (bucket, cap.max_blocks)
        flat = plan.input_ids.untyped_storage().nbytes() // 8
        step = [SeqStep(300 + 5 * i, 1, tuple(range(4 * i, 4 * i + 4)), (-1,) + tuple(range(3 * i, 3 * i + 3)))
                for i in range(max(1, bucket - 1))]  # window block 0 released (before 300 - 127)
        real = runner.builder.build(step, [5] * len(step), list(range(len(step))), capacity=cap, finalize=False)
        assert real.input_ids.untyped_storage().nbytes() // 8 == flat


@pytest.mark.parametrize("async_", [False, True])
def test_output_processor_stops_and_fails_one_request(async_):
    """A handler returning True ends its request with "stop" after that token (no token of the step in flight is
    added); a handler that raises ends its request alone with an error record."""
    from deepinfer.engine import OutputProcessor
    from deepinfer.sequence import Sequence

    llm = LLM("tiny", async_scheduling=async_)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    eng = llm.engine
    out = OutputProcessor(eng)
    seqs = [Sequence(300 + i, [5 + i, 6, 7], sp, seed=0) for i in range(3)]
    seen: list[int] = []

    def stop_at_4(t, lp, top):
        seen.append(t)
        return len(seen) == 4

    def boom(t, lp, top):
        raise RuntimeError("parser broke")

    for s, h in zip(seqs, (stop_at_4, boom, lambda t, lp, top: False)):
        eng.add_request(s)
        out.add(s, h)
    while eng.has_unfinished_requests():
        out.process(eng.step())
    assert seqs[0].finish_reason == "stop" and seqs[0].output_token_ids == seen and len(seen) == 4
    assert seqs[1].error["code"] == "output_processing_failed" and "parser broke" in seqs[1].error["message"]
    assert seqs[2].error is None and seqs[2].num_output_tokens == 12 and seqs[2].finish_reason == "length"


def test_the_run_loop_keeps_the_heap_frozen_and_leaves_the_collector_as_it_was():
    """``LLM.generate`` steps with the heap alive at its start frozen (``gc.freeze``: full collections skip the
    engine's objects) and unfreezes it at the end, also after an error; inside an open ``gc_frozen`` block the
    heap stays frozen until that block ends; a heap frozen before the run is frozen during it too."""
    import gc

    from deepinfer.engine import gc_frozen

    llm = LLM("tiny")
    counts = []
    step = llm.engine.step

    def spy():
        counts.append(gc.get_freeze_count())
        return step()

    llm.engine.step = spy
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    assert gc.get_freeze_count() == 0
    llm.generate([[5, 6, 7]], sp)
    assert counts and min(counts) > 0 and gc.get_freeze_count() == 0

    def boom():
        raise RuntimeError("model failed")

    llm.engine.step = boom
    with pytest.raises(RuntimeError, match="model failed"):
        llm.generate([[5, 6, 7]], sp)
    assert gc.get_freeze_count() == 0
    llm.engine.step = spy
    with gc_frozen():
        llm.generate([[5, 6, 7]], sp)
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0
    gc.freeze()  # a process that froze a few objects early: the run still freezes those made since
    marker = [object()]
    scanned = []

    def spy_marker():
        scanned.append(any(o is marker for o in gc.get_objects()))
        return step()

    llm.engine.step = spy_marker
    try:
        llm.generate([[5, 6, 7]], sp)
    finally:
        gc.unfreeze()
    assert scanned and not any(scanned)


def test_tokens_without_top_logprobs_store_no_container_of_their_own():
    """A request that asked for no ``top_logprobs`` stores the shared empty entry per token (a step allocates no
    container per token for the collector to scan); ``RequestOutput`` still gives a list per token."""
    from deepinfer.sequence import NO_TOP_LOGPROBS, Sequence

    llm = LLM("tiny")
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    seq = Sequence(7, [5, 6, 7], sp, seed=0)
    asked = Sequence(8, [5, 6, 7], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, top_logprobs=2),
                     seed=0)
    eng = llm.engine
    assert eng.add_request(seq) and eng.add_request(asked)
    while eng.has_unfinished_requests():
        eng.step()
    assert len(seq.output_top_logprobs) == 4 and all(t is NO_TOP_LOGPROBS for t in seq.output_top_logprobs)
    assert all(len(t) == 2 for t in asked.output_top_logprobs)
    (out,) = llm.generate([[5, 6, 7]], sp)
    assert out.top_logprobs == [[], [], [], []]
