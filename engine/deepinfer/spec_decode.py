"""Speculative decoding in the engine: MTP drafts, one target forward verifying them, rollback of rejected positions.

:class:`SpecDecoder` runs every step of a :class:`~deepinfer.model_runner.ModelRunner` when speculation is on
(``EngineConfig.speculative_method = "mtp"``). Per step (design and proofs of the cache rules:
``docs/speculative.md``):

1. the drafter chain: a request decoding with ``k`` drafts holds its first draft (from the previous step) and
   runs the MTP layer ``k - 1`` more times on its own outputs, at positions the step's blocks already cover;
2. one target forward over every request's tokens (a decode: its last token then its drafts), its compressor ring
   state deferred;
3. sampling (requests without drafts, as the plain runner) and acceptance (:mod:`deepinfer.speculative`);
4. the ring state written for the kept positions only;
5. the MTP layer over the kept positions (the target's hidden streams, the next tokens as input): the MTP cache
   of every computed position, and each sampling request's first draft for the next step.

Steps run in order (the engine applies each before scheduling the next). With :class:`~deepinfer.spec_graphs.SpecGraphs`
(CUDA), decode steps replay captured graphs for the three forwards; other steps run eagerly.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from deepinfer.forward_batch import index_tensors
from deepinfer.model_runner import RequestState, host_token
from deepinfer.sampler import MIN_SAMPLING_TEMPERATURE, _log_softmax_normaliser
from deepinfer.scheduler import SchedulerOutput, speculates
from deepinfer.spec_cost import default_step_cost
from deepinfer.spec_graphs import greedy_draws
from deepinfer.spec_schedule import SpecSchedule
from deepinfer.speculative import accept_drafts, draw_drafts, filtered_probs


Row = tuple  # (tensor, row): row ``row`` of a device tensor, read in place (drafts stay on the device)


def gather_rows(refs: list[Row]) -> torch.Tensor:
    """``torch.stack([t[r] for t, r in refs])`` without a kernel per row when the rows share a tensor (the usual
    case: one step's outputs): that tensor, a slice of it, or one indexed gather."""
    src = refs[0][0]
    if all(t is src for t, _ in refs):
        r0 = refs[0][1]
        if all(r == r0 + n for n, (_, r) in enumerate(refs)):
            return src[r0:r0 + len(refs)]
        (idx,) = index_tensors([np.fromiter((r for _, r in refs), np.int64, len(refs))], src.device)
        return src[idx]
    return torch.stack([t[r] for t, r in refs])


def flat_rows(refs: list[Row]) -> tuple[torch.Tensor, list[int]]:
    """1-element rows ``refs`` (at least one) as one flat float64 device tensor (one gather per source tensor,
    nothing read) and ``order``: its element ``n`` is ``refs[order[n]]``."""
    groups: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
    for n, (t, r) in enumerate(refs):
        groups.setdefault(id(t), (t, [], []))[1].append(r)
        groups[id(t)][2].append(n)
    parts, order = [], []
    for t, rows, at in groups.values():
        parts.append(gather_rows([(t, r) for r in rows]).reshape(-1).double())
        order.extend(at)
    return torch.cat(parts), order


class DraftState:
    """A request's drafts: ``tokens[j]`` (a :data:`Row` of a device int64 tensor: drafts are read on the host
    with the verification's results) goes at context position ``position + j``, with the drafter's distribution
    ``probs[j]`` (``[V]`` float32; ``None`` for a greedy request) and confidence ``conf[j]`` (``"confidence"``
    schedule only, else None; a :data:`Row`, read with the step's results: the drafter's probability of its
    token, for a sampled request in expectation over the draw, ``sum_v q(v)^2``, so that no verified length
    depends on a drafted token and sampling stays lossless); ``hidden`` (a :data:`Row` of
    ``[n, hc_mult, hidden]``) the MTP output streams of the row that drafted ``tokens[-1]``."""

    __slots__ = ("position", "tokens", "probs", "conf", "hidden")

    def __init__(self, position: int, token: Row, probs: torch.Tensor | None, conf: float | None, hidden: Row):
        self.position = position
        self.tokens, self.probs, self.conf = [token], [probs], [conf]
        self.hidden = hidden


class SpecStepOutput:
    """A finished speculative step (its results are on the host): what :class:`~deepinfer.model_runner.StepOutput`
    gives the engine. ``result()`` holds, per sampled request in step order, a token (no drafts) or the list of
    tokens its verification emitted (with lists of their logprobs and top logprobs). ``num_decode_tokens``: tokens
    its decodes emitted (the throughput view); ``num_prefill_tokens``: its prefill chunks' tokens."""

    graph = False
    gpu_seconds = 0.0

    def __init__(self, ids: list, logprobs: list, tops: list, t0: float, host_s: float, num_decode_tokens: int,
                 num_prefill_tokens: int):
        self._result = (ids, logprobs, tops, time.perf_counter() - t0)
        self.host_seconds = host_s
        self.num_decode_tokens = num_decode_tokens
        self.num_prefill_tokens = num_prefill_tokens
        self.seq_rows: dict[int, int] = {}

    def result(self) -> tuple[list, list, list, float]:
        return self._result


class SpecStats:
    """Counters of the verifications so far: steps, drafts verified, drafts accepted, accepted per position
    (``accepted_at[j]``: verifications whose draft ``j`` was accepted; ``verified_at[j]``: that verified one)."""

    def __init__(self, k: int) -> None:
        self.plain_steps = 0  # steps run without drafts because verifying would not pay (:meth:`SpecDecoder.pays`)
        self.graph_steps = 0  # speculative steps whose verification replayed a graph
        self.verifications = 0
        self.drafted = 0
        self.accepted = 0
        self.accepted_at = [0] * k
        self.verified_at = [0] * k
        self.first_overheads: dict[int, list[float]] = {}  # per bucket, the first 5 host-time samples (seconds)

    @property
    def acceptance_length(self) -> float:
        """Mean tokens a verification emits (accepted drafts + 1)."""
        return 1.0 + self.accepted / self.verifications if self.verifications else 0.0


class SpecDecoder(SpecSchedule):
    """Speculative steps of ``runner`` (a model with a step plan and an MTP layer: ``forward_mtp``).

    Args:
        runner: the model runner (its requests, block tables, sampler, model and cache).
        num_speculative_tokens: the most drafts a request verifies per step (1 to 5).
        schedule: ``"fixed"`` (verify every scheduled draft) or ``"confidence"`` (per step, the verified lengths
            that maximise expected emitted tokens per unit of :attr:`cost` from the drafts' confidences).
        cost: ``cost(num_seqs, num_tokens) -> float`` of a step (host data only); default :func:`default_step_cost`.
        plain_cost: ``{num_seqs: seconds}`` of a plain decode step per CUDA-graph bucket
            (:func:`profile_plain_steps`), in the units of ``cost``; with it and the ``"confidence"`` schedule,
            :meth:`pays` lets the scheduler run plain steps where verification cannot pay.
        graphs: the step's CUDA graphs (:class:`~deepinfer.spec_graphs.SpecGraphs`), or None (eager); once
            profiled, their replay times are the cost of the steps they run.
    Raises:
        ValueError naming ``speculative_method`` when the model has no MTP layer or step plan, or runs under
        expert parallelism.
    """

    def __init__(self, runner, num_speculative_tokens: int, schedule: str = "confidence", cost=None,
                 plain_cost: dict[int, float] | None = None, graphs=None) -> None:
        self.check_runner(runner)
        self.runner = runner
        self.k = num_speculative_tokens
        self.schedule = schedule
        self.cost = cost or default_step_cost
        self.drafts: dict[int, DraftState] = {}
        self.stats = SpecStats(num_speculative_tokens)
        self.plain_cost = dict(sorted(plain_cost.items())) if plain_cost and schedule == "confidence" else None
        self.graphs = graphs
        self._init_schedule(num_speculative_tokens)
        self._seqs = None  # the running step's StepSeqs (its scheduled positions): each forward takes its rows
        # the last step's deferred ring state: (its verification graph, else its plans' comp; kept positions; row
        # starts)
        self._pending_commit = None

    @staticmethod
    def check_runner(runner) -> None:
        """Raise the ValueError of the class doc when ``runner``'s model cannot speculate (before any profiling)."""
        model = runner.model
        if runner.builder is None or not callable(getattr(model, "forward_mtp", None)) \
                or not len(getattr(model, "mtp", ())):
            raise ValueError(f"EngineConfig.speculative_method: 'mtp' needs a model with an MTP layer and a step plan "
                             f"(DeepSeek-V4); {type(model).__name__} has none")
        if getattr(model, "expert_parallel", None) is not None:  # ranks must run the same forwards per step
            raise ValueError("EngineConfig.speculative_method: not supported with expert parallelism yet (the "
                             "number of MTP forwards per step differs between ranks)")

    def flush_commit(self) -> None:
        """Write the compressor ring state that the last speculative step kept (its verification deferred it:
        rejected positions leave none). The step leaves it pending, so that the next step's draft chain (the MTP
        layer, which reads no ring of the target) reaches the device first; this runs before any other forward
        and before any cache swap (``ModelRunner``). Host lists and device work, no wait."""
        if self._pending_commit is None:
            return
        from deepinfer.models.deepseek_v4.compressor import commit_deferred_state

        g, comp, seqs, row_starts = self._pending_commit
        self._pending_commit = None
        builder = self.runner.builder
        if g is not None:  # the verification graph's captured commit
            g.commit(builder, seqs, row_starts)
            return
        B = builder.block_size
        # a commit keeps at most a block's tokens per sequence: a prompt chunk verified beside drafts commits in
        # parts of B positions, in order
        parts = []
        for off in range(0, max(int(seqs.q.max(initial=0)), 1), B):
            q = np.clip(seqs.q - off, 0, B)
            rows = np.flatnonzero(q)
            part = seqs.at(seqs.c0[rows] + off, q[rows], rows.tolist())
            parts.append(builder.state_commit(part, row_starts[rows] + off, checked=True))
        commit_deferred_state(comp, *parts)

    # ------------------------------------------------------------------------------------------------ helpers
    def _forward_mtp(self, rows: list[int] | None, c0: np.ndarray, q: np.ndarray, ids: list[int] | torch.Tensor,
                     hidden: torch.Tensor, logits_rows: list[int], discard_state: bool = False):
        """The MTP layer over the step's requests ``rows`` (indices into the step; all when None) at positions
        ``[c0[i], c0[i] + q[i])``: ``(logits, streams, greedy)``, ``greedy`` the graph's greedy drafts of the
        logits rows (:func:`~deepinfer.spec_graphs.greedy_draws`; None when the forward ran eagerly)."""
        r = self.runner
        seqs = self._seqs.at(c0, q, rows)
        n = len(c0)
        g = self._graph("draft" if discard_state else "mtp", n, int(q.max()), int((c0 + q).max()))
        if g is not None:
            g.load(r.builder, seqs, ids, logits_rows, checked=True)
            g.hidden[:len(ids)].copy_(hidden)
            g.replay()
            return g.logits[:len(logits_rows)], g.streams[:len(ids)], g.greedy
        plan = r.builder.build(seqs, ids, logits_rows, r.batch_invariant,
                               r.model.step_pad(r.batch_invariant, r.device), checked=True)
        if discard_state:  # a draft chain step: its positions are provisional, the rings keep the kept state
            for cp in plan.comp.values():
                cp.deferred = []
        return (*r.model.forward_mtp(plan, r.cache, hidden, 0, return_hidden=True), None)

    def _draw(self, logits: torch.Tensor, states: list[RequestState], counters: list[int], greedy_pre=None):
        """Drafts for rows of ``logits``: ``(tokens [n] int64, confidences [n] float, distributions)``, all left
        on the device (nothing read); confidences only under the ``"confidence"`` schedule (else None);
        distributions are None for greedy requests. ``greedy_pre``: a draft graph's own greedy draws of these
        rows (:func:`~deepinfer.spec_graphs.greedy_draws`), copied instead of recomputed when every request is
        greedy."""
        r = self.runner
        dev = logits.device
        params = [st.params for st in states]
        confident = self.schedule == "confidence"
        n = len(states)
        if all(p.temperature < MIN_SAMPLING_TEMPERATURE for p in params):  # greedy only: no distribution to keep
            if greedy_pre is not None and (greedy_pre[1] is not None or not confident):
                # copies: the graph's outputs are rewritten by its next replay
                return (greedy_pre[0][:n].clone(), greedy_pre[1][:n].clone() if confident else None, [None] * n)
            tokens, conf = greedy_draws(logits, confident)
            return tokens, conf, [None] * n
        temp = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev)
        probs = filtered_probs(logits, temp, torch.tensor([p.top_k for p in params], dtype=torch.int64, device=dev),
                               torch.tensor([p.top_p for p in params], dtype=torch.float32, device=dev),
                               r.batch_invariant)
        greedy_h = [p.temperature < MIN_SAMPLING_TEMPERATURE for p in params]
        greedy = temp < MIN_SAMPLING_TEMPERATURE
        seeds = torch.tensor([st.seed for st in states], dtype=torch.int64, device=dev)
        tokens, _ = draw_drafts(probs, greedy, seeds, torch.tensor(counters, dtype=torch.int64, device=dev))
        keep = [None if g else probs[i] for i, g in enumerate(greedy_h)]
        if not confident:
            return tokens, None, keep
        # the confidence the schedule reads must not depend on the draw itself (docs/speculative.md): a sampled
        # draft's is its probability in expectation over the draw, sum_v q(v)^2; a greedy draft's the drafter's
        # softmax probability of its argmax
        conf = (probs * probs).sum(-1)
        if any(greedy_h):
            top = torch.softmax(logits.float(), dim=-1).gather(1, tokens[:, None]).squeeze(1)
            conf = torch.where(greedy, top, conf)
        return tokens, conf, keep

    def _chain(self, items, states, nv: list[int]) -> None:
        """Extend each request's drafts to ``nv[i]`` tokens with the MTP layer on its own outputs."""
        for j in range(2, max(nv, default=0) + 1):
            sel = [i for i, k in enumerate(nv) if k >= j and len(self.drafts[items[i].req_id].tokens) < j]
            if not sel:
                continue
            ds = [self.drafts[items[i].req_id] for i in sel]
            sts = [states[i] for i in sel]
            # the MTP row at position t takes token t + 1 and predicts t + 2: the next draft
            c0 = np.array([items[i].start + j - 2 for i in sel], dtype=np.int64)
            logits, streams, pre = self._forward_mtp(sel, c0, np.ones(len(sel), dtype=np.int64),
                                                     gather_rows([d.tokens[j - 2] for d in ds]),
                                                     gather_rows([d.hidden for d in ds]), list(range(len(sel))),
                                                     discard_state=True)
            toks, conf, probs = self._draw(logits, sts, [int(c) + 2 - st.num_prompt_tokens for c, st in zip(c0, sts)],
                                           pre)
            hs = streams[:len(sel)].clone()  # a graph's output buffer: the next replay rewrites it
            for n, d in enumerate(ds):
                d.tokens.append((toks, n))
                d.conf.append(None if conf is None else (conf, n))
                d.probs.append(probs[n])
                d.hidden = (hs, n)

    def _graph_step(self, items) -> bool:
        """Whether the step's verification can replay a graph: every request decodes (one token and its drafts),
        within the largest bucket and the graphs' context."""
        g = self.graphs
        r = self.runner
        return (g is not None and g.bucket(len(items)) is not None
                and all(it.num_new_tokens - it.num_draft_tokens == 1 and it.needs_logits
                        and it.start >= r.requests[it.req_id].num_prompt_tokens
                        and it.start + it.num_new_tokens <= g.max_len for it in items))

    def _graph(self, kind: str, n: int, q: int, end: int):
        """The :class:`~deepinfer.spec_graphs.SpecGraph` of ``kind`` for ``n`` sequences of up to ``q`` tokens
        ending by ``end``, or None (eager)."""
        g = self.graphs
        b = None if g is None or end > g.max_len else g.bucket(n)
        if b is None:
            return None
        if kind == "verify":
            return g.verify.get((b, q))
        return (g.draft if kind == "draft" else g.mtp).get(b) if q <= (1 if kind == "draft" else g.k + 1) \
            else None

    # ------------------------------------------------------------------------------------------------ the step
    @torch.inference_mode()
    def execute(self, output: SchedulerOutput) -> SpecStepOutput:
        """Run one scheduled step to its end (synchronises): drafts, verification, rollback, next drafts."""
        t0 = time.perf_counter()
        r = self.runner
        r.update_states(output)
        # finished or preempted requests leave (also in steps that scheduled nothing)
        for kept_per_request in (self.drafts, self.confidences, self._cal_bins, self._dropped):
            for rid in [rid for rid in kept_per_request if rid not in r.requests]:
                del kept_per_request[rid]
        items = output.scheduled
        if not items:
            raise RuntimeError("ModelRunner.execute: the scheduler output schedules nothing")
        states = [r.requests[it.req_id] for it in items]
        c0 = np.fromiter((it.start for it in items), np.int64, len(items))
        # every forward of the step (draft chain, verification, MTP pass, commit) computes positions inside the
        # scheduled ones over the same tables: one check of those covers them all
        self._seqs = r.step_seqs(states, c0, np.fromiter((it.num_new_tokens for it in items), np.int64, len(items)))
        r.builder.check_arrays(self._seqs)
        nv = []
        for it, st in zip(items, states):
            ds = self.drafts.get(it.req_id)
            ok = it.num_draft_tokens and ds is not None and ds.position == it.start + 1 == len(st.token_ids)
            nv.append(it.num_draft_tokens if ok else 0)
        nv = self._lengths(items, nv)
        self._chain(items, states, nv)  # the MTP layer reads no ring of the target: the last step's commit waits
        self.flush_commit()

        # 2. the target over every request's tokens: a verification's last token and drafts
        n_base = [it.num_new_tokens - it.num_draft_tokens for it in items]
        q = np.array([b + k for b, k in zip(n_base, nv)], dtype=np.int64)
        row_starts = np.cumsum(q) - q
        ids: list[int] = []
        logits_rows: list[int] = []
        draft_rows: list[int] = []  # token rows of the drafts, in step order
        draft_at: list[int] = []  # per request, the token row of its first draft
        drafts: list[Row] = []
        for it, st, b, k in zip(items, states, n_base, nv):
            ids.extend(st.token_ids[it.start:it.start + b])
            draft_at.append(len(ids))
            if k:
                draft_rows.extend(range(len(ids), len(ids) + k))
                drafts.extend(self.drafts[it.req_id].tokens[:k])
                ids.extend([0] * k)
            if it.needs_logits:
                logits_rows.extend(range(len(ids) - k - 1, len(ids)))
        if len(ids) != int(q.sum()):
            raise RuntimeError("SpecDecoder: a scheduled token's id is not on the host (steps must run in order)")
        if drafts:  # the drafts never left the device: the step's ids are uploaded, then the drafts put in
            r.builder.check_ids(ids)
            ids_t, rows_t = index_tensors([np.asarray(ids, dtype=np.int64), np.asarray(draft_rows, dtype=np.int64)],
                                          r.device)
            ids_t[rows_t] = gather_rows(drafts)
            ids = ids_t
        seqs = self._seqs.at(c0, q)
        g = self._graph("verify", len(items), int(q.max()), int((c0 + q).max())) if self._graph_step(items) \
            else None
        deferred = any(nv) or g is not None  # a verification graph always defers
        if g is not None:
            g.load(r.builder, seqs, ids, logits_rows, checked=True)
            g.replay()
            logits, streams, comp = g.logits[:len(logits_rows)], g.streams, None  # its commit: SpecGraph.commit
        else:
            plan = r.builder.build(seqs, ids, logits_rows, r.batch_invariant,
                                   r.model.step_pad(r.batch_invariant, r.device), checked=True)
            if deferred:
                for cp in plan.comp.values():
                    cp.deferred = []
            logits, streams = r.model.forward(plan, r.cache, return_hidden=True)
            comp = plan.comp

        # 3. sampling: one draw per logits row (a verification's rows are the positions after each of its drafts)
        row_states: list[RequestState] = []
        counters: list[int] = []
        for it, st, k in zip(items, states, nv):
            if it.needs_logits:
                first = int(it.start) + it.num_new_tokens - it.num_draft_tokens - st.num_prompt_tokens
                row_states.extend([st] * (k + 1))
                counters.extend(range(first, first + k + 1))
        masks = r._grammar_masks(row_states, logits.shape[1]) if row_states else None
        # a decode step runs its MTP pass over every row while the host waits for the step's read
        early = (lambda mtp_ids: self._mtp_rows(states, c0, q, mtp_ids, streams)) \
            if self._mtp_early(items, states, n_base) else None
        ids_out, lps_out, tops_out, kept, pre = self._sample(items, states, nv, logits, row_states, counters, masks,
                                                             ids if drafts else None, draft_at, early)

        # 4. the ring state of the kept positions only: written before the target's next forward (flush_commit)
        if deferred:
            self._pending_commit = (g, comp, self._seqs.at(c0, np.array(kept, dtype=np.int64)), row_starts)

        # 5. the MTP layer over the kept positions (run before the read in a decode step); the next first drafts
        if pre is not None:
            self._keep_drafts(items, states, c0, kept, row_starts, pre)
        else:
            self._mtp_pass(items, states, c0, kept, row_starts, streams)
        decode = [it.start >= st.num_prompt_tokens and b == 1 for it, st, b in zip(items, states, n_base)]
        # a decode emits its kept positions' worth of tokens (1 + accepted drafts)
        n_decode = sum(k for k, d in zip(kept, decode) if d)
        n_prefill = sum(it.num_new_tokens for it, d in zip(items, decode) if not d)
        out = SpecStepOutput(ids_out, lps_out, tops_out, t0, time.perf_counter() - t0, n_decode, n_prefill)
        out.graph = g is not None
        self.stats.graph_steps += out.graph
        self._measure(nv, kept, n_base)
        if self._cal_bins:
            self._calibrate(items, nv, kept, n_base)
        self.mark_step(items, "spec", g.bucket if g is not None else None, max(nv), t0)
        return out

    def _sample(self, items, states, nv, logits, row_states, counters, masks, ids: torch.Tensor | None,
                draft_at: list[int], before_read=None):
        """Draws and acceptance: per sampled request its token(s), logprob(s) and top logprobs (in step order),
        per request the positions it keeps (``q`` of a request without drafts, 1 + accepted drafts else), and what
        ``before_read(mtp_ids)`` returned (None without it). ``ids``: the step's token ids on the device when it
        verifies drafts (request ``i``'s from token row ``draft_at[i]``). ``before_read`` is device work enqueued
        before the step's one read is waited for; ``mtp_ids`` ``[rows]`` int64 holds, per logits row, the token
        the step emits after it (where the row is kept)."""
        r = self.runner
        kept = [it.num_new_tokens - it.num_draft_tokens + k for it, k in zip(items, nv)]
        if not row_states:
            return [], [], [], kept, None
        base, base_lp, tops = r.sampler.sample_device(logits, row_states, counters, masks)
        # the confidences of this step's drafts, read with its results (the next step's choice: no read of its own)
        conf_refs, conf_of = [], []  # conf_of: (item, its first index in conf_refs)
        if self.schedule == "confidence":
            for i, (it, k) in enumerate(zip(items, nv)):
                d = self.drafts.get(it.req_id)
                if it.needs_logits and d is not None and d.position == it.start + 1 and d.conf[0] is not None:
                    conf_of.append((i, len(conf_refs)))
                    conf_refs.extend(d.conf[:max(k, 1)])
        conf_t, conf_order = flat_rows(conf_refs) if conf_refs else (None, [])
        m = len(conf_refs)  # the read's first m values
        parts = ([conf_t] if conf_refs else []) + [base.double(), base_lp.double()]
        spec_items = [i for i, (it, k) in enumerate(zip(items, nv)) if it.needs_logits and k]
        # greedy verifications accept on the host from the sampler's argmax (the read below): no device work
        greedy = all(states[i].params.temperature < MIN_SAMPLING_TEMPERATURE for i in spec_items)
        mtp_ids = base
        if spec_items and greedy:  # the drafts come with the read
            parts.append(ids.double())
        elif spec_items:
            packed, mtp_ids = self._accept(items, states, nv, logits, base, counters, spec_items, ids, draft_at)
            parts.append(packed.reshape(-1))
        flat, pre = _read(parts, before_read, mtp_ids)  # one read
        n = base.shape[0]
        conf_h, flat = flat[:m], flat[m:]
        base_h, base_lp_h, rest = [int(t) for t in flat[:n]], flat[n:2 * n], flat[2 * n:]
        emitted = {}
        if spec_items and greedy:
            drafts_h = [[int(t) for t in rest[draft_at[i]:draft_at[i] + nv[i]]] for i in spec_items]
            emitted = self._accept_greedy(items, nv, spec_items, base_h, base_lp_h, drafts_h)
        elif spec_items:
            K = max(nv[i] for i in spec_items)
            w = 2 * K + 3
            got = []
            for a in range(len(spec_items)):
                row = rest[a * w:(a + 1) * w]
                e = int(row[K + 1])
                got.append(([int(t) for t in row[:e]], row[K + 2:K + 2 + e]))
            emitted = self._record(nv, spec_items, got)
        vals = [0.0] * len(conf_refs)
        for at, v in zip(conf_order, conf_h):
            vals[at] = v
        for i, a in conf_of:
            self.confidences[items[i].req_id] = vals[a:a + self._seen(nv[i], len(emitted[i][0]) if i in emitted
                                                                       else None)]
        ids_out, lps_out, tops_out = [], [], []
        row = 0
        for i, (it, st, k) in enumerate(zip(items, states, nv)):
            if not it.needs_logits:
                continue
            if i not in emitted:  # no drafts: one token, as the plain runner
                ids_out.append([host_token(st, base_h[row])] if it.num_draft_tokens else host_token(st, base_h[row]))
                lps_out.append([base_lp_h[row]] if it.num_draft_tokens else base_lp_h[row])
                tops_out.append([tops[row]] if it.num_draft_tokens else tops[row])
            else:
                toks, lps = emitted[i]
                for t in toks:
                    if t >= 0:
                        st.token_ids.append(t)
                ids_out.append(toks)
                lps_out.append(lps)
                tops_out.append(tops[row:row + len(toks)])
                kept[i] = it.num_new_tokens - it.num_draft_tokens + len(toks) - 1
            row += k + 1
        return ids_out, lps_out, tops_out, kept, pre

    def _accept(self, items, states, nv, logits, base, counters, spec_items, ids: torch.Tensor,
                draft_at: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`~deepinfer.speculative.accept_drafts` over the requests ``spec_items`` (some of them sampled;
        drafts read from the step's device ``ids`` at ``draft_at``), on the device: per request of ``spec_items``
        a float64 row of ``2 K + 3`` values (its ``K + 1`` tokens, ``-1`` past the emitted ones, their count, their
        logprobs; ``K`` the most drafts), and ``base`` with each verification's rows replaced by its emitted
        tokens (the MTP pass's inputs)."""
        r = self.runner
        dev = logits.device
        K = max(nv[i] for i in spec_items)
        V = logits.shape[1]
        first_row = {}
        row = 0
        for i, (it, k) in enumerate(zip(items, nv)):
            if it.needs_logits:
                first_row[i] = row
                row += k + 1
        n = len(spec_items)
        base_rows = np.zeros((n, K + 1), dtype=np.int64)
        draft_t = np.zeros((n, K), dtype=np.int64)
        num_d = np.zeros(n, dtype=np.int64)
        sampled = []
        for a, i in enumerate(spec_items):
            k = nv[i]
            base_rows[a, :k + 1] = np.arange(first_row[i], first_row[i] + k + 1)
            draft_t[a, :k] = np.arange(draft_at[i], draft_at[i] + k)  # token rows, read below
            num_d[a] = k
            sampled.append(states[i].params.temperature >= MIN_SAMPLING_TEMPERATURE)
        # one host-to-device copy
        base_rows, draft_t, num_d, sampled_t = index_tensors([base_rows.reshape(-1), draft_t.reshape(-1), num_d,
                                                              np.array(sampled, dtype=np.int64)], dev)
        base_rows, draft_t, sampled_t = base_rows.view(n, K + 1), ids[draft_t].view(n, K), sampled_t.bool()
        base_tok = base[base_rows]
        target_p = draft_p = seeds = ctr = None
        srows = [a for a, s in enumerate(sampled) if s]
        if srows:
            m = len(srows)
            sel = base_rows[srows][:, :K].reshape(-1)
            st_rows = [states[spec_items[a]] for a in srows for _ in range(K)]
            temp = torch.tensor([s.params.temperature for s in st_rows], dtype=torch.float32, device=dev)
            top_k = torch.tensor([s.params.top_k for s in st_rows], dtype=torch.int64, device=dev)
            top_p = torch.tensor([s.params.top_p for s in st_rows], dtype=torch.float32, device=dev)
            target_p = filtered_probs(logits[sel], temp, top_k, top_p, r.batch_invariant).view(m, K, V)
            draft_p = torch.zeros((m, K, V), dtype=torch.float32, device=dev)
            for b, a in enumerate(srows):
                ps = self.drafts[items[spec_items[a]].req_id].probs
                for j in range(nv[spec_items[a]]):
                    draft_p[b, j] = ps[j]
            seeds = torch.tensor([states[spec_items[a]].seed for a in srows], dtype=torch.int64, device=dev)
            ctr = torch.tensor([counters[first_row[spec_items[a]]] for a in srows], dtype=torch.int64, device=dev)
        tokens, n_emit = accept_drafts(base_tok, draft_t, num_d, sampled_t, target_p, draft_p, seeds, ctr)
        raw = logits[base_rows.reshape(-1)].float()
        lse = _log_softmax_normaliser(raw).view(n, K + 1)
        tok_lp = raw.view(n, K + 1, V).gather(2, tokens.clamp(min=0)[:, :, None]).squeeze(2) - lse
        # past a row's emitted tokens its index points at a spare slot, dropped after the scatter
        N = base.shape[0]
        spare = torch.full_like(base_rows, N)
        col = torch.arange(K + 1, device=dev)
        rows = torch.where(col[None, :] <= num_d[:, None], base_rows, spare)
        emitted_ids = torch.cat([base, base.new_zeros(1)]).scatter_(0, rows.reshape(-1), tokens.reshape(-1))[:N]
        # tokens, counts and logprobs as float64 (token ids are exact there), read with the step's other results
        return torch.cat([tokens.double(), n_emit.double()[:, None], tok_lp.double()], dim=1), emitted_ids

    def _accept_greedy(self, items, nv, spec_items, base_h: list[int], base_lp_h: list[float],
                       drafts: list[list[int]]) -> dict:
        """:meth:`_accept` for greedy verifications, on the host: the longest prefix of ``drafts`` (per request of
        ``spec_items``) equal to the sampler's argmax at their rows (``base_h``), then the argmax after it; the
        sampler's logprobs."""
        first_row, row = {}, 0
        for i, (it, k) in enumerate(zip(items, nv)):
            if it.needs_logits:
                first_row[i] = row
                row += k + 1
        got = []
        for i, d in zip(spec_items, drafts):
            f = first_row[i]
            a = 0
            while a < nv[i] and d[a] == base_h[f + a]:
                a += 1
            got.append((base_h[f:f + a + 1], base_lp_h[f:f + a + 1]))
        return self._record(nv, spec_items, got)

    def _record(self, nv, spec_items, got: list[tuple[list, list]]) -> dict[int, tuple[list, list]]:
        """``{item: (tokens, logprobs)}`` from each verification's emitted tokens (cut after a NaN row, whose
        token becomes ``-1``), counted in :attr:`stats`."""
        out = {}
        for i, (toks, lps) in zip(spec_items, got):
            for j, lp in enumerate(lps):
                if lp != lp:  # NaN logits at this position: the request fails there
                    toks, lps = toks[:j] + [-1], lps[:j + 1]
                    break
            out[i] = (toks, lps)
            self.stats.verifications += 1
            self.stats.drafted += nv[i]
            acc = len(toks) - 1
            self.stats.accepted += acc
            for j in range(nv[i]):
                self.stats.verified_at[j] += 1
                self.stats.accepted_at[j] += int(j < acc)
        return out

    def _mtp_pass(self, items, states, c0, kept, row_starts, streams) -> None:
        """The MTP layer over each speculating request's kept positions (input: the token after each), and the
        first draft of every request that sampled."""
        sel = [i for i, (it, st) in enumerate(zip(items, states))
               if speculates(st.params) and len(st.token_ids) > c0[i] + kept[i]]
        for i, it in enumerate(items):
            if it.needs_logits:
                self.drafts.pop(it.req_id, None)
        if not sel:
            return
        sts = [states[i] for i in sel]
        c = c0[sel]
        q = np.array([kept[i] for i in sel], dtype=np.int64)
        ids: list[int] = []
        rows: list[int] = []
        logits_rows: list[int] = []
        drafting = []
        for i, st, ci, qi in zip(sel, sts, c.tolist(), q.tolist()):
            ids.extend(st.token_ids[ci + 1:ci + qi + 1])
            rows.extend(range(int(row_starts[i]), int(row_starts[i]) + qi))
            if items[i].needs_logits:
                logits_rows.append(len(ids) - 1)
                drafting.append(i)
        (rows_t,) = index_tensors([np.asarray(rows, dtype=np.int64)], streams.device)  # no wait for the device
        logits, mtp_streams, pre = self._forward_mtp(sel, c, q, ids, streams[rows_t], logits_rows)
        if not drafting:
            return
        dst = [states[i] for i in drafting]
        # the first draft goes at position c0 + kept + 1: the token after the next step's input
        pos = [int(c0[i]) + kept[i] + 1 for i in drafting]
        toks, conf, probs = self._draw(logits, dst, [p - st.num_prompt_tokens for p, st in zip(pos, dst)], pre)
        (at,) = index_tensors([np.asarray(logits_rows, dtype=np.int64)], mtp_streams.device)
        hs = mtp_streams[at]  # a copy: the graph's buffer is rewritten by its next replay
        for n, (i, p) in enumerate(zip(drafting, pos)):
            self.drafts[items[i].req_id] = DraftState(p, (toks, n), probs[n], None if conf is None else (conf, n),
                                                      (hs, n))


    def _mtp_early(self, items, states, n_base) -> bool:
        """Whether the MTP pass can run before the step's read, over every verification row: every request
        decodes (one token and its drafts, with logits) and speculates, and the MTP layer attends its window only
        (a row past the kept ones writes window KV alone, which a later step overwrites before reading it)."""
        if any(getattr(self.runner.model.config, "mtp_compress_ratios", ())[:1]):
            return False
        return all(b == 1 and it.needs_logits and it.start >= st.num_prompt_tokens and speculates(st.params)
                   for it, st, b in zip(items, states, n_base))

    def _mtp_rows(self, states, c0, q, mtp_ids: torch.Tensor, streams: torch.Tensor):
        """The MTP layer over all ``q[i]`` rows of each request's verification from ``c0[i]`` (row ``t``'s input:
        ``mtp_ids[t]``, the token the step emits after it) and a draft per row, all left on the device:
        ``(tokens, confidences, distributions, streams)`` (:meth:`_draw`); :meth:`_keep_drafts` keeps the row of
        each request's last kept position."""
        n = int(q.sum())
        logits, mtp_streams, pre = self._forward_mtp(None, c0, q, mtp_ids[:n].clamp(min=0), streams[:n],
                                                     list(range(n)))
        row_states = [st for st, k in zip(states, q.tolist()) for _ in range(k)]
        # row t's draft goes at position c0 + t + 2 (the token after the next step's input)
        counters = [c + t + 2 - st.num_prompt_tokens for st, c, k in zip(states, c0.tolist(), q.tolist())
                    for t in range(k)]
        toks, conf, probs = self._draw(logits, row_states, counters, pre)
        return toks, conf, probs, mtp_streams

    def _keep_drafts(self, items, states, c0, kept, row_starts, pre) -> None:
        """The next first drafts from :meth:`_mtp_rows`'s results ``pre``: the row of each request's last kept
        position, for each request that sampled a token."""
        toks, conf, probs, mtp_streams = pre
        for it in items:
            self.drafts.pop(it.req_id, None)
        who = [i for i, st in enumerate(states) if len(st.token_ids) > c0[i] + kept[i]]
        if not who:
            return
        rows = [int(row_starts[i]) + kept[i] - 1 for i in who]
        (at,) = index_tensors([np.asarray(rows, dtype=np.int64)], toks.device)
        # copies: the graph's buffers are rewritten by its next replay
        tk, hs, cf = toks[at], mtp_streams[at], None if conf is None else conf[at]
        for n, (i, row) in enumerate(zip(who, rows)):
            self.drafts[items[i].req_id] = DraftState(int(c0[i]) + kept[i] + 1, (tk, n), probs[row],
                                                      None if cf is None else (cf, n), (hs, n))


def _read(parts: list[torch.Tensor], before_read, mtp_ids: torch.Tensor) -> tuple[list[float], object]:
    """The float64 concatenation of ``parts`` on the host (one read) and what ``before_read(mtp_ids)`` returned
    (None without it): on CUDA its work is enqueued after the copy, so that it runs while the host waits."""
    flat = torch.cat(parts)
    if before_read is None:
        return flat.tolist(), None
    if flat.device.type != "cuda":
        return flat.tolist(), before_read(mtp_ids)
    host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
    host.copy_(flat, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    pre = before_read(mtp_ids)
    done.synchronize()
    return host.tolist(), pre
