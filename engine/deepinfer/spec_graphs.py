"""CUDA graphs of the speculative step (``docs/speculative.md``, "Graphs").

Three forwards per speculative step have fixed shapes once the batch is padded to a bucket:

* ``verify``: the target over ``q`` tokens per sequence (the last token and ``q - 1`` drafts), its hidden streams
  returned and its compressors' ring state deferred (written after acceptance, for the kept positions only, by
  the graph's captured commit: :meth:`SpecGraph.commit`);
* ``draft``: the MTP layer over one token per sequence (a step of the draft chain; ring state discarded);
* ``mtp``: the MTP layer over up to ``k + 1`` kept positions per sequence (ring state written).

:class:`SpecGraphs` captures each per bucket into the runner's graph pool. A graph's plan, token ids and hidden
input live in static buffers: a step writes its own plan into them (:meth:`SpecGraph.load`) and replays. Off CUDA
nothing is captured and :meth:`SpecGraph.replay` runs the forward eagerly over the same buffers, which is how the
CPU tests check the padded shapes.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from deepinfer.models.deepseek_v4.compressor import write_deferred_state
from deepinfer.models.deepseek_v4.plan import SeqStep, StepSeqs

SPEC_GRAPH_MAX_SEQS = 64  # the largest batch with speculation graphs; past it verification rarely pays


def greedy_draws(logits: torch.Tensor, confidences: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Greedy drafts of ``logits`` ``[n, V]``: ``(argmax [n] int64, its softmax probability [n] float32, or None
    without ``confidences``)``, computed in fp32. ``SpecDecoder._draw`` and the draft graphs share it, so a draft
    is the same token whether drawn in a graph or eagerly."""
    lf = logits.float()
    tokens = torch.argmax(lf, dim=-1)
    if not confidences:
        return tokens, None
    return tokens, torch.softmax(lf, dim=-1).gather(1, tokens[:, None]).squeeze(1)


def spec_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes with speculation graphs: powers of two below ``min(max_num_seqs, SPEC_GRAPH_MAX_SEQS)``, then
    that bound."""
    top = min(max_num_seqs, SPEC_GRAPH_MAX_SEQS)
    return [b for b in (1, 2, 4, 8, 16, 32) if b < top] + [top]


def best_seconds(fn, device: torch.device, repeats: int = 3) -> float:
    """Wall seconds of ``fn()``, the device synchronised before and after: the best of ``repeats`` timed calls
    after one warm-up."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    best = float("inf")
    for i in range(repeats + 1):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        if i:
            best = min(best, time.perf_counter() - t)
    return best


class SpecGraph:
    """One captured forward: ``kind`` (``"verify"``, ``"draft"``, ``"mtp"``) over ``bucket`` sequences of up to
    ``q`` tokens. ``plan`` (every field a view of ``flat``) and ``hidden`` (``[bucket * q, hc_mult, hidden]``, the
    MTP input; None for ``verify``) are its inputs; ``logits`` (``[bucket * q, vocab]`` float32), ``streams``
    (``[bucket * q, hc_mult, hidden]``), ``deferred`` (``{ratio: [(ring_kv, ring_gate, kv_new, gate_new)]}``,
    ``verify`` only) and ``greedy`` (``draft`` / ``mtp`` only: :func:`greedy_draws` of the logits, the confidences
    None unless the graphs were made with ``confidences``) its outputs, rewritten by every replay."""

    def __init__(self, kind: str, bucket: int, q: int, capacity, plan, flat: torch.Tensor, hidden, run) -> None:
        self.kind, self.bucket, self.q, self.capacity = kind, bucket, q, capacity
        self.plan, self.flat, self.hidden, self._run = plan, flat, hidden, run
        self.graph = None
        self.logits = self.streams = self.greedy = None
        self.deferred: dict[int, list] = {}
        self.keep = None  # tensors the captured graph reads that must outlive it (RoPE tables)
        # verify only: the commit of its deferred ring state (:meth:`commit`): lists at this graph's capacity in
        # ``commit_flat``, their views by ratio, and the captured writes (None off CUDA)
        self.commit_flat = self.commit_lists = self.commit_graph = None

    def load(self, builder, seqs, ids: list[int], logits_rows: list[int], checked: bool = False) -> None:
        """Write the step's plan (``StepSeqs`` of at most ``bucket`` sequences, ``q`` tokens each) into the
        buffers (:meth:`~deepinfer.models.deepseek_v4.plan.PlanBuilder.fill`). Raises ValueError naming
        ``capacity`` when the step does not fit."""
        builder.fill(seqs, ids, logits_rows, self.capacity, self.flat, checked)

    def replay(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:  # off CUDA: the forward itself over the static buffers
            self.plan.derived.clear()
            self.logits, self.streams, self.deferred, self.greedy = self._run()

    def commit(self, builder, seqs, row_starts) -> None:
        """Write the ring state the last replay deferred for the positions each sequence keeps (``seqs``:
        ``StepSeqs`` of ``[c0, c0 + kept)``, their rows from ``row_starts``): the commit lists into
        :attr:`commit_flat` (:meth:`~deepinfer.models.deepseek_v4.plan.PlanBuilder.state_commit` at this graph's
        capacity), then one replay of the captured writes (off CUDA: the writes themselves). Raises ValueError
        naming ``capacity`` when the kept positions do not fit."""
        if self.commit_lists is None:  # a model without compressors defers nothing
            return
        builder.state_commit(seqs, row_starts, checked=True, capacity=self.capacity, out=self.commit_flat)
        if self.commit_graph is not None:
            self.commit_graph.replay()
        else:
            self._write_state()

    def _write_state(self) -> None:
        write_deferred_state(self.deferred, self.commit_lists)


class SpecGraphs:
    """The speculative step's graphs of ``runner`` for ``k`` drafts: ``verify`` per (bucket, q) for q in
    ``1 .. k + 1``, ``draft`` and ``mtp`` per bucket. Captured on CUDA (largest first, the runner's pool), kept
    as eager replays elsewhere. ``seconds`` (after :meth:`profile`): replay times by ``(kind, bucket, q)``.

    ``confidences``: the ``draft`` and ``mtp`` graphs also compute greedy drafts' confidences (the confidence
    schedule reads them).

    Raises:
        ValueError naming ``num_speculative_tokens`` when ``k + 1`` tokens do not fit a cache block, ``max_len``
        when they do not fit it.
    """

    @torch.inference_mode()
    def __init__(self, runner, k: int, buckets: list[int], max_len: int, confidences: bool = True) -> None:
        if not 1 <= k + 1 <= runner.cache.block_size:
            raise ValueError(f"num_speculative_tokens: {k} + 1 tokens per sequence must fit a cache block "
                             f"({runner.cache.block_size})")
        if max_len < k + 1:
            raise ValueError(f"max_len: {max_len} positions cannot hold the {k} + 1 tokens of a verification")
        self.runner, self.k, self.max_len, self.confidences = runner, k, max_len, confidences
        self.buckets = sorted(set(buckets))
        self.verify: dict[tuple[int, int], SpecGraph] = {}
        self.draft: dict[int, SpecGraph] = {}
        self.mtp: dict[int, SpecGraph] = {}
        self.seconds: dict[tuple[str, int, int], float] = {}
        self.capture_seconds = 0.0
        t0 = time.perf_counter()
        cuda = runner.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(runner.device)
        for b in reversed(self.buckets):
            for q in range(k + 1, 0, -1):
                self.verify[(b, q)] = self._make("verify", b, q, cuda)
            self.mtp[b] = self._make("mtp", b, k + 1, cuda)
            self.draft[b] = self._make("draft", b, 1, cuda)
        if cuda:
            torch.cuda.synchronize(runner.device)
        self.capture_seconds = time.perf_counter() - t0

    def __len__(self) -> int:
        return len(self.verify) + len(self.draft) + len(self.mtp)

    def bucket(self, n: int) -> int | None:
        """The smallest bucket holding ``n`` sequences (None past the largest)."""
        return next((b for b in self.buckets if b >= n), None)

    def _make(self, kind: str, bucket: int, q: int, cuda: bool) -> SpecGraph:
        r = self.runner
        model = r.model
        cap = dataclasses.replace(r._capacity(bucket, self.max_len), tokens_per_seq=q)
        rows = bucket * q
        # dummy sequences at positions 0 .. q - 1, all in block 0 (free before any request; what they write there
        # is overwritten before a sequence reads it), as the decode graphs' dummy plans
        plan = r.builder.build([SeqStep(0, q, (0,))] * bucket, [0] * rows, list(range(rows)), r.batch_invariant,
                               capacity=cap, finalize=False, checked=True)
        st = plan.input_ids.untyped_storage()
        flat = torch.empty(0, dtype=torch.int64, device=r.device).set_(st, 0, (st.nbytes() // 8,))
        hidden = None
        if kind != "verify":
            cfg = model.config
            hidden = torch.zeros(rows, cfg.hc_mult, cfg.hidden_size, dtype=model.dtype, device=r.device)
        defer = kind != "mtp"  # verify: committed after acceptance; draft: provisional positions, never written

        def run():
            for cp in plan.comp.values():
                cp.deferred = [] if defer else None
            greedy = None
            if kind == "verify":
                logits, streams = model.forward(plan, r.cache, return_hidden=True)
            else:
                logits, streams = model.forward_mtp(plan, r.cache, hidden, 0, return_hidden=True)
                greedy = greedy_draws(logits, self.confidences)  # the drafts of greedy requests, in the graph
            return logits, streams, {m: cp.deferred or [] for m, cp in plan.comp.items()}, greedy

        g = SpecGraph(kind, bucket, q, cap, plan, flat, hidden, run)
        if cuda:
            g.graph, (g.logits, g.streams, g.deferred, g.greedy) = r.capture_graph(run, plan)
            g.keep = dict(model._rope_tables)
        if kind == "verify" and r.builder.ratios:
            # the commit's lists at this capacity; the dummy commit keeps position 0 of each sequence (block 0)
            g.commit_flat = torch.empty(r.builder.fill_size(cap), dtype=torch.int64, device=r.device)
            g.commit_lists = r.builder.state_commit(
                StepSeqs(np.zeros(bucket, np.int64), np.ones(bucket, np.int64), np.zeros((bucket, 1), np.int64)),
                np.arange(bucket, dtype=np.int64) * q, checked=True, capacity=cap, out=g.commit_flat)
            if cuda:
                g.commit_graph, _ = r.capture_graph(g._write_state, plan)
        return g

    @torch.inference_mode()
    def profile(self, repeats: int = 3) -> dict[tuple[str, int, int], float]:
        """Time every graph (the best of ``repeats`` replays after one warm-up, over its dummy plan: before any
        request, as at capture) into :attr:`seconds`; returns it."""
        for g in [*self.verify.values(), *self.draft.values(), *self.mtp.values()]:
            self.seconds[(g.kind, g.bucket, g.q)] = best_seconds(g.replay, self.runner.device, repeats)
        return self.seconds

    def step_seconds(self, num_seqs: int, drafts: int, mtp: bool = True) -> float | None:
        """Device seconds of a speculative step of ``num_seqs`` sequences verifying up to ``drafts`` drafts each:
        the verification, ``drafts - 1`` draft-chain forwards and (``mtp``) the MTP pass (from :attr:`seconds`;
        None before :meth:`profile` or past the largest bucket)."""
        b = self.bucket(num_seqs)
        if b is None or not self.seconds:
            return None
        s = self.seconds
        return s[("verify", b, drafts + 1)] + max(drafts - 1, 0) * s[("draft", b, 1)] \
            + (s[("mtp", b, self.k + 1)] if mtp else 0.0)
