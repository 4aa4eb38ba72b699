"""The engine core: ``add_request``, ``step``, ``abort``, ``has_unfinished_requests`` over a scheduler and a model
runner. ``LLM.generate`` / ``LLM.chat`` and the CLI are loops over it; see ``docs/engine.md`` for the step contract.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import gc
import threading
import time
from dataclasses import dataclass

from deepinfer.config import EngineConfig
from deepinfer.model_runner import ModelRunner, StepOutput
from deepinfer.scheduler import Scheduler, SchedulerOutput
from deepinfer.sequence import RequestFailure, Sequence, SequenceStatus

# failure kinds that refuse a request as invalid (400); every other kind is a server error
_INVALID_REQUEST_KINDS = frozenset({"invalid_request", "context_length_exceeded", "cache_exhausted",
                                    "grammar_dead_end"})


def error_record(failure: RequestFailure) -> dict:
    """The error record of a failed request, as ``LLM.generate`` / ``LLM.chat`` return it: ``{"type", "code",
    "message", "param", "status_code"}`` (``type`` ``"invalid_request_error"`` with status 400 for a refusal, else
    ``"server_error"`` with 500; ``param`` the request field at fault, or None)."""
    invalid = failure.kind in _INVALID_REQUEST_KINDS
    return {"type": "invalid_request_error" if invalid else "server_error", "code": failure.kind,
            "message": failure.message, "param": failure.param, "status_code": 400 if invalid else 500}


_gc_depth = 0  # open gc_frozen blocks, all threads
_gc_lock = threading.Lock()


@contextlib.contextmanager
def gc_frozen():
    """Inside the block, the objects alive at its start stay out of the garbage collector's scans
    (``gc.freeze``). A loaded engine holds a large heap of long-lived objects (modules, weights, graphs, tables),
    and every full collection in a step loop would walk all of it, stalling that step; the stalls land in decode
    time (``bench_spec.py`` rows record the collections' time, ``gc``). Nothing leaks: the end of the outermost
    open block (blocks nest and may run in several threads) hands them back to the oldest generation
    (``gc.unfreeze``). The ``gc`` module keeps one frozen set, so a heap frozen before the block is unfrozen at
    its end too: a process may have frozen a few objects early (the GPU image seemed to), and skipping the freeze
    then would leave every full collection walking the engine."""
    global _gc_depth
    with _gc_lock:
        if _gc_depth == 0:
            gc.freeze()
        _gc_depth += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_depth -= 1
            if _gc_depth == 0:
                gc.unfreeze()


@dataclass(frozen=True)
class StepRecord:
    """What one applied step did: its decode and prefill tokens, its time since the previous applied step (the
    throughput view), the host time until its forward was queued, all the host time it took (scheduling, enqueue,
    applying the results) and its GPU time (CUDA events around the forward; 0 on the CPU), in seconds; and the
    number of sequences it scheduled."""

    decode_tokens: int
    prefill_tokens: int
    seconds: float
    enqueue_seconds: float
    host_seconds: float
    gpu_seconds: float
    num_seqs: int = 0


class LLMEngine:
    """One engine over ``scheduler`` and ``runner``.

    ``step()`` runs one iteration: with asynchronous scheduling (``config.async_scheduling``) it schedules and
    enqueues the next step, then applies the one in flight; otherwise it schedules, runs and applies one step. It
    returns the sequences that gained a token or finished in the applied step, and appends a :class:`StepRecord` to
    ``records``. Speculative steps run in order (plain steps with speculation on overlap as usual). The scheduler
    hands the runner a :class:`SchedulerOutput` (plain data) per step; a failed request's ``Sequence.error`` is its error record (:func:`error_record` of the scheduler's ``Sequence.failure``).

    A request with ``structured_outputs`` is compiled by ``grammars`` (a ``structured.GrammarCompiler``, off the
    step loop) before it reaches the scheduler; a constraint that fails to compile, or compiles for longer than
    ``grammars.timeout_s``, ends that request alone with an ``invalid_request`` record naming the field. Their masks
    are filled behind the next forward (``docs/engine.md``, Overlap).
    """

    def __init__(self, config: EngineConfig, scheduler: Scheduler, runner: ModelRunner, grammars=None) -> None:
        self.config = config
        self.scheduler = scheduler
        self.runner = runner
        self.grammars = grammars
        self._compiling: list[tuple[Sequence, concurrent.futures.Future, float]] = []
        self.records: list[StepRecord] = []
        self._in_flight: tuple[SchedulerOutput, StepOutput, float] | None = None
        self._last = time.perf_counter()

    def add_request(self, seq: Sequence) -> bool:
        """Queue ``seq`` (a constrained one once its grammar is compiled); False when it was refused (it is then
        finished with ``seq.error`` set)."""
        spec = seq.params.structured_outputs
        if spec is not None and seq.grammar is None:
            if self.grammars is None:
                return self._refuse(seq, "structured_outputs: this engine has no grammar compiler (no tokenizer)")
            self._compiling.append((seq, self.grammars.submit(spec), time.perf_counter() + self.grammars.timeout_s))
            return True
        if self.scheduler.add(seq):
            return True
        seq.error = error_record(seq.failure)
        return False

    def _refuse(self, seq: Sequence, message: str, param: str = "structured_outputs") -> bool:
        seq.failure = RequestFailure("invalid_request", message, param)
        seq.error = error_record(seq.failure)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "error"
        seq.finish_time = time.perf_counter()
        return False

    def _admit_compiled(self) -> list[Sequence]:
        """Queue the requests whose grammar is ready; fail those whose compilation failed or timed out. Waits
        (up to the nearest deadline) when nothing else can run. Returns the requests that failed here."""
        if not self._compiling:
            return []
        if not self.scheduler.has_unfinished() and self._in_flight is None:
            deadline = min(d for _, _, d in self._compiling)
            concurrent.futures.wait([f for _, f, _ in self._compiling], max(0.0, deadline - time.perf_counter()),
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        now = time.perf_counter()
        failed: list[Sequence] = []
        keep = []
        for seq, fut, deadline in self._compiling:
            if fut.done():
                try:
                    seq.grammar = fut.result()
                except Exception as e:  # noqa: BLE001 - a bad grammar fails its own request only
                    msg = str(e) if isinstance(e, ValueError) else f"structured_outputs: compilation failed: {e}"
                    self._refuse(seq, msg, getattr(e, "param", "structured_outputs"))
                    failed.append(seq)
                    continue
                if not self.add_request(seq):
                    failed.append(seq)
            elif now >= deadline:
                self._refuse(seq, f"structured_outputs: compiling the constraint took more than "
                                  f"{self.grammars.timeout_s:g} s")
                failed.append(seq)
            else:
                keep.append((seq, fut, deadline))
        self._compiling = keep
        return failed

    def finish(self, seq: Sequence, reason: str, num_output_tokens: int | None = None) -> None:
        """End ``seq`` with ``reason`` (its step in flight, if any, drops its token), keeping only its first
        ``num_output_tokens`` output tokens when given (a stop string inside a block of accepted drafts)."""
        self.scheduler.finish(seq, reason, num_output_tokens)

    def abort(self, seq: Sequence, error: dict | None = None) -> None:
        """End ``seq`` wherever it is (its step in flight, if any, drops its token): with ``error``, the record the
        API layer returns for it (``{"code", "message", ...}``; finish reason ``"error"``), else finish reason
        ``"abort"``.

        Raises:
            TypeError: ``error`` is not a dict with string ``code`` and ``message``.
        """
        self._compiling = [c for c in self._compiling if c[0] is not seq]
        failure = None
        if error is not None:
            if not isinstance(error, dict) or not isinstance(error.get("code"), str) \
                    or not isinstance(error.get("message"), str):
                raise TypeError(f"LLMEngine.abort: error must be a record dict with string 'code' and 'message', "
                                f"got {error!r}")
            failure = RequestFailure(error["code"], error["message"])
        self.scheduler.abort(seq, failure)
        seq.error = error

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None or bool(self._compiling)

    def reset_clock(self) -> None:
        """Start the next step's time from now (call before a run)."""
        self._last = time.perf_counter()

    def step(self) -> list[Sequence]:
        """One iteration; returns the sequences touched by the step applied in it (empty when none was)."""
        sched = self.scheduler
        touched: list[Sequence] = self._admit_compiled()
        speculate = sched.speculates_next()
        overlap = self.config.async_scheduling and not speculate  # a speculative step runs in order
        if self._in_flight is not None and not overlap:
            touched += self._apply(self._in_flight)
            self._in_flight = None
        t = time.perf_counter()
        output = sched.schedule(speculate)
        host_s = time.perf_counter() - t
        prev = self._in_flight
        out = None
        if output.scheduled:
            out = self.runner.execute(output, prev[1] if prev is not None else None)
        else:
            self.runner.update_states(output)  # finished requests leave the runner
        if prev is not None:
            touched += self._apply(prev)
        self._in_flight = (output, out, host_s + out.host_seconds) if out is not None else None
        if self._in_flight is not None and not overlap:
            touched += self._apply(self._in_flight)
            self._in_flight = None
        if self._in_flight is None and not sched.has_unfinished() and not self._compiling:
            self.runner.update_states(sched.schedule())  # the last finished requests leave the runner
        return touched

    def drop_in_flight(self) -> None:
        """Forget the step in flight (after an interrupt: its requests are aborted, its results unused)."""
        if self._in_flight is not None:
            self.scheduler.drop(self._in_flight[0])
        self._in_flight = None

    def _apply(self, step: tuple[SchedulerOutput, StepOutput, float]) -> list[Sequence]:
        output, out, host_s = step
        tokens, logprobs, tops, _ = out.result()
        t = time.perf_counter()
        touched = self.scheduler.postprocess(output, tokens, logprobs, tops)
        for seq in touched:
            if seq.failure is not None and seq.error is None:
                seq.error = error_record(seq.failure)
        host_s += time.perf_counter() - t
        dt, self._last = t - self._last, t
        n_decode = out.num_decode_tokens
        # a speculative step counts the tokens its decodes emitted, not the drafts it verified
        n_prefill = getattr(out, "num_prefill_tokens", output.num_scheduled_tokens - n_decode)
        self.records.append(StepRecord(n_decode, n_prefill, dt, out.host_seconds, host_s, out.gpu_seconds,
                                       len(output.scheduled)))
        return touched


class OutputProcessor:
    """Per-request protocol work, after each applied step and off the scheduler (the next step is already enqueued
    when it runs): each new token of a request goes to that request's handler, ``handler(token, logprob, top) ->
    bool`` (a chat request's deepseek-recipe stream: reasoning, tool calls, stop strings). True ends the request
    with ``"stop"`` (tokens the step in flight samples for it are dropped); an exception ends that request alone
    with an ``output_processing_failed`` error record."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._handlers: dict[int, tuple[Sequence, object]] = {}
        self._seen: dict[int, int] = {}

    def add(self, seq: Sequence, handler) -> None:
        self._handlers[seq.seq_id] = (seq, handler)
        self._seen[seq.seq_id] = 0

    def remove(self, seq: Sequence) -> None:
        """Forget ``seq``'s handler (a server calls this when the request is done; nothing is kept per request)."""
        self._handlers.pop(seq.seq_id, None)
        self._seen.pop(seq.seq_id, None)

    def process(self, seqs: list[Sequence]) -> None:
        """Feed the tokens ``seqs`` gained since the last call to their handlers."""
        for seq in seqs:
            entry = self._handlers.get(seq.seq_id)
            if entry is None or seq.error is not None:
                continue
            handler = entry[1]
            for k in range(self._seen[seq.seq_id], seq.num_output_tokens):
                self._seen[seq.seq_id] = k + 1
                try:
                    stop = handler(seq.output_token_ids[k], seq.output_logprobs[k], seq.output_top_logprobs[k])
                except Exception as e:  # noqa: BLE001 - one request's output parser must not take the batch down
                    self.engine.abort(seq, error_record(RequestFailure("output_processing_failed", str(e))))
                    break
                if stop:  # nothing after the token that stopped it (speculation appends several per step)
                    self.engine.finish(seq, "stop", k + 1)
                    break
