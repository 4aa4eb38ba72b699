"""Continuous batching: a per-step token budget shared by decodes and chunked prefills, admission by free blocks,
preemption by recompute when blocks run out.

Each step (``schedule``):
1. Running sequences, oldest first, get their next tokens: 1 for a decode, a prefill chunk for a prompt (or a
   preempted context) not yet fully in the cache, each within the remaining budget. When a running sequence needs a
   block and none is free, the newest running sequence is preempted (blocks freed, context recomputed later).
2. If nothing was preempted, waiting sequences are admitted in arrival order while their first chunk's blocks are
   free, the budget lasts and fewer than ``max_num_seqs`` run.

Requests that can never run are refused when added (``Sequence.error`` set, status FINISHED): prompt + max_tokens
beyond the context limit, or more blocks than the whole cache holds. So a request alone always completes: no hang.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from deepinfer.block_manager import BlockManager
from deepinfer.config import EngineConfig
from deepinfer.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's share of a step: ``num_new_tokens`` tokens at positions ``[start, start + num_new_tokens)``;
    ``needs_logits``: the step reaches the end of its context, so the next token is sampled (it is pending on the
    sequence until :meth:`Scheduler.postprocess` applies it)."""

    seq: Sequence
    num_new_tokens: int
    start: int
    needs_logits: bool


class Scheduler:
    """Scheduler over one ``BlockManager``.

    Args:
        config: engine settings (token budget, max_num_seqs, chunk alignment in batch-invariant mode).
        block_manager: the cache allocator.
        max_model_len: context limit in tokens (prompt + output).
        eos_token_ids: ids that end a request unless its params say ``ignore_eos`` (an int, a tuple, or ``None``).
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

    # ---------------------------------------------------------------- admission
    def add(self, seq: Sequence) -> bool:
        """Queue ``seq``; or refuse it (error record, status FINISHED, returns False) when it can never run."""
        seq.arrival_time = seq.arrival_time or time.perf_counter()
        need_len = seq.num_prompt_tokens + seq.params.max_tokens
        if seq.num_prompt_tokens == 0:
            return self._refuse(seq, "invalid_request", "the prompt is empty")
        if need_len > self.max_model_len:
            return self._refuse(
                seq, "context_length_exceeded",
                f"prompt ({seq.num_prompt_tokens} tokens) + max_tokens ({seq.params.max_tokens}) = {need_len} "
                f"exceeds the model's context length ({self.max_model_len})")
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
        return True

    def _refuse(self, seq: Sequence, code: str, message: str) -> bool:
        seq.error = {"type": "invalid_request_error", "code": code, "message": message}
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "error"
        seq.finish_time = time.perf_counter()
        return False

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---------------------------------------------------------------- one step
    def _chunk(self, seq: Sequence, budget: int) -> int:
        """New tokens for ``seq`` this step within ``budget`` (0: none; also when its pending tokens already reach
        ``max_tokens``: it finishes when they are applied)."""
        if seq.num_output_tokens + seq.num_pending >= seq.params.max_tokens:
            return 0
        n = min(seq.num_uncomputed_tokens, budget)
        end = seq.num_computed_tokens + n
        if self.config.batch_invariant and end < seq.num_tokens + seq.num_pending:
            align = self.config.chunk_align
            n = (end // align) * align - seq.num_computed_tokens
        return max(n, 0)

    def schedule(self) -> list[ScheduledSeq]:
        """Pick this step's work and allocate its blocks. Returns an empty list only when nothing is queued."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = self._chunk(seq, budget)
            if n == 0:
                i += 1
                continue
            target = seq.num_computed_tokens + n
            while not self.block_manager.can_allocate(seq, target):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                break  # seq itself was preempted: everything after it is gone too
            self.block_manager.allocate(seq, target)
            scheduled.append(self._take(seq, n))
            budget -= n
            i += 1

        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                seq = self.waiting[0]
                if seq.num_pending:  # preempted with a token in flight: admitted once it is applied
                    break
                n = self._chunk(seq, budget)
                if n == 0:
                    break
                target = seq.num_computed_tokens + n
                if not self.block_manager.can_allocate(seq, target):
                    break
                self.waiting.popleft()
                self.block_manager.allocate(seq, target)
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                scheduled.append(self._take(seq, n))
                budget -= n

        if not scheduled and self.has_unfinished() and not any(s.num_pending for s in self.running + list(self.waiting)):
            # Unreachable by construction (a queued request alone always fits); fail loudly instead of spinning.
            raise RuntimeError(
                f"Scheduler made no progress: {len(self.waiting)} waiting, {len(self.running)} running, "
                f"{self.block_manager.num_free_blocks}/{self.block_manager.num_blocks} blocks free")
        return scheduled

    @staticmethod
    def _take(seq: Sequence, n: int) -> ScheduledSeq:
        """Schedule ``n`` tokens of ``seq``: they count as computed from now on (the next step may be scheduled
        before this one's results are applied); a step that reaches the end of the context adds a pending token."""
        start = seq.num_computed_tokens
        needs = start + n == seq.num_tokens + seq.num_pending
        seq.num_computed_tokens = start + n
        if needs:
            seq.num_pending += 1
        return ScheduledSeq(seq, n, start, needs)

    def _preempt(self, seq: Sequence) -> None:
        """Preempt by recompute: free the blocks, keep the tokens, requeue at the front."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ---------------------------------------------------------------- after the model ran
    def postprocess(self, scheduled: list[ScheduledSeq], token_ids: list[int], logprobs: list[float],
                    top_logprobs: list | None = None) -> list[Sequence]:
        """Apply a step's sampled tokens (in step order; asynchronously one step late): append them and finish
        sequences (a sequence finished since the step was scheduled drops its token).

        ``token_ids``/``logprobs`` (and ``top_logprobs``) hold one entry per scheduled sequence with ``needs_logits``,
        in order.
        Returns the sequences that finished this step (their blocks are freed).
        """
        finished: list[Sequence] = []
        now = time.perf_counter()
        k = 0
        for item in scheduled:
            seq = item.seq
            if not item.needs_logits:
                continue
            token, logprob = token_ids[k], logprobs[k]
            top = top_logprobs[k] if top_logprobs is not None else []
            k += 1
            seq.num_pending -= 1
            if seq.is_finished:  # it ended while this step ran (asynchronous scheduling): its token is dropped
                continue
            if seq.first_token_time is None:
                seq.first_token_time = now
            if token < 0:  # the sampler's mark for NaN logits: the request fails, the others go on
                seq.error = {"type": "server_error", "code": "nan_logits", "status_code": 500,
                             "message": f"the model produced NaN logits at output token {seq.num_output_tokens} "
                                        "(broken weights or a kernel error)"}
                self._finish(seq, "error", now)
                finished.append(seq)
                continue
            params = seq.params
            if (not params.ignore_eos and token in self.eos_token_ids) or token in params.stop_token_ids:
                seq.stop_token_id = token
                self._finish(seq, "stop", now)
            else:
                seq.output_token_ids.append(token)
                seq.output_logprobs.append(logprob)
                seq.output_top_logprobs.append(top)
                if seq.num_output_tokens >= params.max_tokens:
                    self._finish(seq, "length", now)
            if seq.is_finished:
                finished.append(seq)
        if k != len(token_ids):
            raise RuntimeError(f"Scheduler.postprocess: {len(token_ids)} sampled tokens for {k} sequences")
        return finished

    def finish(self, seq: Sequence, reason: str) -> None:
        """End ``seq`` with ``reason`` now (an output processor saw a stop string); a sequence that ended at this
        very token (``max_tokens``) takes the new reason."""
        if seq.is_finished:
            seq.finish_reason = reason
            return
        self._finish(seq, reason, time.perf_counter())

    def _finish(self, seq: Sequence, reason: str, now: float) -> None:
        seq.finish_reason = reason
        seq.status = SequenceStatus.FINISHED
        seq.finish_time = now
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:  # preempted while its last token was in flight
            self.waiting.remove(seq)
        self.block_manager.free(seq)

    def abort(self, seq: Sequence, error: dict | None = None) -> None:
        """Remove ``seq`` wherever it is (e.g. its output handler failed), freeing its blocks."""
        if seq in self.running:
            self.running.remove(seq)
            self.block_manager.free(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "error" if error else "abort"
        seq.error = error
        seq.finish_time = time.perf_counter()
