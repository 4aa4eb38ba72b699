"""The confidence schedule of speculative decoding: whether a step verifies drafts at all
(:meth:`SpecSchedule.pays`) and how many per request (:meth:`SpecSchedule._lengths`), from host data only. Its
inputs are measured as steps run: graph step periods past their replays, plain step periods, acceptance per draft
position, and the drafts' confidences calibrated by acceptance. :class:`~deepinfer.spec_decode.SpecDecoder` runs
the steps; the rules and their reasons are in ``docs/speculative.md``.
"""

from __future__ import annotations

from deepinfer.spec_cost import CostByLongest, CostByTokens, choose_lengths


class SpecSchedule:
    """The schedule's state and rules, mixed into :class:`~deepinfer.spec_decode.SpecDecoder` (which sets
    ``k``, ``schedule``, ``cost``, ``plain_cost``, ``graphs``, ``stats`` and ``runner``, and calls
    :meth:`_init_schedule`)."""

    def _init_schedule(self, k: int) -> None:
        # measured: seconds a graph step takes past its graphs' replay times (the last few per bucket), and per
        # draft position the rate at which a verified draft is accepted once the ones before it were
        # (:meth:`_measure`; None: not measured yet, counted as 1)
        self.overhead_samples: dict[int, list[float]] = {}
        self._overhead: dict[int, float] = {}  # robust figure of each bucket's samples (:func:`robust_seconds`)
        # per decode-graph bucket, the seconds between the starts of consecutive plain graph steps of the same
        # requests (the last five; with asynchronous scheduling, a plain step's cost host time included)
        self.plain_samples: dict[int, list[float]] = {}
        self._plain: dict[int, float] = {}
        self._last: tuple | None = None  # the last step started: (kind, bucket, drafts, t0, request ids)
        self.accept_rate: list[float | None] = [None] * k
        # per draft position, the decayed counts behind accept_rate (:meth:`_measure`)
        self._accepted = [0.0] * k
        self._verified = [0.0] * k
        self._refused: dict[int, int] = {}
        self._probing: dict[int, int] = {}  # per bucket, the speculative steps a probe still runs
        # per graph bucket, the decayed ratio of the choice's expected tokens per second to a plain step's
        # (:meth:`_note_gain`; 1 or below: the choices stopped paying)
        self._gain: dict[int, float] = {}
        # per request, the confidences of its last step's drafts that the next choice may read (:meth:`_seen`)
        self.confidences: dict[int, list[float]] = {}
        # calibration of those confidences (:meth:`calibrated`): per draft depth and confidence bin, the decayed
        # counts of drafts verified there (the ones before them accepted) and accepted; per request, the bins its
        # running step's choice read
        self._cal_verified = [[0.0] * self.CAL_BINS for _ in range(k)]
        self._cal_accepted = [[0.0] * self.CAL_BINS for _ in range(k)]
        self._cal_bins: dict[int, list[int]] = {}
        # per request, the choices that verified fewer of its drafts than it made room for (:meth:`_explore`)
        self._dropped: dict[int, int] = {}

    def pays(self, num_seqs: int) -> bool:
        """Whether a speculative step can beat a plain one at ``num_seqs`` sequences (host data only).

        With profiled graphs: for some draft count ``d``, the tokens a verification of ``d`` drafts is expected to
        emit (:meth:`expected_emitted`) per second of a graph step (:meth:`graph_step_seconds`) beat one token per
        plain step (:meth:`plain_step_seconds`), and the bucket's recent choices paid (:meth:`_note_gain`); false
        past the largest speculation bucket. Both sides are measured the same way once steps ran: the time from
        a step's start to the next one's. At a refused bucket the :attr:`FIRST_PROBE` th refusal starts a probe
        instead, then the one after twice as many, and so on: :attr:`PROBE_STEPS` speculative steps (the first
        verifies no draft), which measure that bucket's speculative steps; a slow first step must not switch
        speculation off for good. No probe where the replays alone already lose (host time only adds). Without
        graphs: verifying ``k`` drafts each (``cost``) takes less than ``1 + k`` plain steps, the most a
        verification can emit. True without ``plain_cost`` or past its largest bucket (plain steps run eagerly
        there too)."""
        if self.estimate_pays(num_seqs):
            return True
        g = self.graphs
        b = g.bucket(num_seqs) if g is not None and g.seconds else None
        if b is None or not self._could_pay(num_seqs):  # a probe only measures host time, which only adds
            return False
        if self._probing.get(b):
            self._probing[b] -= 1
            return True
        n = self._refused[b] = self._refused.get(b, 0) + 1
        if n >= self.FIRST_PROBE and n & (n - 1) == 0:  # FIRST_PROBE, then every doubling
            self._probing[b] = self.PROBE_STEPS - 1
            return True
        return False

    def estimate_pays(self, num_seqs: int) -> bool:
        """:meth:`pays` from the estimates alone (no probe; nothing changes)."""
        if self.plain_cost is None:
            return True
        plain = self.plain_step_seconds(num_seqs)
        if plain is None:
            return True
        if self.graphs is not None and self.graphs.seconds:
            b = self.graphs.bucket(num_seqs)
            if b is None or self._gain.get(b, self.GAIN_PRIOR) <= 1.0:
                return False
            return any(self.expected_emitted(d) * plain > self.graph_step_seconds(num_seqs, d)
                       for d in range(1, self.k + 1))
        return self.cost(num_seqs, num_seqs * (1 + self.k)) < (1 + self.k) * plain

    def _could_pay(self, num_seqs: int) -> bool:
        """Whether a speculative step could beat a plain one at ``num_seqs`` sequences with no host time past
        its graphs' replays (the least it can take)."""
        plain = self.plain_step_seconds(num_seqs)
        return any(self.expected_emitted(d) * plain > self.graphs.step_seconds(num_seqs, d)
                   for d in range(1, self.k + 1))

    def plain_step_seconds(self, num_seqs: int) -> float | None:
        """Seconds of a plain decode step of ``num_seqs`` sequences at the smallest decode-graph bucket holding
        them: measured from step start to step start (:attr:`plain_samples`, :func:`robust_seconds`) once such
        steps ran (with profiled speculation graphs only), else the bucket's replay time (``plain_cost``, no host
        time: it under-rates speculation), and never more than a measured graph step verifying no draft at that
        batch, its MTP pass left out (a plain step's work and more: a slow plain sample must not make speculation
        look cheap for good, since plain steps then stop running and measuring). None past the largest bucket or
        without ``plain_cost``."""
        if self.plain_cost is None:
            return None
        b = next((b for b in self.plain_cost if b >= num_seqs), None)
        if b is None:
            return None
        sec = self._plain.get(b, self.plain_cost[b])
        g = self.graphs
        over = self._overhead.get(g.bucket(num_seqs)) if g is not None and g.seconds else None
        return sec if over is None else min(sec, g.step_seconds(num_seqs, 0, mtp=False) + over)

    def mark_step(self, items, kind: str, bucket: int | None, drafts: int, t0: float) -> None:
        """Note that a step started at ``t0`` (``time.perf_counter()``): ``kind`` ``"plain"`` or ``"spec"``, its
        CUDA-graph ``bucket`` (None: eager, not measured) and the most drafts it verifies. The previous step gets
        a sample when it was a graph step of the same requests (no idle time or batch change between them): a
        plain one its period when this step is plain too (:attr:`plain_samples`; a plain step after it runs
        overlapped), a speculative one its period minus its graphs' replay times (:attr:`overhead_samples`)."""
        if self.graphs is None or not self.graphs.seconds:  # the cost-table rule compares device times only
            return
        ids = tuple(it.req_id for it in items)
        prev, self._last = self._last, (kind, bucket, drafts, t0, ids) if bucket is not None else None
        if prev is None or prev[4] != ids:
            return
        prev_kind, b, d, start, _ = prev
        period = t0 - start
        if prev_kind == "plain":
            if kind == "plain":
                self._plain[b] = _add_sample(self.plain_samples.setdefault(b, []), period)
            return
        sec = self.graphs.step_seconds(len(ids), d)
        if sec is None:
            return
        samples = self.overhead_samples.setdefault(b, [])
        first = self.stats.first_overheads.setdefault(b, [])
        self._overhead[b] = _add_sample(samples, max(period - sec, 0.0))
        if len(first) < 5:
            first.append(samples[-1])

    FIRST_PROBE = 8  # a power of two
    PROBE_STEPS = 3

    def expected_emitted(self, drafts: int) -> float:
        """Tokens a verification of ``drafts`` drafts emits in expectation: ``1 + sum_i prod_{j <= i} a_j`` over
        the measured acceptance rates ``a_j`` (:attr:`accept_rate`; 1 where not measured)."""
        out, s = 1.0, 1.0
        for a in self.accept_rate[:drafts]:
            s *= 1.0 if a is None else a
            out += s
        return out

    def graph_step_seconds(self, num_seqs: int, drafts: int) -> float | None:
        """Seconds of a graph step of ``num_seqs`` sequences verifying up to ``drafts`` drafts each, from its start
        to the next step's: the graphs' replay times (:meth:`~deepinfer.spec_graphs.SpecGraphs.step_seconds`) plus
        the time measured past them at its bucket (:meth:`mark_step`, :func:`robust_seconds`); at a bucket not
        measured yet, the largest of the other buckets' figures, each scaled by ``sqrt(bucket / theirs)`` when
        theirs is smaller (host time grows with the batch, ``docs/speculative.md``); 0 before any. None without
        profiled graphs for that batch."""
        sec = self.graphs.step_seconds(num_seqs, drafts) if self.graphs is not None else None
        if sec is None:
            return None
        b = self.graphs.bucket(num_seqs)
        if b in self._overhead:
            return sec + self._overhead[b]
        return sec + max((o * max(1.0, (b / m) ** 0.5) for m, o in self._overhead.items()), default=0.0)

    def _lengths(self, items, nv: list[int]) -> list[int]:
        """Drafts to make and verify per request, before the chain, from host data only (no read): all of the
        scheduled ``nv`` (``"fixed"``), or :func:`choose_lengths` of each request's expected confidences
        (:meth:`expected_confidences`)."""
        if self.schedule == "fixed" or not any(nv):
            return nv
        confs = [self.expected_confidences(it.req_id, k) for it, k in zip(items, nv)]
        for it in items:  # the bins this choice reads, counted once the step is verified (_calibrate)
            seen = self.confidences.get(it.req_id)
            if seen:
                self._cal_bins[it.req_id] = [self._bin(c) for c in seen]
        cost = self._step_cost(items)
        lengths, rate = choose_lengths(confs, cost)
        # a choice read no confidence of its own (a request's first drafts) is no evidence of what choices pay
        if isinstance(cost, CostByLongest) and any(self.confidences.get(it.req_id) for it in items):
            self._note_gain(len(items), rate)
        return self._explore(items, nv, lengths) if isinstance(cost, CostByLongest) else lengths

    #: every this many choices that verify fewer of a request's drafts than it made room for, one verifies them all
    EXPLORE_EVERY = 8

    def _explore(self, items, nv: list[int], lengths: list[int]) -> list[int]:
        """``lengths`` with, per request, every :attr:`EXPLORE_EVERY` th choice that dropped some of its ``nv``
        drafts verifying them all instead, at a graph step (the caller's test) while its bucket's choices pay
        (:attr:`_gain` above 1; probes never explore). Without it a confidence bin the choice stops verifying keeps
        its prior, the raw confidence, which underrates the target (:meth:`calibrated`), and is never measured again
        (``docs/speculative.md``, "On the H200"). The choice still reads past steps only (counts on the host), so
        sampling stays lossless."""
        if self._gain.get(self.graphs.bucket(len(items)), self.GAIN_PRIOR) <= 1.0:
            return lengths
        out = list(lengths)
        for i, (it, k, d) in enumerate(zip(items, nv, lengths)):
            if d >= k or not self.confidences.get(it.req_id):
                continue
            n = self._dropped[it.req_id] = self._dropped.get(it.req_id, 0) + 1
            if n % self.EXPLORE_EVERY == 0:
                out[i] = k
        return out

    #: weight of a bucket's earlier choices in :attr:`_gain` (about three steps' memory), and its value before the
    #: bucket's first choice: one early choice, its confidences not yet calibrated, must not decline alone
    GAIN_DECAY = 0.7
    GAIN_PRIOR = 1.3

    def _note_gain(self, num_seqs: int, rate: float) -> None:
        """Fold a graph step's choice into its bucket's :attr:`_gain`: its expected tokens per second of the
        step (``rate``, :func:`~deepinfer.spec_cost.choose_lengths` over the calibrated confidences) over
        ``num_seqs`` per second of a plain step. At 1 or below (a choice of no draft at all gives less than 1),
        :meth:`estimate_pays` refuses: the acceptance rates alone can promise a gain that the choice, reading
        each request's own confidences, never takes (a drafter whose drafts are never accepted: every step a
        verification of no draft, dearer than a plain step). Back above 1, the bucket's refusals count from 0
        again: the next decline probes soon."""
        plain = self.plain_step_seconds(num_seqs)
        b = self.graphs.bucket(num_seqs)
        if plain is None or b is None:
            return
        gain = rate * plain / num_seqs
        self._gain[b] = self.GAIN_DECAY * self._gain.get(b, self.GAIN_PRIOR) + (1.0 - self.GAIN_DECAY) * gain
        if self._gain[b] > 1.0:
            self._refused.pop(b, None)

    def expected_confidences(self, req_id: int, k: int) -> list[float]:
        """The confidences the schedule expects of a request's next ``k`` drafts: at depth ``j`` the request's
        last confidence there (:attr:`confidences`), else the measured acceptance rate there
        (:attr:`accept_rate`; 1 where not measured)."""
        seen = self.confidences.get(req_id, ())
        return [self.calibrated(j, seen[j]) if j < len(seen) else (1.0 if a is None else a)
                for j, a in enumerate(self.accept_rate[:k])]

    #: confidence bins of the calibration, and the weight of the raw confidence as its prior (in drafts)
    CAL_BINS = 10
    CAL_PRIOR = 2.0

    def _bin(self, conf: float) -> int:
        return min(max(int(conf * self.CAL_BINS), 0), self.CAL_BINS - 1)

    def calibrated(self, depth: int, conf: float) -> float:
        """The acceptance rate measured for drafts at ``depth`` (0-based; the ones before them accepted) whose
        choice read a confidence in ``conf``'s bin, with ``conf`` itself as the prior (:attr:`CAL_PRIOR` drafts).
        A drafter's probability of its own token is not the chance that the target agrees: the MTP layer of
        ``bench_spec`` underrates it, and the schedule then verifies too few drafts (``docs/speculative.md``). The
        counts depend on past steps only, so the choice stays lossless."""
        b = self._bin(conf)
        return (self._cal_accepted[depth][b] + self.CAL_PRIOR * conf) / (self._cal_verified[depth][b] + self.CAL_PRIOR)

    def _calibrate(self, items, nv: list[int], kept: list[int], n_base: list[int]) -> None:
        """Count this step's verifications into the calibration (:meth:`calibrated`): each verified draft whose
        earlier drafts were accepted, in the bin its choice read."""
        for it, k, q, b in zip(items, nv, kept, n_base):
            bins = self._cal_bins.pop(it.req_id, None)
            if not k or not bins:
                continue
            acc = q - b
            for j in range(min(k, acc + 1, len(bins))):
                ver, got = self._cal_verified[j], self._cal_accepted[j]
                ver[bins[j]] = self.ACCEPT_DECAY * ver[bins[j]] + 1
                got[bins[j]] = self.ACCEPT_DECAY * got[bins[j]] + (j < acc)

    def _seen(self, nv: int, emitted: int | None) -> int:
        """How many of a verification's draft confidences the next choice may read: up to the first rejected
        draft, that one included (each depends on accepted drafts only, never on a draw whose randomness a
        later draft reuses: lossless); the first draft's alone without a verification (``emitted`` None)."""
        return 1 if emitted is None or not nv else min(nv, emitted)

    def _step_cost(self, items):
        """``cost(lengths) -> float`` of this step verifying ``lengths[i]`` drafts for request ``i``: the graph
        step's seconds at the longest (:meth:`graph_step_seconds`: one shape per bucket, so drafts below the
        longest cost nothing) when the step runs graphs, else :attr:`cost` of its tokens."""
        n = len(items)
        if self._graph_step(items) and self.graph_step_seconds(n, 0) is not None:
            return CostByLongest([self.graph_step_seconds(n, d) for d in range(self.k + 1)])
        return CostByTokens(self.cost, n, sum(it.num_new_tokens - it.num_draft_tokens for it in items))

    #: per step that verifies a draft position, the weight its earlier counts keep (about 50 steps' memory)
    ACCEPT_DECAY = 0.98

    def _measure(self, nv: list[int], kept: list[int], n_base: list[int]) -> None:
        """Update :attr:`accept_rate` from this step's verifications: per draft position, the decayed counts of
        drafts verified there (the ones before it taken) and accepted, with one accepted and one rejected draft
        as a prior, ``(accepted + 1) / (verified + 2)``. A few early rejections must not read as a rate of 0: the
        schedule would then never speculate, nor probe, again (:meth:`pays`)."""
        accepted = [(k - b, v) for k, b, v in zip(kept, n_base, nv) if v]
        for j in range(self.k):
            reached = [a for a, v in accepted if v > j and a >= j]  # verified draft j + 1, the ones before taken
            if reached:
                self._accepted[j] = self.ACCEPT_DECAY * self._accepted[j] + sum(a > j for a in reached)
                self._verified[j] = self.ACCEPT_DECAY * self._verified[j] + len(reached)
                self.accept_rate[j] = (self._accepted[j] + 1) / (self._verified[j] + 2)


def _add_sample(samples: list[float], seconds: float) -> float:
    """Append ``seconds`` to ``samples``, keep the last five, return their :func:`robust_seconds`."""
    samples.append(seconds)
    del samples[:-5]
    return robust_seconds(samples)


def robust_seconds(samples: list[float]) -> float:
    """The second smallest of ``samples`` (the smallest while fewer than five): a bucket's first steps carry
    one-time costs and a stray slow step (a collection, another process) must not decide alone."""
    return sorted(samples)[1 if len(samples) >= 5 else 0]
