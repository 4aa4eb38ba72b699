"""Serving with data parallelism: the server's engine loop drives the DP ranks through :class:`RemoteEngine`, and
each rank runs :func:`rank_serve_loop`.

:class:`RemoteEngine` has the ``LLMEngine`` methods the server's ``EngineLoop`` calls (``add_request``, ``step``,
``abort``, ``finish``, ``has_unfinished_requests``, ...). A request goes to the rank with the fewest open
requests; every ``step`` applies the token updates the ranks sent since (new tokens, logprobs, the end, the error
record) to the caller's ``Sequence`` objects, so the server's per-token protocol work (``OutputProcessor``,
streaming, stop strings) runs in the caller's process as it does for one engine. A stop or an abort ends the
request here at once and is sent to its rank (tokens it samples meanwhile are dropped).

A rank's loop takes its messages without blocking while there is work; under expert parallelism the ranks step
together (``dp_step.DPStepper``) and, when no rank has work, keep agreeing every ``IDLE_SLEEP_S`` (so a request
that reaches one rank starts at once on all); a stop message ends every rank's loop at the same iteration.
"""

from __future__ import annotations

import dataclasses
import pickle
import queue
import time

from deepinfer.sequence import Sequence, SequenceStatus

#: how long ``RemoteEngine.step`` waits for the ranks' updates (seconds)
STEP_WAIT_S = 0.02
#: the ranks' pause between agreements while no rank has work, under expert parallelism (seconds)
IDLE_SLEEP_S = 0.002


class RemoteEngine:
    """``LLMEngine``'s interface over the DP ranks of ``llm`` (an ``LLM`` with ``data_parallel_size > 1``); starts
    every rank's serve loop."""

    def __init__(self, llm) -> None:
        self.llm, self.group, self.config = llm, llm._dp_group, llm.config
        self.records: list = []  # per-step records stay on the ranks
        self.world = self.group.world
        self._seqs: dict[int, tuple[Sequence, int]] = {}  # open requests: seq_id -> (sequence, rank)
        self._open = [0] * self.world
        self.num_sent = [0] * self.world  # requests sent to each rank
        blocks = [i["startup"]["cache_blocks"] for i in self.group.infos]
        self._snap = [{"running": 0, "waiting": 0, "cache_used_blocks": 0, "cache_blocks": b} for b in blocks]
        self.group.start_serving()

    # the engine interface --------------------------------------------------------------------------------------
    def add_request(self, seq: Sequence) -> bool:
        """Send ``seq`` to the least-loaded rank (its refusal, if any, comes back as an update). A stopped group
        fails it at once."""
        if self.group.error is not None:
            self._end(seq, "error", {"type": "server_error", "code": "engine_error",
                                     "message": f"the data-parallel ranks are stopped: {self.group.error}"})
            return False
        r = min(range(self.world), key=lambda k: (self._open[k], k))
        self._seqs[seq.seq_id] = (seq, r)
        self._open[r] += 1
        self.num_sent[r] += 1
        self.group.send(r, ("add", seq.seq_id, list(seq.prompt_token_ids),
                            dataclasses.replace(seq.params, seed=seq.seed)))
        return True

    def abort(self, seq: Sequence, error: dict | None = None) -> None:
        self._tell(seq, ("abort", seq.seq_id, error))
        self._end(seq, "abort" if error is None else "error", error)

    def finish(self, seq: Sequence, reason: str) -> None:
        self._tell(seq, ("finish", seq.seq_id, reason))
        self._end(seq, reason)

    def has_unfinished_requests(self) -> bool:
        return bool(self._seqs)

    def step(self) -> list[Sequence]:
        """Apply the ranks' updates that arrive within ``STEP_WAIT_S``; returns the sequences they touched.
        Raises ``DataParallelError`` when a rank failed (the server then fails the open requests)."""
        touched: list[Sequence] = []
        now = time.perf_counter()
        for rank, (updates, snap) in self.group.poll(STEP_WAIT_S):
            self._snap[rank] = snap
            for seq_id, tokens, logprobs, tops, done, reason, error, cached, stop_id in updates:
                entry = self._seqs.get(seq_id)
                if entry is None:  # ended here already (stop, abort): its late tokens are dropped
                    continue
                seq = entry[0]
                if tokens and seq.first_token_time is None:
                    seq.first_token_time = now
                seq.output_token_ids += tokens
                seq.output_logprobs += logprobs
                seq.output_top_logprobs += tops
                seq.num_cached_tokens = cached
                if done:
                    seq.stop_token_id = stop_id
                    self._end(seq, reason, error)
                touched.append(seq)
        return touched

    def drop_in_flight(self) -> None:
        pass  # the ranks' steps in flight are theirs

    def reset_clock(self) -> None:
        pass

    def snapshot(self) -> dict:
        """The ranks' last reported queue and cache figures, summed."""
        return {k: sum(s[k] for s in self._snap) for k in self._snap[0]}

    # helpers ---------------------------------------------------------------------------------------------------
    def _tell(self, seq: Sequence, msg: tuple) -> None:
        entry = self._seqs.get(seq.seq_id)
        if entry is not None and self.group.error is None:
            self.group.send(entry[1], msg)

    def _end(self, seq: Sequence, reason: str | None, error: dict | None = None) -> None:
        entry = self._seqs.pop(seq.seq_id, None)
        if entry is not None:
            self._open[entry[1]] -= 1
        if seq.is_finished:
            return
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error
        seq.finish_time = time.perf_counter()


def _update(seq: Sequence, sent: int) -> tuple:
    done = seq.is_finished
    return (seq.seq_id, seq.output_token_ids[sent:], seq.output_logprobs[sent:], seq.output_top_logprobs[sent:],
            done, seq.finish_reason if done else None, seq.error if done else None, seq.num_cached_tokens,
            seq.stop_token_id)


def rank_serve_loop(llm, rank: int, inbox, outbox, parent) -> None:
    """A rank's side of serving (until a stop message, or the caller's process is gone). Messages: ``("add",
    seq_id, prompt_token_ids, params)``, ``("abort", seq_id, error)``, ``("finish", seq_id, reason)``, None (stop).
    Sends ``("updates", 0, rank, pickle((updates, snapshot)))`` after every step that touched a request."""
    engine, dp = llm.engine, llm._dp
    local: dict[int, tuple[Sequence, int]] = {}  # seq_id -> (sequence, tokens already sent)
    stop = False
    checked = time.monotonic()
    while True:
        if dp is not None and time.monotonic() - checked > 1.0:  # the caller gone: stop, by vote, like a stop message
            checked = time.monotonic()
            stop = stop or (parent is not None and not parent.is_alive())
        block = dp is None and not engine.has_unfinished_requests()
        ended: list[Sequence] = []
        while not stop:
            try:
                msg = inbox.get(timeout=1.0) if block else inbox.get_nowait()
            except queue.Empty:
                if not block:
                    break
                if parent is not None and not parent.is_alive():
                    return
                continue
            block = False
            if msg is None:
                stop = True
                break
            kind, seq_id, *rest = pickle.loads(msg)
            if kind == "add":
                prompt, params = rest
                seq = Sequence(seq_id=seq_id, prompt_token_ids=prompt, params=params, seed=params.seed)
                local[seq_id] = (seq, 0)
                if not engine.add_request(seq):
                    ended.append(seq)
            elif seq_id in local:
                seq = local.pop(seq_id)[0]
                if not seq.is_finished:
                    engine.abort(seq, rest[0]) if kind == "abort" else engine.finish(seq, rest[0])
        if dp is not None:
            dp.reset()  # the loop runs forever: keep no per-step history
            touched = dp.step(stop)
            if dp.stopped:
                return
            if touched is None:
                time.sleep(IDLE_SLEEP_S)
                touched = []
        elif stop:
            return
        else:
            touched = engine.step() if engine.has_unfinished_requests() else []
        del engine.records[:]
        updates = []
        for seq in ended + touched:
            entry = local.get(seq.seq_id)
            if entry is None:
                continue
            updates.append(_update(seq, entry[1]))
            if seq.is_finished:
                del local[seq.seq_id]
            else:
                local[seq.seq_id] = (seq, seq.num_output_tokens)
        if updates:
            sched, bm = llm.scheduler, llm.block_manager
            snap = {"running": len(sched.running), "waiting": len(sched.waiting),
                    "cache_used_blocks": bm.num_blocks - bm.num_free_blocks, "cache_blocks": bm.num_blocks}
            outbox.put(("updates", 0, rank, pickle.dumps((updates, snap))))
