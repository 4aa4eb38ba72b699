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

import numpy as np
import torch

from deepinfer.block_manager import FULL_GROUP, WINDOW_GROUP
from deepinfer.forward_batch import ForwardBatch, index_tensors
from deepinfer.sampler import Sampler
from deepinfer.scheduler import GRAMMAR_DEAD_END_TOKEN, GRAMMAR_VIOLATION_TOKEN, NewRequestData, SchedulerOutput
from deepinfer.sequence import NO_TOP_LOGPROBS


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


class RequestState:
    """The runner's own record of one request, updated only from scheduler outputs and sampled tokens.

    Attributes:
        req_id, params, seed: from the request's :class:`NewRequestData`.
        token_ids: its context as far as the host knows it (prompt, then output tokens; a token sampled by the step
            in flight is appended when that step's result is read).
        num_prompt_tokens: the prompt's length (later tokens are output: the draw counter and the penalties).
        slot: its row in the runner's :class:`BlockTable` s.
        matcher: its ``structured.RequestMatcher`` (a request with ``structured_outputs``), else None.
        shared_len, window_floor: from :class:`NewRequestData` (``num_shared_tokens``, ``window_floor``): the
            prefix-cache blocks its steps never write and the first position of its window tables.
    """

    __slots__ = ("req_id", "token_ids", "num_prompt_tokens", "params", "seed", "slot", "matcher", "_counts",
                 "shared_len", "window_floor")

    def __init__(self, data: NewRequestData, slot: int) -> None:
        self.req_id = data.req_id
        self.token_ids = list(data.prompt_token_ids) + list(data.output_token_ids)
        self.num_prompt_tokens = len(data.prompt_token_ids)
        self.params = data.params
        self.seed = data.seed
        self.slot = slot
        self.shared_len = data.num_shared_tokens
        self.window_floor = data.window_floor
        self.matcher = None
        if data.grammar is not None:
            from deepinfer.structured import RequestMatcher

            self.matcher = RequestMatcher(data.grammar, data.params.structured_outputs.after_token_id,
                                          data.output_token_ids)
        self._counts: tuple[int, dict[int, int]] = (self.num_prompt_tokens, {})

    @property
    def needs_history(self) -> bool:
        """Whether this request's draw needs every earlier token on the host: a grammar's mask, frequency /
        presence penalties."""
        p = self.params
        return self.matcher is not None or bool(p.frequency_penalty or p.presence_penalty)

    def output_token_counts(self) -> dict[int, int]:
        """``{token_id: occurrences}`` over the output tokens (updated incrementally: O(new tokens) per call)."""
        done, counts = self._counts
        for t in self.token_ids[done:]:
            counts[t] = counts.get(t, 0) + 1
        self._counts = (len(self.token_ids), counts)
        return counts


class BlockTable:
    """Block ids of one cache group for the runner's requests: ``ids [num_slots, max_blocks]`` int64, row ``slot``
    holds that request's table (block ``j`` covers positions ``[j * block_size, (j + 1) * block_size)``; ``-1``
    for a block a sliding-window group released) and ``-1`` after it. Rows and columns grow by doubling, so they
    are bounded by the live requests and the longest table."""

    def __init__(self, num_slots: int = 8, max_blocks: int = 8) -> None:
        self.ids = np.full((max(num_slots, 1), max(max_blocks, 1)), -1, dtype=np.int64)
        self.num_blocks = np.zeros(self.ids.shape[0], dtype=np.int64)

    def clear(self, slot: int) -> None:
        if slot >= len(self.num_blocks):
            return
        self.ids[slot, :self.num_blocks[slot]] = -1
        self.num_blocks[slot] = 0

    def rows(self, slots: np.ndarray) -> np.ndarray:
        """``[len(slots), width]`` copies of the rows of ``slots`` (slots beyond the table read as empty rows)."""
        if len(slots) and int(slots.max()) >= self.ids.shape[0]:
            self._grow(int(slots.max()) + 1, self.ids.shape[1])
        return self.ids[slots]

    def _grow(self, rows_needed: int, cols_needed: int) -> None:
        rows, cols = self.ids.shape
        grown = np.full((max(rows, rows_needed) * (2 if rows_needed > rows else 1),
                         max(cols, cols_needed) * (2 if cols_needed > cols else 1)), -1, dtype=np.int64)
        grown[:rows, :cols] = self.ids
        self.ids = grown
        self.num_blocks = np.concatenate([self.num_blocks, np.zeros(grown.shape[0] - rows, dtype=np.int64)])

    def append(self, slot: int, block_ids: tuple[int, ...]) -> None:
        rows, cols = self.ids.shape
        n = int(self.num_blocks[slot]) if slot < rows else 0
        end = n + len(block_ids)
        if slot >= rows or end > cols:
            self._grow(slot + 1, end)
        self.ids[slot, n:end] = block_ids
        self.num_blocks[slot] = end

    def release(self, slot: int, block_ids: tuple[int, ...]) -> list[int]:
        """Set the entries of ``block_ids`` in row ``slot`` to ``-1``; returns the ids the row does not hold (an
        empty list when all were found)."""
        n = int(self.num_blocks[slot]) if slot < self.ids.shape[0] else 0
        row = self.ids[slot, :n] if n else self.ids[:0, 0]
        missing = []
        for b in block_ids:
            hit = np.flatnonzero(row == b)
            if hit.size:
                row[hit[0]] = -1
            else:
                missing.append(b)
        return missing


class StepOutput:
    """One enqueued step: its sampled ids on the device and, once :meth:`result` is called, on the host (where they
    are also appended to the requests' runner state)."""

    def __init__(self, tokens: torch.Tensor, logprobs: torch.Tensor, tops: list, seq_rows: dict[int, int],
                 states: list[RequestState], host: tuple[torch.Tensor, torch.Tensor] | None, event, gpu_events,
                 t0: float, host_s: float, graph: bool, num_decode_tokens: int):
        self.tokens, self.logprobs, self.tops = tokens, logprobs, tops
        self.seq_rows = seq_rows  # req_id -> row of ``tokens``
        self.states = states  # row -> the request's state when the step was enqueued
        self._host, self._event, self._gpu_events = host, event, gpu_events
        self.t0, self.host_seconds, self.graph = t0, host_s, graph
        self.num_decode_tokens = num_decode_tokens
        self.gpu_seconds = 0.0
        self._result: tuple | None = None

    def result(self) -> tuple[list[int], list[float], list, float]:
        """``(token_ids, logprobs, top_logprobs, seconds)`` (waits for the step; seconds since it was enqueued)."""
        if self._result is not None:
            return self._result
        if self._event is not None:
            self._event.synchronize()
            toks, lps = self._host
            if self._gpu_events is not None:
                self.gpu_seconds = self._gpu_events[0].elapsed_time(self._gpu_events[1]) / 1000
        else:
            toks, lps = self.tokens, self.logprobs
        n = self.tokens.shape[0]
        ids = [host_token(state, t) for state, t in zip(self.states, toks[:n].tolist())]
        self._result = (ids, lps[:n].tolist(), self.tops, time.perf_counter() - self.t0)
        return self._result


def host_token(state: RequestState, t: int) -> int:
    """A sampled token reaching the host: appended to ``state.token_ids`` (unless ``-1``, NaN logits) and fed to
    its grammar matcher; returns the token, or the scheduler's mark for a grammar dead end / violation."""
    if state.matcher is not None and state.matcher.dead_end:
        return GRAMMAR_DEAD_END_TOKEN
    if t >= 0:
        state.token_ids.append(t)
        if state.matcher is not None and not state.matcher.accept(t):
            return GRAMMAR_VIOLATION_TOKEN
    return t


def _pool_bytes(pool_id, device) -> int:
    """Bytes of the caching allocator's segments in the private pool ``pool_id`` on ``device`` (0 when the
    snapshot does not name pools)."""
    if pool_id is None:
        return 0
    index = torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    want = tuple(pool_id)
    return sum(seg.get("total_size", 0) for seg in torch.cuda.memory_snapshot()
               if seg.get("device") == index and tuple(seg.get("segment_pool_id", ())) == want)


class _Graph:
    """A captured decode forward of ``bucket`` sequences: its capacity, static plan (every field a view of
    ``flat``), output, and the tensors it reads that must outlive it (RoPE tables)."""

    def __init__(self, bucket: int, capacity, plan, graph, logits: torch.Tensor, flat: torch.Tensor, keep,
                 greedy: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.bucket, self.capacity, self.plan, self.graph = bucket, capacity, plan, graph
        self.greedy = greedy  # (token ids, logprobs) of every row sampled greedily inside the graph
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
        host_tier: the prefix cache's host-memory tier (:class:`~deepinfer.host_cache.HostCacheTier`) that runs a
            step's ``cache_swaps``; None: a step with swaps is refused.
    """

    def __init__(self, model, cache, device: torch.device | str, batch_invariant: bool = False,
                 enforce_eager: bool = True, max_num_seqs: int | None = None, max_model_len: int | None = None,
                 host_tier=None):
        self.model = model
        self.cache = cache
        self.host_tier = host_tier
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
        self._graph_pool = None
        self._capture_stream = None
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.requests: dict[int, RequestState] = {}
        # one table per cache group, the first (kept) group always; others appear with their first blocks
        self.block_tables: dict[str, BlockTable] = {FULL_GROUP: BlockTable()}
        self._free_slots: list[int] = []
        self.num_forwards = 0  # model forwards enqueued (real and empty steps): the DP step loop counts them
        self.spec = None  # a ``spec_decode.SpecDecoder`` runs the speculative steps when speculation is on
        if self.captures_graphs(model, self.device, enforce_eager, max_num_seqs, max_model_len):
            self.capture(graph_buckets(max_num_seqs), max_model_len)

    @staticmethod
    def captures_graphs(model, device, enforce_eager: bool, max_num_seqs: int | None,
                        max_model_len: int | None) -> bool:
        """Whether a runner with these settings captures decode graphs: on CUDA, for a model with a step plan on its
        FP8 path, unless ``enforce_eager``; never under expert parallelism (its dispatch reads split sizes on the
        host, ``docs/expert-parallel.md``)."""
        return (not enforce_eager and torch.device(device).type == "cuda" and callable(getattr(model, "plan_builder", None))
                and getattr(model, "gemm", None) == "fp8" and bool(max_num_seqs) and bool(max_model_len)
                and getattr(model, "expert_parallel", None) is None)

    @classmethod
    @torch.inference_mode()
    def measure_graph_memory(cls, model, device, block_size: int, max_num_seqs: int, max_model_len: int,
                             batch_invariant: bool = False, spec_tokens: int = 0, **cache_options) -> int:
        """Device bytes the decode graphs of every bucket will hold, measured before the cache is sized: every
        bucket is captured over a 2-block cache (as :meth:`capture` does: largest first, one pool), then freed;
        with ``spec_tokens`` (``num_speculative_tokens``) the speculation graphs too (``spec_graphs.py``).
        The figure is the largest of: the drop in free device memory (torch's pool and the driver's graph
        memory), the growth of torch's reserved memory, the graph pool's segments, and the peak growth of the
        allocated bytes (warm-up temporaries included; in a long-lived process the capture reuses cached blocks
        and the first three read low). Capturing the largest and smallest bucket alone underestimated it (the
        pool does not reuse every block across bucket sizes)."""
        import gc

        torch.cuda.synchronize(device)
        cache = allocate_cache(model, 2, block_size, **cache_options)
        runner = cls(model, cache, device, batch_invariant=batch_invariant)
        free1, reserved1 = torch.cuda.mem_get_info(device)[0], torch.cuda.memory_reserved(device)
        torch.cuda.reset_peak_memory_stats(device)
        allocated1 = torch.cuda.memory_allocated(device)
        runner.capture(graph_buckets(max_num_seqs), max_model_len)
        spec = None
        if spec_tokens:
            from deepinfer.spec_graphs import SpecGraphs, spec_buckets

            spec = SpecGraphs(runner, spec_tokens, spec_buckets(max_num_seqs), max_model_len)
        total = max(0, free1 - torch.cuda.mem_get_info(device)[0], torch.cuda.memory_reserved(device) - reserved1,
                    _pool_bytes(runner._graph_pool, device), torch.cuda.max_memory_allocated(device) - allocated1)
        del runner, cache, spec
        gc.collect()
        torch.cuda.empty_cache()  # what stays (the model's tables, cuBLAS workspaces) is out of the free memory
        return total

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
        for bucket in sorted(buckets, reverse=True):
            cap, plan = self.dummy_plan(bucket, max_len)
            st = plan.input_ids.untyped_storage()
            flat = torch.empty(0, dtype=torch.int64, device=self.device).set_(st, 0, (st.nbytes() // 8,))

            def run(plan=plan):
                logits = self.model.forward(plan, self.cache)
                return logits, self.sampler.greedy_device(logits)

            g, (logits, greedy) = self.capture_graph(run, plan)
            self.graphs[bucket] = _Graph(bucket, cap, plan, g, logits, flat, dict(self.model._rope_tables), greedy)
        torch.cuda.synchronize(self.device)
        self.graph_capture_seconds = time.perf_counter() - t0
        self.graph_memory_bytes = torch.cuda.memory_reserved(self.device) - mem0

    def capture_graph(self, run, plan):
        """Capture ``run()``, a forward over the graph-mode ``plan``, into a CUDA graph of the runner's memory pool
        (one for every capture of this runner): ``run`` first runs eagerly once on a side stream (kernels chosen,
        workspaces and tables allocated), then ``plan.derived`` is cleared so that the graph derives the index
        lists. Returns ``(graph, what the captured run returned)``: its outputs, rewritten by every replay."""
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(self.device)
        stream = self._capture_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            run()
            plan.derived.clear()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._graph_pool, stream=stream):
            out = run()
        return g, out

    def _graph_for(self, q: np.ndarray, ends: np.ndarray) -> _Graph | None:
        if not self.graphs or (q != 1).any() or int(ends.max()) > self.max_model_len:
            return None
        n = len(q)
        fits = [b for b in self.graphs if b >= n]
        return self.graphs[min(fits)] if fits else None

    # ---------------------------------------------------------------------------------------------------- state
    def update_states(self, output: SchedulerOutput) -> None:
        """Apply ``output`` to the runner's per-request state: drop finished and preempted requests, add new ones,
        mark each scheduled request's released block ids ``-1`` in its tables, then append its new block ids.

        Raises:
            RuntimeError: a scheduled request the runner has no state for, a new one it already has, or a released
            block id its table does not hold (naming ``released_block_ids``, the request and the group).
        """
        if output.cache_swaps:  # before anything reads or writes the blocks this step
            if self.spec is not None:  # the last speculative step's ring state first: the swaps copy it
                self.spec.flush_commit()
            if self.host_tier is None:
                raise RuntimeError("ModelRunner: the scheduler output carries cache_swaps but the runner has no "
                                   "host tier")
            self.host_tier.apply(output.cache_swaps)
        for rid in output.finished_req_ids + output.preempted_req_ids:
            state = self.requests.pop(rid, None)
            if state is not None:
                for table in self.block_tables.values():
                    table.clear(state.slot)
                self._free_slots.append(state.slot)
        for data in output.new_requests:
            if data.req_id in self.requests:
                raise RuntimeError(f"ModelRunner: request {data.req_id} is new but already has state")
            slot = self._free_slots.pop() if self._free_slots else len(self.requests)
            self.requests[data.req_id] = RequestState(data, slot)
        for item in output.scheduled:
            state = self.requests.get(item.req_id)
            if state is None:
                raise RuntimeError(f"ModelRunner: scheduled request {item.req_id} has no state (never added)")
            for group, ids in item.released_block_ids.items():
                table = self.block_tables.get(group)
                missing = list(ids) if table is None else table.release(state.slot, ids)
                if missing:
                    raise RuntimeError(f"ModelRunner: released_block_ids of request {item.req_id} in cache group "
                                       f"{group!r} lists blocks its table does not hold: {missing}")
            for group, ids in item.new_block_ids.items():
                table = self.block_tables.get(group)
                if table is None:
                    table = self.block_tables[group] = BlockTable()
                table.append(state.slot, ids)

    def _step_inputs(self, output: SchedulerOutput, states: list[RequestState]):
        """Host ids of the step's tokens (0 where the id is a pending token on the device), the token rows whose
        logits are sampled, and ``(row, req_id)`` of every token fed from the device."""
        ids: list[int] = []
        logits_rows: list[int] = []
        feed: list[tuple[int, int]] = []
        for item, state in zip(output.scheduled, states):
            n, start = item.num_new_tokens, item.start
            toks = state.token_ids
            have = len(toks)
            if start + n <= have:
                ids.extend(toks[start:start + n])
            else:
                ids.extend(toks[start:have])
                for _ in range(max(start, have), start + n):  # pending tokens: sampled by the step in flight
                    feed.append((len(ids), item.req_id))
                    ids.append(0)
            if item.needs_logits:
                logits_rows.append(len(ids) - 1)
        return ids, logits_rows, feed

    def forward_batch(self, output: SchedulerOutput, input_ids: torch.Tensor | None = None) -> ForwardBatch:
        """The ``ForwardBatch`` of ``output`` (already applied by :meth:`update_states`) for a model without a step
        plan. Request i contributes ``num_new_tokens`` tokens at positions ``[start, start + num_new_tokens)``;
        block tables are padded with -1 to the longest."""
        states = [self.requests[item.req_id] for item in output.scheduled]
        ids, logits_rows, _ = self._step_inputs(output, states)
        positions: list[int] = []
        for item in output.scheduled:
            positions.extend(range(item.start, item.start + item.num_new_tokens))
        table = self.block_tables[FULL_GROUP]
        slots = np.array([st.slot for st in states], dtype=np.int64)
        width = max(int(table.num_blocks[slots].max()), 1)
        ids_t, pos_t, logits_t = index_tensors([ids, positions, logits_rows], self.device)  # one copy
        return ForwardBatch(
            input_ids=ids_t if input_ids is None else input_ids,
            positions=pos_t,
            query_lens=[item.num_new_tokens for item in output.scheduled],
            context_lens=[item.start + item.num_new_tokens for item in output.scheduled],
            block_tables=torch.from_numpy(table.ids[slots, :width].astype(np.int32)).to(self.device),
            logits_indices=logits_t,
            batch_invariant=self.batch_invariant,
        )

    # ---------------------------------------------------------------------------------------------------- steps
    @torch.inference_mode()
    def execute(self, output: SchedulerOutput, prev: StepOutput | None = None) -> StepOutput:
        """Apply ``output`` (:meth:`update_states`) and enqueue its step: plan, forward, sampling. Tokens whose id is
        still pending (sampled by ``prev``, the step in flight) are read from ``prev.tokens`` on the device.

        Raises:
            RuntimeError: nothing scheduled, or a pending token whose step is not ``prev``.
        """
        if self.spec is not None:
            if output.speculative:
                return self.spec.execute(output)
            self.spec.flush_commit()
            self.spec.stats.plain_steps += 1
        t0 = time.perf_counter()
        self.update_states(output)
        scheduled = output.scheduled
        if not scheduled:
            raise RuntimeError("ModelRunner.execute: the scheduler output schedules nothing")
        states = [self.requests[item.req_id] for item in scheduled]
        ids, logits_rows, feed = self._step_inputs(output, states)
        if feed and (prev is None or any(rid not in prev.seq_rows for _, rid in feed)):
            raise RuntimeError("ModelRunner.execute: a pending token's step is not the previous one")
        gpu_events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if self.cuda \
            else None
        starts = np.fromiter((item.start for item in scheduled), np.int64, len(scheduled))
        q = np.fromiter((item.num_new_tokens for item in scheduled), np.int64, len(scheduled))
        prompt = np.fromiter((st.num_prompt_tokens for st in states), np.int64, len(states))
        decode = (q == 1) & (starts >= prompt)
        graph = None
        if self.builder is not None:
            seqs = self.step_seqs(states, starts, q)
            graph = self._graph_for(q, starts + q)
            if self.spec is not None:  # the schedule compares plain and speculative steps' measured periods
                self.spec.mark_step(scheduled, "plain", None if graph is None else graph.bucket, 0, t0)
            if graph is not None:
                graph.plan.num_tokens, graph.plan.num_logits = self.builder.fill(seqs, ids, logits_rows,
                                                                                 graph.capacity, graph.flat)
                input_ids = graph.plan.input_ids
            else:
                plan = self.builder.build(seqs, ids, logits_rows, self.batch_invariant,
                                          self.model.step_pad(self.batch_invariant, self.device))
                input_ids = plan.input_ids
        else:
            batch = self.forward_batch(output)
            input_ids = batch.input_ids
        if feed:
            rows, src = index_tensors([[r for r, _ in feed], [prev.seq_rows[rid] for _, rid in feed]], self.device)
            input_ids.index_copy_(0, rows, prev.tokens.index_select(0, src).clamp(min=0))
        if gpu_events is not None:
            gpu_events[0].record()
        self.num_forwards += 1
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
        sampled = np.fromiter((item.needs_logits for item in scheduled), bool, len(scheduled))
        states_l = [st for st, k in zip(states, sampled) if k]
        if states_l:
            counters = (starts + q - prompt)[sampled]  # the index of the output token each row draws
            if prev is not None and any(st.needs_history and st.req_id in prev.seq_rows for st in states_l):
                prev.result()  # their masks / penalties need prev's tokens: wait for them behind this forward
            # the grammar rows' bitmask is filled on the host while the device runs the forward
            masks = self._grammar_masks(states_l, logits.shape[1])
            if graph is not None and graph.greedy is not None and masks is None and Sampler.plain_greedy(states_l):
                # sampled inside the graph; copied out, since the next replay rewrites the graph's outputs
                tokens, logprobs = (t[:len(states_l)].clone() for t in graph.greedy)
                tops = [NO_TOP_LOGPROBS] * len(states_l)
            else:
                tokens, logprobs, tops = self.sampler.sample_device(logits, states_l, counters, masks)
        else:
            tokens = torch.empty(0, dtype=torch.long, device=self.device)
            logprobs = torch.empty(0, dtype=torch.float32, device=self.device)
            tops = []
        seq_rows = {st.req_id: k for k, st in enumerate(states_l)}
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
        return StepOutput(tokens, logprobs, tops, seq_rows, states_l, host, event, gpu_events, t0,
                          self.last_enqueue_seconds, graph is not None, int(decode.sum()))

    @torch.inference_mode()
    def execute_empty(self) -> None:
        """An empty step: the model's forward over no tokens (under expert parallelism it still joins every MoE
        layer's dispatch and combine, so the other DP ranks' step goes on; ``docs/expert-parallel.md``)."""
        if self.spec is not None:
            self.spec.flush_commit()
        e = torch.empty(0, dtype=torch.int64, device=self.device)
        batch = ForwardBatch(e, e, [], [], torch.zeros(0, 1, dtype=torch.int32, device=self.device), e,
                             self.batch_invariant)
        self.num_forwards += 1
        self.model.forward(batch, self.cache)

    def step_seqs(self, states: list[RequestState], starts: np.ndarray, q: np.ndarray):
        """The plan's ``StepSeqs`` of requests ``states`` computing positions ``[starts[i], starts[i] + q[i])``
        (``[n]`` int64 each) over the runner's block tables."""
        from deepinfer.models.deepseek_v4.plan import StepSeqs

        slots = np.fromiter((st.slot for st in states), np.int64, len(states))
        window = self.block_tables.get(WINDOW_GROUP)
        shared = np.fromiter((st.shared_len for st in states), np.int64, len(states))
        floor = np.fromiter((st.window_floor for st in states), np.int64, len(states))
        prefix = bool(shared.any() or floor.any())  # a prefix-cache hit in the step
        return StepSeqs(starts, q, self.block_tables[FULL_GROUP].rows(slots),
                        None if window is None else window.rows(slots), shared if prefix else None,
                        floor if prefix else None)

    def _grammar_masks(self, states: list[RequestState], vocab: int):
        """``(rows [m] int64, bitmask [m, ceil(V / 32)] int32)`` on the device for the rows of ``states`` whose
        matcher is active (filled on the host, one copy each), or None when no row is constrained."""
        rows = [i for i, st in enumerate(states) if st.matcher is not None and st.matcher.active]
        if not rows:
            return None
        bitmask = torch.empty((len(rows), -(-vocab // 32)), dtype=torch.int32, pin_memory=self.cuda)
        for j, i in enumerate(rows):
            states[i].matcher.fill(bitmask, j)
        (rows_t,) = index_tensors([rows], self.device)
        return rows_t, bitmask.to(self.device, non_blocking=True)

    def step(self, output: SchedulerOutput) -> tuple[list[int], list[float], list, float]:
        """:meth:`execute` then wait: ``(token_ids, logprobs, top_logprobs, seconds)`` for the requests with
        ``needs_logits``, in order."""
        return self.execute(output).result()
