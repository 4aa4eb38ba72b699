"""Continuous batching: a per-step token budget shared by decodes and chunked prefills, admission by free blocks,
preemption by recompute when blocks run out.

Each step (``schedule``):
1. Running sequences, oldest first, get their next tokens: 1 for a decode, a prefill chunk for a prompt (or a
   preempted context) not yet fully in the cache, each within the remaining budget. When a running sequence needs a
   block and none is free, the newest running sequence is preempted (blocks freed, context recomputed later).
2. If nothing was preempted, waiting sequences are admitted in arrival order while their first chunk's blocks are
   free, the budget lasts and fewer than ``max_num_seqs`` run.

Requests that can never run are refused when added (``Sequence.failure`` set, status FINISHED): prompt + max_tokens
beyond the context limit, or more blocks than the whole cache holds. So a request alone always completes: no hang.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, NamedTuple

from deepinfer.block_manager import BlockChanges, BlockManager
from deepinfer.config import EngineConfig
from deepinfer.sequence import NO_TOP_LOGPROBS, RequestFailure, SamplingParams, Sequence, SequenceStatus

GRAMMAR_VIOLATION_TOKEN = -2  # the runner's mark for a token its request's grammar rejected
GRAMMAR_DEAD_END_TOKEN = -3  # the runner's mark for a step where its request's grammar allowed no token
_NO_BLOCKS: Mapping[str, tuple[int, ...]] = MappingProxyType({})


class ScheduledRequest(NamedTuple):
    """One request's share of a step (plain data).

    Attributes:
        req_id: the request (``Sequence.seq_id``).
        num_new_tokens: tokens computed this step, at positions ``[start, start + num_new_tokens)``.
        start: the first of them (the tokens before it are in the cache).
        needs_logits: the step reaches the end of the request's context, so its next token is sampled.
        new_block_ids: ``{cache group: block ids}`` appended to the request's tables by this step (every block of a
            request that is new to the runner); groups without new blocks are left out.
        released_block_ids: ``{cache group: block ids}`` a sliding-window group took back from the request when
            this step was allocated (the blocks before the step's window): their entries in the request's table
            become ``-1`` before ``new_block_ids`` are appended (a released block may come straight back among
            them); groups without released blocks are left out.
        num_draft_tokens: speculative drafts verified after the request's last token (0: none): the last
            ``num_draft_tokens`` of the ``num_new_tokens`` positions hold the runner's drafts (the runner may verify
            fewer), and the step emits 1 to ``num_draft_tokens + 1`` tokens.
    """

    req_id: int
    num_new_tokens: int
    start: int
    needs_logits: bool
    new_block_ids: Mapping[str, tuple[int, ...]] = _NO_BLOCKS
    released_block_ids: Mapping[str, tuple[int, ...]] = _NO_BLOCKS
    num_draft_tokens: int = 0


class NewRequestData(NamedTuple):
    """A request the runner has no state for: first admitted, or resumed after preemption (its context is then
    ``prompt_token_ids + output_token_ids``, recomputed from position 0, or from a prefix-cache hit).

    ``num_shared_tokens``: positions ``[0, num_shared_tokens)`` of the kept cache group are shared prefix-cache
    blocks the runner's steps never write (a replayed suffix recomputes only the sliding-window group there);
    ``window_floor``: the request's sliding-window tables hold no block before this position (its steps read no
    window entry before it). Both 0 without a hit."""

    req_id: int
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    params: SamplingParams
    seed: int
    grammar: object | None = None  # the compiled ``params.structured_outputs`` (immutable), else None
    num_shared_tokens: int = 0
    window_floor: int = 0


@dataclass(frozen=True)
class SchedulerOutput:
    """What one step runs, as plain data (vLLM's ``SchedulerOutput``); the runner keeps its own per-request state
    and updates it from these alone.

    Attributes:
        step_id: counts the scheduler's outputs from 0.
        scheduled: the step's requests in token-row order.
        new_requests: requests new to the runner, before ``scheduled`` refers to them.
        finished_req_ids: requests finished or aborted since the previous output (the runner drops their state).
        preempted_req_ids: requests preempted by this output (blocks freed; they come back as new requests).
        cache_swaps: block copies between the device pools and the host tier of the prefix cache
            (:class:`~deepinfer.host_cache.SwapOp`), to run in order before the step's forward.
        speculative: the step verifies drafts (speculation on and worth it at this batch size); a plain step
            otherwise, run as without speculation.
    """

    step_id: int
    scheduled: tuple[ScheduledRequest, ...]
    new_requests: tuple[NewRequestData, ...] = ()
    finished_req_ids: tuple[int, ...] = ()
    preempted_req_ids: tuple[int, ...] = ()
    cache_swaps: tuple = ()
    speculative: bool = False

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(r.num_new_tokens for r in self.scheduled)

    @property
    def num_logits(self) -> int:
        """Requests whose next token this step samples (rows of the sampled tokens, in order)."""
        return sum(1 for r in self.scheduled if r.needs_logits)


class Scheduler:
    """Scheduler over one ``BlockManager``.

    Args:
        config: engine settings (token budget, max_num_seqs, chunk alignment in batch-invariant mode).
        block_manager: the cache allocator.
        max_model_len: context limit in tokens (prompt + output).
        eos_token_ids: ids that end a request unless its params say ``ignore_eos`` (an int, a tuple, or ``None``).

    A failed request gets ``Sequence.failure`` (a :class:`RequestFailure`: kind and message) and finish reason
    ``"error"``; the engine's output processor builds the error record from it.
    """

    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int,
                 eos_token_ids: int | tuple[int, ...] | None) -> None:
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        if eos_token_ids is None:
            eos_token_ids = ()
        self.eos_token_ids = frozenset((eos_token_ids,) if isinstance(eos_token_ids, int) else eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_generated_tokens = 0  # output tokens appended so far (progress without a recount)
        self._live: dict[int, Sequence] = {}  # queued or running, by request id
        self._steps: dict[int, list[Sequence]] = {}  # step_id -> its sampled requests, until postprocess
        self._finished_ids: list[int] = []
        self._next_step = 0
        # DP attention (``deepinfer.parallel.dp_step``): the most prefill tokens the next ``schedule`` may take
        # (None: no limit beyond the token budget; decodes never count against it), and what the last one took
        self.prefill_budget: int | None = None
        self.last_prefill_tokens = 0
        self.last_num_tokens = 0
        # speculation: ``spec_pays(num_seqs) -> bool``, whether verifying drafts beats a plain step at that batch
        # size (``SpecDecoder.pays``; None: always)
        self.spec_pays = None
        self._held_since: int | None = None  # the step since which admission is held (:meth:`_holds_admission`)

    # ---------------------------------------------------------------- admission
    def add(self, seq: Sequence) -> bool:
        """Queue ``seq``; or refuse it (``seq.failure`` set, status FINISHED, returns False) when it can never run
        or its id is already in use."""
        seq.arrival_time = seq.arrival_time or time.perf_counter()
        need_len = seq.num_prompt_tokens + seq.params.max_tokens
        if seq.seq_id in self._live:
            return self._refuse(seq, "invalid_request", f"request id {seq.seq_id} is already in use")
        if seq.num_prompt_tokens == 0:
            return self._refuse(seq, "invalid_request", "the prompt is empty", "prompt")
        if need_len > self.max_model_len:
            return self._refuse(
                seq, "context_length_exceeded",
                f"prompt ({seq.num_prompt_tokens} tokens) + max_tokens ({seq.params.max_tokens}) = {need_len} "
                f"exceeds the model's context length ({self.max_model_len})", "max_tokens")
        bm = self.block_manager
        peak = bm.peak_blocks(need_len, self.config.max_num_batched_tokens)
        for g in bm.groups:  # every cache group must hold the request alone
            if peak[g.name] > g.num_blocks:
                where = "" if g.name == bm.main else f" of cache group {g.name!r}"
                return self._refuse(
                    seq, "cache_exhausted",
                    f"prompt + max_tokens = {need_len} tokens need {peak[g.name]} cache blocks{where} of "
                    f"{bm.block_size}, but the cache holds only {g.num_blocks}")
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self._live[seq.seq_id] = seq
        return True

    def _refuse(self, seq: Sequence, kind: str, message: str, param: str | None = None) -> bool:
        seq.failure = RequestFailure(kind, message, param)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "error"
        seq.finish_time = time.perf_counter()
        return False

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---------------------------------------------------------------- one step
    @staticmethod
    def _left(seq: Sequence) -> int:
        """Tokens ``seq`` still has to compute before its next sample (1 for a decode)."""
        return len(seq.prompt_token_ids) + len(seq.output_token_ids) + seq.num_pending - seq.num_computed_tokens

    def prefill_demand(self) -> int:
        """Prefill tokens the next step could take without a prefill limit (an upper estimate: the running
        sequences' prompt remainders, then the waiting ones' contexts, at most ``max_num_batched_tokens``)."""
        cap = self.config.max_num_batched_tokens
        n = 0
        for seq in self.running:
            left = self._left(seq)
            if left > 1:
                n += left
        for seq in self.waiting:
            if n >= cap:
                break
            n += self._left(seq)
        return min(n, cap)

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """New tokens for ``seq`` this step within ``budget`` (0: none; also when its pending tokens already reach
        ``max_tokens``: it finishes when they are applied)."""
        num_out = len(seq.output_token_ids) + seq.num_pending
        if num_out >= seq.params.max_tokens:
            return 0
        context = len(seq.prompt_token_ids) + num_out  # pending tokens included: their ids come from the device
        n = min(context - seq.num_computed_tokens, budget)
        end = seq.num_computed_tokens + n
        if end < context and self.config.batch_invariant:
            align = self.config.chunk_align
            n = (end // align) * align - seq.num_computed_tokens
        return max(n, 0)

    def _num_drafts(self, seq: Sequence, n: int, budget: int, k: int) -> int:
        """Drafts to verify after ``seq``'s decode token this step: ``k`` (0 in a plain step) for a decode (its
        last token is the one not computed) of a request that speculates, within the budget and so that the step
        emits no more than ``max_tokens`` (its positions then stay inside the request's admitted length)."""
        if not k or n != 1 or seq.num_pending or seq.num_computed_tokens != seq.num_tokens - 1 \
                or not speculates(seq.params):
            return 0
        return max(0, min(k, budget - 1, seq.params.max_tokens - seq.num_output_tokens - 1))

    def speculates_next(self) -> bool:
        """Whether the next step verifies drafts: speculation is on and, when :attr:`spec_pays` is set, pays at the
        batch size the next step can reach (the running requests topped up from the waiting ones)."""
        if not self.config.num_drafts:
            return False
        if self.spec_pays is None:
            return True
        return bool(self.spec_pays(max(1, min(self.config.max_num_seqs, len(self.running) + len(self.waiting)))))

    def _holds_admission(self, speculative: bool) -> bool:
        """Whether this step admits nobody: a speculative step under the schedule's rule (:attr:`spec_pays`), with
        requests running, some of them speculating and none mid-prompt; fewer slots free than
        ``max(1, max_num_seqs // 8)`` and than the requests waiting; the hold begun fewer than
        ``config.spec_admit_hold`` steps ago. Admissions then come in groups; each admitting step runs eagerly and
        verifies no draft."""
        hold = self.config.spec_admit_hold
        free = self.config.max_num_seqs - len(self.running)
        if not speculative or not hold or self.spec_pays is None or not self.running or not self.waiting \
                or free <= 0 or free >= min(len(self.waiting), max(1, self.config.max_num_seqs // 8)) \
                or any(self._left(seq) > 1 for seq in self.running) \
                or not any(speculates(seq.params) for seq in self.running):
            self._held_since = None
            return False
        if self._held_since is None:
            self._held_since = self._next_step
        if self._next_step - self._held_since >= hold:
            self._held_since = None
            return False
        return True

    def _prefill_next(self) -> bool:
        """Whether the next step may carry a prompt chunk: a running request mid-prompt, or a waiting one that a
        free slot and the free blocks admit (before any prefix-cache hit: a request held back for blocks must not
        stop the running ones from verifying)."""
        if any(self._left(seq) > 1 for seq in self.running):
            return True
        if not self.waiting or len(self.running) >= self.config.max_num_seqs or self.waiting[0].num_pending:
            return False
        seq = self.waiting[0]
        n = min(self._left(seq), self.config.max_num_batched_tokens)
        return self.block_manager.can_allocate(seq, seq.num_computed_tokens + n)

    def schedule(self, speculate: bool | None = None) -> SchedulerOutput:
        """Pick this step's work and allocate its blocks. ``scheduled`` is empty only when nothing can run now (no
        request queued, or every one waits for a token in flight). ``speculate`` False makes a plain step with
        speculation on (no drafts; None: speculate whenever speculation is on).

        Raises:
            RuntimeError: requests are queued but none can ever be scheduled (unreachable by construction).
        """
        speculative = bool(self.config.num_drafts) and speculate is not False
        held = self._holds_admission(speculative)
        # under the schedule's rule (spec_pays), a step with a prompt chunk verifies no draft: it runs eagerly, and
        # an eager verification costs several graph steps at large batches (docs/speculative.md); its MTP pass
        # still drafts for the next step
        k = self.config.num_drafts if speculative and (held or not (self.spec_pays is not None
                                                                     and self._prefill_next())) else 0
        budget = self.config.max_num_batched_tokens
        prefill_left = self.prefill_budget
        limited = False  # the prefill limit held a chunk back (an empty step is then no deadlock)

        def within(seq: Sequence) -> int:
            nonlocal limited
            if prefill_left is None or self._left(seq) <= 1:
                return budget
            limited = limited or prefill_left < min(budget, self._left(seq))
            return min(budget, prefill_left)

        bm = self.block_manager
        scheduled: list[ScheduledRequest] = []
        sampled: list[Sequence] = []
        new_requests: list[NewRequestData] = []
        preempted: list[int] = []
        prefill_used = 0
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            # blocks earlier steps filled become shareable (never those this step writes: a request admitted
            # below would read them in the same step)
            bm.cache_blocks(seq)
            is_prefill = self._left(seq) > 1
            n = self._chunk(seq, within(seq))
            if n == 0:
                i += 1
                continue
            d = self._num_drafts(seq, n, budget, k)
            target = seq.num_computed_tokens + n + d
            changes = None
            if not bm.fits_held(seq, target):  # most decode steps fit the blocks the request holds
                while not bm.can_allocate(seq, target):
                    victim = self.running[-1]
                    self._preempt(victim)
                    preempted.append(victim.seq_id)
                    if victim is seq:
                        break
                if seq.status != SequenceStatus.RUNNING:
                    break  # seq itself was preempted: everything after it is gone too
                changes = bm.allocate_step(seq, target)
            scheduled.append(self._take(seq, n + d, changes, sampled, d))
            budget -= n + d
            if is_prefill:
                prefill_used += n
                if prefill_left is not None:
                    prefill_left -= n
            i += 1

        if not preempted and not held:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                seq = self.waiting[0]
                if seq.num_pending:  # preempted with a token in flight: admitted once it is applied
                    break
                hit = bm.lookup(seq)  # None unless prefix caching finds the request's first block
                if hit is not None:
                    bm.apply_hit(seq, hit)  # the hit counts as computed tokens
                is_prefill = self._left(seq) > 1
                n = self._chunk(seq, within(seq))
                target = seq.num_computed_tokens + n
                if n == 0 or not bm.can_allocate(seq, target):
                    if hit is not None:  # give the shared blocks back; the lookup is redone next step
                        bm.free(seq)
                        seq.num_computed_tokens = 0
                    break
                self.waiting.popleft()
                changes = bm.allocate_step(seq, target)
                if hit is not None:  # the runner gets the whole tables: shared blocks and -1 entries included
                    changes = BlockChanges({g: list(t) for g, t in seq.block_tables.items()}, {})
                if seq.num_preemptions == 0:
                    self._count_prefix(seq)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                new_requests.append(NewRequestData(seq.seq_id, tuple(seq.prompt_token_ids),
                                                   tuple(seq.output_token_ids), seq.params, seq.seed,
                                                   seq.grammar, seq.prefix_shared_tokens, seq.window_floor))
                scheduled.append(self._take(seq, n, changes, sampled))
                budget -= n
                if is_prefill:
                    prefill_used += n
                    if prefill_left is not None:
                        prefill_left -= n

        self.last_prefill_tokens = prefill_used
        self.last_num_tokens = self.config.max_num_batched_tokens - budget
        if not scheduled and not limited and self.has_unfinished() \
                and not any(s.num_pending for s in self.running + list(self.waiting)):
            # Unreachable by construction (a queued request alone always fits); fail loudly instead of spinning.
            raise RuntimeError(
                f"Scheduler made no progress: {len(self.waiting)} waiting, {len(self.running)} running, "
                f"{self.block_manager.num_free_blocks}/{self.block_manager.num_blocks} blocks free")
        out = SchedulerOutput(self._next_step, tuple(scheduled), tuple(new_requests), tuple(self._finished_ids),
                              tuple(preempted), bm.take_swaps() if scheduled else (),  # else: the next step runs them
                              speculative)
        self._next_step += 1
        self._finished_ids = []
        if sampled:
            self._steps[out.step_id] = sampled
        return out

    def _count_prefix(self, seq: Sequence) -> None:
        """Usage and hit counters of a request's first admission (tokens served from the prefix cache)."""
        seq.num_cached_tokens = seq.num_computed_tokens
        if self.block_manager.caching:
            stats = self.block_manager.prefix_stats
            stats.queries += seq.num_prompt_tokens
            stats.hits += seq.num_cached_tokens
            stats.replayed += seq.prefix_shared_tokens - seq.num_computed_tokens if seq.prefix_shared_tokens else 0

    @staticmethod
    def _take(seq: Sequence, n: int, changes: BlockChanges | None, sampled: list[Sequence],
              drafts: int = 0) -> ScheduledRequest:
        """Schedule ``n`` tokens of ``seq`` (the last ``drafts`` of them speculative): they count as computed from
        now on (the next step may be scheduled before this one's results are applied; a verification's rejected
        drafts are taken back when it is applied); a step that reaches the end of the context adds a pending
        token."""
        start = seq.num_computed_tokens
        needs = start + n - drafts == len(seq.prompt_token_ids) + len(seq.output_token_ids) + seq.num_pending
        seq.num_computed_tokens = start + n
        if needs:
            seq.num_pending += 1
            sampled.append(seq)
        if changes is None:
            return ScheduledRequest(seq.seq_id, n, start, needs, num_draft_tokens=drafts)
        return ScheduledRequest(seq.seq_id, n, start, needs, _per_group(changes.new), _per_group(changes.released),
                                drafts)

    def _preempt(self, seq: Sequence) -> None:
        """Preempt by recompute: free the blocks, keep the tokens, requeue at the front."""
        self._leave_running(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _leave_running(self, seq: Sequence) -> None:
        self.running.remove(seq)

    # ---------------------------------------------------------------- after the model ran
    def postprocess(self, output: SchedulerOutput, token_ids: list[int], logprobs: list[float],
                    top_logprobs: list | None = None) -> list[Sequence]:
        """Apply a step's sampled tokens (in step order; asynchronously one step late): append them and finish
        requests (a request finished since the step was scheduled drops its token). A negative id (the sampler's
        NaN mark) fails its request alone (``failure.kind`` ``"nan_logits"``; ``GRAMMAR_VIOLATION_TOKEN``:
        ``"grammar_violation"``; ``GRAMMAR_DEAD_END_TOKEN``: ``"grammar_dead_end"``, a refusal naming
        ``structured_outputs``).

        ``token_ids``/``logprobs`` (and ``top_logprobs``) hold one entry per scheduled request with
        ``needs_logits``, in order; a verification step's entry (``num_draft_tokens`` > 0) is a list of the tokens
        it emits (and lists of their logprobs / top logprobs), applied in order until one ends the request (a stop
        token, ``max_tokens``: nothing after it is kept). Its rejected drafts' positions stop counting as computed.
        Returns the requests that gained a token or finished here.

        Raises:
            RuntimeError: the number of tokens is not the step's number of sampled requests.
        """
        seqs = self._steps.pop(output.step_id, [])
        if len(seqs) != len(token_ids):
            raise RuntimeError(f"Scheduler.postprocess: {len(token_ids)} sampled tokens for {len(seqs)} requests")
        verified = {r.req_id: r for r in output.scheduled if r.num_draft_tokens}
        touched: list[Sequence] = []
        now = time.perf_counter()
        for k, seq in enumerate(seqs):
            seq.num_pending -= 1
            if seq.is_finished:  # it ended while this step ran (asynchronous scheduling): its token is dropped
                continue
            touched.append(seq)
            if seq.first_token_time is None:
                seq.first_token_time = now
            item = verified.get(seq.seq_id)
            if item is None:
                self._apply_token(seq, token_ids[k], logprobs[k], top_logprobs[k] if top_logprobs is not None
                                  else NO_TOP_LOGPROBS, now)
                continue
            toks = token_ids[k]
            # positions start .. start + len(toks) - 1 hold the request's last token and the accepted drafts
            seq.num_computed_tokens = item.start + len(toks)
            for j, token in enumerate(toks):
                top = top_logprobs[k][j] if top_logprobs is not None else NO_TOP_LOGPROBS
                if self._apply_token(seq, token, logprobs[k][j], top, now):
                    break
        return touched

    def _apply_token(self, seq: Sequence, token: int, logprob: float, top: list, now: float) -> bool:
        """Append one sampled token to ``seq`` or end it (marks, stop tokens, ``max_tokens``); True when it
        ended."""
        if token == GRAMMAR_DEAD_END_TOKEN:  # the request's grammar matches nothing from here: its fault
            seq.failure = RequestFailure(
                "grammar_dead_end", f"structured_outputs: the constraint allows no token at output token "
                                    f"{seq.num_output_tokens} (a grammar that matches no string?)",
                param="structured_outputs")
            self._finish(seq, "error", now)
            return True
        if token == GRAMMAR_VIOLATION_TOKEN:  # the runner's mark: the grammar rejected the drawn token
            seq.failure = RequestFailure(
                "grammar_violation", f"output token {seq.num_output_tokens} broke the structured_outputs "
                                     "constraint (an engine error)")
            self._finish(seq, "error", now)
            return True
        if token < 0:  # the sampler's mark for NaN logits: the request fails, the others go on
            seq.failure = RequestFailure(
                "nan_logits", f"the model produced NaN logits at output token {seq.num_output_tokens} "
                              "(broken weights or a kernel error)")
            self._finish(seq, "error", now)
            return True
        params = seq.params
        if (not params.ignore_eos and token in self.eos_token_ids) or token in params.stop_token_ids:
            seq.stop_token_id = token
            self._finish(seq, "stop", now)
            return True
        seq.output_token_ids.append(token)
        seq.output_logprobs.append(logprob)
        seq.output_top_logprobs.append(top)
        self.num_generated_tokens += 1
        if seq.num_output_tokens >= params.max_tokens:
            self._finish(seq, "length", now)
            return True
        return False

    def drop(self, output: SchedulerOutput) -> None:
        """Forget ``output``'s results (its step's tokens will never be applied: an interrupted run)."""
        for seq in self._steps.pop(output.step_id, []):
            seq.num_pending -= 1

    def finish(self, seq: Sequence, reason: str, num_output_tokens: int | None = None) -> None:
        """End ``seq`` with ``reason`` now (an output processor saw a stop string); a sequence that ended at this
        very token (``max_tokens``) takes the new reason. ``num_output_tokens``: keep only that many output tokens
        (the stop string ended inside a block of accepted drafts; the usage counts what is kept)."""
        if num_output_tokens is not None and 0 <= num_output_tokens <= seq.num_output_tokens:
            self.num_generated_tokens -= seq.num_output_tokens - num_output_tokens
            del seq.output_token_ids[num_output_tokens:]
            del seq.output_logprobs[num_output_tokens:]
            del seq.output_top_logprobs[num_output_tokens:]
            seq.stop_token_id = None  # a stop token after the string is not part of the output either
        if seq.is_finished:
            seq.finish_reason = reason
            return
        self._finish(seq, reason, time.perf_counter())

    def _finish(self, seq: Sequence, reason: str, now: float) -> None:
        seq.finish_reason = reason
        seq.status = SequenceStatus.FINISHED
        seq.finish_time = now
        self._remove(seq)

    def _remove(self, seq: Sequence) -> None:
        """Out of the queues, blocks freed, reported to the runner by the next output."""
        if seq in self.running:
            self._leave_running(seq)
        elif seq in self.waiting:  # preempted while its last token was in flight
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        if self._live.pop(seq.seq_id, None) is not None:
            self._finished_ids.append(seq.seq_id)

    def abort(self, seq: Sequence, failure: RequestFailure | None = None) -> None:
        """Remove ``seq`` wherever it is, freeing its blocks: finish reason ``"error"`` with ``failure`` (e.g. its
        output handler failed), else ``"abort"``. A request that finished at this very token takes the new end.

        Raises:
            TypeError: ``failure`` is not a RequestFailure.
        """
        if failure is not None and not isinstance(failure, RequestFailure):
            raise TypeError(f"Scheduler.abort: failure must be a RequestFailure or None, got {type(failure).__name__}")
        if not seq.is_finished:
            self._remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "error" if failure else "abort"
        seq.failure = failure
        seq.finish_time = time.perf_counter()


def _per_group(ids: dict[str, list[int]]) -> Mapping[str, tuple[int, ...]]:
    """``{group: ids}`` frozen, groups without ids left out."""
    kept = {name: tuple(b) for name, b in ids.items() if b}
    return MappingProxyType(kept) if kept else _NO_BLOCKS


def speculates(params: SamplingParams) -> bool:
    """Whether a request's decode steps verify drafts when speculation is on: not with penalties or a logit bias
    (they change with every token of a block) nor with ``structured_outputs`` (its mask needs each token first)."""
    return not params.adjusts_logits and params.structured_outputs is None
