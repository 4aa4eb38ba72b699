"""Model runner: turns the scheduler's choice into the model's step input, runs it (eager or a CUDA graph), samples.

How the engine calls the model (see ``docs/engine.md``):

* A model family with a step plan (``model.plan_builder(cache)``, DeepSeek-V4): the runner builds the plan on the
  host (one host-to-device copy) and the forward does device work only. Decode steps of the FP8 path on CUDA replay
  a CUDA graph captured per batch-size bucket; other steps run eager.
* Any other model implementing the engine contract: ``model.forward(ForwardBatch, cache)`` (``forward_batch.py``).

``execute`` only enqueues: the sampled ids stay on the device (the next step may read them as its input ids) and
reach the host on a side stream; :meth:`StepOutput.result` waits for them.
"""

from __future__ import annotations

import time

import torch

from deepinfer.block_manager import WINDOW_GROUP
from deepinfer.forward_batch import ForwardBatch, index_tensors
from deepinfer.sampler import Sampler
from deepinfer.scheduler import ScheduledSeq


def allocate_cache(model, num_blocks: int, block_size: int, **options):
    """Ask the model for its paged cache of ``num_blocks`` blocks of ``block_size`` tokens.

    The model exposes ``allocate_cache(num_blocks, **options)`` (its block size is fixed by its cache spec, which
    must equal ``block_size``; checked when the model reports ``cache_spec.block_size`` or ``config_block_size``);
    ``options`` (e.g. ``window_blocks``, ``kv_cache_dtype``) are given only to a model with cache groups.

    Raises:
        ValueError: the model's block size differs from the engine's.
        TypeError: the model has no ``allocate_cache``.
    """
    spec = getattr(model, "cache_spec", None)
    model_bs = getattr(spec, "block_size", None) or getattr(model, "config_block_size", None)
    if model_bs is not None and int(model_bs) != block_size:
        raise ValueError(f"EngineConfig.block_size ({block_size}) differs from the model's cache block size ({model_bs})")
    if not hasattr(model, "allocate_cache"):
        raise TypeError(f"{type(model).__name__} has no allocate_cache(num_blocks): it does not implement the engine contract")
    return model.allocate_cache(num_blocks, **options)


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Decode batch sizes with a captured graph: 1, 2, 4, 8, then every multiple of 8, up to ``max_num_seqs``
    (included)."""
    out = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 8))
    return sorted(set(out + [max_num_seqs]))


def _step_inputs(scheduled: list[ScheduledSeq]) -> tuple[list[int], list[int], list[tuple[int, int]]]:
    """Host ids of the step's tokens (0 where the id is a pending token on the device), the token rows whose
    logits are sampled, and ``(row, seq_id)`` of every token fed from the device."""
    ids: list[int] = []
    logits_rows: list[int] = []
    feed: list[tuple[int, int]] = []
    for item in scheduled:
        seq, n, start = item.seq, item.num_new_tokens, item.start
        known = min(start + n, seq.num_tokens)
        if known > start:
            ids.extend(seq.token_at(start, known))
        for _ in range(max(start, seq.num_tokens), start + n):  # pending tokens: sampled by the step in flight
            feed.append((len(ids), seq.seq_id))
            ids.append(0)
        if item.needs_logits:
            logits_rows.append(len(ids) - 1)
    return ids, logits_rows, feed


def _window_ids(tables: dict[str, list[int]]) -> tuple[int, ...] | None:
    """The ``window`` cache group's table (``None`` for a single-group cache)."""
    t = tables.get(WINDOW_GROUP)
    return None if t is None else tuple(t)


def build_forward_batch(scheduled: list[ScheduledSeq], device: torch.device | str,
                        batch_invariant: bool = False, input_ids: torch.Tensor | None = None) -> ForwardBatch:
    """The ``ForwardBatch`` of one step for a model without a step plan (``batch_invariant`` is copied into it).

    Sequence i contributes ``scheduled[i].num_new_tokens`` tokens at positions ``[start, start + num_new_tokens)``;
    a logits row is requested for each sequence whose step reaches the end of its context.
    """
    ids, logits_rows, _ = _step_inputs(scheduled)
    positions: list[int] = []
    max_blocks = max(len(item.seq.block_table) for item in scheduled)
    tables: list[list[int]] = []
    for item in scheduled:
        positions.extend(range(item.start, item.start + item.num_new_tokens))
        tables.append(list(item.seq.block_table) + [-1] * (max_blocks - len(item.seq.block_table)))
    ids_t, pos_t, logits_t = index_tensors([ids, positions, logits_rows], device)  # one copy
    return ForwardBatch(
        input_ids=ids_t if input_ids is None else input_ids,
        positions=pos_t,
        query_lens=[item.num_new_tokens for item in scheduled],
        context_lens=[item.start + item.num_new_tokens for item in scheduled],
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        logits_indices=logits_t,
        batch_invariant=batch_invariant,
    )


class StepOutput:
    """One enqueued step: its sampled ids on the device and, once :meth:`result` is called, on the host."""

    def __init__(self, tokens: torch.Tensor, logprobs: torch.Tensor, tops: list, seq_rows: dict[int, int],
                 host: tuple[torch.Tensor, torch.Tensor] | None, event, gpu_events, t0: float, host_s: float,
                 graph: bool):
        self.tokens, self.logprobs, self.tops = tokens, logprobs, tops
        self.seq_rows = seq_rows  # seq_id -> row of ``tokens``
        self._host, self._event, self._gpu_events = host, event, gpu_events
        self.t0, self.host_seconds, self.graph = t0, host_s, graph
        self.gpu_seconds = 0.0

    def result(self) -> tuple[list[int], list[float], list, float]:
        """``(token_ids, logprobs, top_logprobs, seconds)`` (waits for the step; seconds since it was enqueued)."""
        if self._event is not None:
            self._event.synchronize()
            toks, lps = self._host
            if self._gpu_events is not None:
                self.gpu_seconds = self._gpu_events[0].elapsed_time(self._gpu_events[1]) / 1000
        else:
            toks, lps = self.tokens, self.logprobs
        n = self.tokens.shape[0]
        return toks[:n].tolist(), lps[:n].tolist(), self.tops, time.perf_counter() - self.t0


class _Graph:
    """A captured decode forward of ``bucket`` sequences: its capacity, static plan (every field a view of
    ``flat``), output, and the tensors it reads that must outlive it (RoPE tables)."""

    def __init__(self, bucket: int, capacity, plan, graph, logits: torch.Tensor, flat: torch.Tensor, keep):
        self.bucket, self.capacity, self.plan, self.graph = bucket, capacity, plan, graph
        self.logits, self.flat, self.keep = logits, flat, keep


class ModelRunner:
    """Runs one scheduled step: plan, forward (eager or graph replay), sampling on the device.

    Args:
        model, cache: the model and its paged cache.
        device: where they live.
        batch_invariant: the model's batch-invariant mode and the sampler's per-row draws.
        enforce_eager: never use CUDA graphs.
        max_num_seqs / max_model_len: the largest decode batch and context a graph must hold (graphs are captured
            when both are given, on CUDA, for a model with a step plan on its FP8 path).
    """

    def __init__(self, model, cache, device: torch.device | str, batch_invariant: bool = False,
                 enforce_eager: bool = True, max_num_seqs: int | None = None, max_model_len: int | None = None):
        self.model = model
        self.cache = cache
        self.device = torch.device(device)
        self.batch_invariant = batch_invariant
        self.sampler = Sampler(batch_invariant=batch_invariant)
        self.last_enqueue_seconds = 0.0
        self.builder = model.plan_builder(cache) if callable(getattr(model, "plan_builder", None)) else None
        self.cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.graphs: dict[int, _Graph] = {}
        self.graph_capture_seconds = 0.0
        self.graph_memory_bytes = 0
        self.max_model_len = max_model_len
        if (not enforce_eager and self.cuda and self.builder is not None and getattr(model, "gemm", None) == "fp8"
                and max_num_seqs and max_model_len):
            self.capture(graph_buckets(max_num_seqs), max_model_len)

    # ---------------------------------------------------------------------------------------------------- graphs
    def _capacity(self, bucket: int, max_len: int):
        from deepinfer.models.deepseek_v4.plan import Capacity

        B = self.cache.block_size
        return Capacity(bucket, -(-max_len // B), max_len)

    def dummy_plan(self, bucket: int, max_len: int):
        """(capacity, plan) captured for ``bucket``: ``bucket`` one-token sequences at position 0, all in block 0
        (built unchecked: they alias that block on purpose; its contents are overwritten before any sequence reads
        them), the derived lists left to the captured forward."""
        from deepinfer.models.deepseek_v4.plan import SeqStep

        cap = self._capacity(bucket, max_len)
        seqs = [SeqStep(0, 1, (0,))] * bucket
        return cap, self.builder.build(seqs, [0] * bucket, list(range(bucket)), self.batch_invariant, capacity=cap,
                                       finalize=False, checked=True)

    @torch.inference_mode()
    def capture(self, buckets: list[int], max_len: int) -> None:
        """Capture the decode forward for every bucket (largest first, one memory pool): a dummy plan of ``bucket``
        one-token sequences at position 0 in block 0 (a free block: whatever it writes there is overwritten before
        any sequence reads it), warmed up eagerly once, then captured."""
        t0 = time.perf_counter()
        torch.cuda.synchronize(self.device)
        mem0 = torch.cuda.memory_reserved(self.device)
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for bucket in sorted(buckets, reverse=True):
            cap, plan = self.dummy_plan(bucket, max_len)
            st = plan.input_ids.untyped_storage()
            flat = torch.empty(0, dtype=torch.int64, device=self.device).set_(st, 0, (st.nbytes() // 8,))
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self.model.forward(plan, self.cache)  # warm-up: kernels chosen, workspaces and tables allocated
                plan.derived.clear()
            torch.cuda.current_stream(self.device).wait_stream(stream)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, stream=stream):
                logits = self.model.forward(plan, self.cache)
            self.graphs[bucket] = _Graph(bucket, cap, plan, g, logits, flat, dict(self.model._rope_tables))
        torch.cuda.synchronize(self.device)
        self.graph_capture_seconds = time.perf_counter() - t0
        self.graph_memory_bytes = torch.cuda.memory_reserved(self.device) - mem0

    def _graph_for(self, scheduled: list[ScheduledSeq]) -> _Graph | None:
        if not self.graphs or any(item.num_new_tokens != 1 for item in scheduled):
            return None
        if max(item.start + 1 for item in scheduled) > self.max_model_len:
            return None
        n = len(scheduled)
        fits = [b for b in self.graphs if b >= n]
        return self.graphs[min(fits)] if fits else None

    # ---------------------------------------------------------------------------------------------------- steps
    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq], prev: StepOutput | None = None) -> StepOutput:
        """Enqueue one step: plan, forward, sampling. Tokens whose id is still pending (sampled by ``prev``, the step
        in flight) are read from ``prev.tokens`` on the device."""
        t0 = time.perf_counter()
        ids, logits_rows, feed = _step_inputs(scheduled)
        if feed and (prev is None or any(sid not in prev.seq_rows for _, sid in feed)):
            raise RuntimeError("ModelRunner.execute: a pending token's step is not the previous one")
        gpu_events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if self.cuda \
            else None
        graph = None
        if self.builder is not None:
            from deepinfer.models.deepseek_v4.plan import SeqStep

            seqs = [SeqStep(item.start, item.num_new_tokens, tuple(item.seq.block_table),
                            _window_ids(item.seq.block_tables)) for item in scheduled]
            graph = self._graph_for(scheduled)
            if graph is not None:
                plan = self.builder.build(seqs, ids, logits_rows, self.batch_invariant, capacity=graph.capacity,
                                          out=graph.flat, finalize=False)
                graph.plan.num_tokens, graph.plan.num_logits = plan.num_tokens, plan.num_logits
                input_ids = graph.plan.input_ids
            else:
                plan = self.builder.build(seqs, ids, logits_rows, self.batch_invariant,
                                          self.model.step_pad(self.batch_invariant, self.device))
                input_ids = plan.input_ids
        else:
            batch = build_forward_batch(scheduled, self.device, self.batch_invariant)
            input_ids = batch.input_ids
        if feed:
            rows, src = index_tensors([[r for r, _ in feed], [prev.seq_rows[sid] for _, sid in feed]], self.device)
            input_ids.index_copy_(0, rows, prev.tokens.index_select(0, src).clamp(min=0))
        if gpu_events is not None:
            gpu_events[0].record()
        if graph is not None:
            graph.graph.replay()
            logits = graph.logits[:len(logits_rows)]
        elif self.builder is not None:
            logits = self.model.forward(plan, self.cache)
        else:
            logits = self.model.forward(batch, self.cache)
        if gpu_events is not None:
            gpu_events[1].record()
        n_logits = len(logits_rows)
        if logits.dim() != 2 or logits.shape[0] != n_logits:
            raise RuntimeError(f"model.forward returned logits of shape {tuple(logits.shape)}, expected [{n_logits}, vocab]")
        seqs_l = [item.seq for item in scheduled if item.needs_logits]
        if seqs_l:
            tokens, logprobs, tops = self.sampler.sample_device(logits, seqs_l)
        else:
            tokens = torch.empty(0, dtype=torch.long, device=self.device)
            logprobs = torch.empty(0, dtype=torch.float32, device=self.device)
            tops = []
        seq_rows = {s.seq_id: k for k, s in enumerate(seqs_l)}
        host = event = None
        if self.cuda:  # the ids reach the host on a side stream; the main stream goes on with the next step
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.copy_stream):
                host = (tokens.to("cpu", non_blocking=True), logprobs.to("cpu", non_blocking=True))
                event = torch.cuda.Event()
                event.record(self.copy_stream)
            tokens.record_stream(self.copy_stream)
            logprobs.record_stream(self.copy_stream)
        self.last_enqueue_seconds = time.perf_counter() - t0
        return StepOutput(tokens, logprobs, tops, seq_rows, host, event, gpu_events, t0, self.last_enqueue_seconds,
                          graph is not None)

    def step(self, scheduled: list[ScheduledSeq]) -> tuple[list[int], list[float], list, float]:
        """:meth:`execute` then wait: ``(token_ids, logprobs, top_logprobs, seconds)`` for the sequences with
        ``needs_logits``, in order."""
        return self.execute(scheduled).result()
