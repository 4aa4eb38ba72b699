"""One engine loop thread for every HTTP connection: requests come in through a bounded inbox, are batched
continuously by ``LLMEngine``, and their stream events and results go back to each connection's asyncio queue.

Only the loop thread touches the engine, the scheduler and the sequences. The HTTP side calls ``submit`` and
``abort`` (thread-safe) and reads ``RequestHandle.events``. See ``docs/serving.md``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from typing import Any

from deepinfer.api_checks import RequestError
from deepinfer.engine import OutputProcessor, gc_frozen

log = logging.getLogger("deepinfer.server")


class Overloaded(Exception):
    """The loop holds as many open requests as it may (``EngineLoop.capacity``): answer 429 with Retry-After."""


class Unavailable(Exception):
    """The loop is stopping or has died: answer 503 with Retry-After."""


class RequestHandle:
    """One HTTP request inside the loop.

    ``prepared`` has ``prompt_token_ids``, ``params``, ``push_token(token, logprob, top) -> bool``,
    ``finish(reason) -> dict``, ``take_events() -> list`` and ``close()`` (``deepinfer.chat.PreparedChat`` or
    ``deepinfer.server.completions.PreparedCompletion``). ``events`` receives, on the connection's event loop,
    ``("events", [(sse_name, data), ...])`` while streaming, then exactly one ``("done", response)`` or
    ``("error", record)``.
    """

    def __init__(self, prepared: Any, aloop: asyncio.AbstractEventLoop) -> None:
        self.prepared = prepared
        self.aloop = aloop
        self.events: asyncio.Queue = asyncio.Queue()
        self.seq = None
        self.submitted = time.perf_counter()
        self.cancelled = False  # aborted before the loop added it
        self.finished = False  # the final item was posted (set on the loop thread)

    def post(self, item: tuple) -> None:
        try:
            self.aloop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the connection's event loop is closed (shutdown): nobody is listening
            pass


class EngineLoop:
    """The engine loop over ``llm`` (a ``deepinfer.LLM``).

    Args:
        llm: the engine; the loop owns ``llm.engine`` from ``start()`` on.
        max_waiting: open requests beyond ``max_num_seqs`` the loop accepts before ``submit`` raises ``Overloaded``.
        metrics: a ``deepinfer.server.metrics.ServerMetrics`` (or None).
    """

    def __init__(self, llm, max_waiting: int = 256, metrics=None) -> None:
        if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 0:
            raise ValueError(f"max_waiting must be an integer >= 0, got {max_waiting!r}")
        self.llm = llm
        # data parallelism: the ranks' engines behind one interface (``deepinfer.parallel.serve``)
        self.engine = llm.remote_engine() if getattr(llm, "_dp_group", None) is not None else llm.engine
        self.metrics = metrics
        self.capacity = llm.config.max_num_seqs + max_waiting
        self.outputs = OutputProcessor(self.engine)
        self._inbox: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._num_open = 0  # submitted and not finished (guarded by _cond)
        self._active: dict[int, RequestHandle] = {}
        self._stopping = False
        self._draining = False  # new requests are refused; open ones run on
        self.heartbeat = time.monotonic()
        self.busy = False  # work was pending at the last heartbeat
        self.snapshot = {"running": 0, "waiting": 0, "cache_used_blocks": 0, "cache_blocks": 0}
        self._publish()
        self.thread = threading.Thread(target=self._run, name="deepinfer-engine-loop", daemon=True)

    # ---------------------------------------------------------------- HTTP side (any thread)
    def start(self) -> None:
        self.thread.start()

    @property
    def num_open(self) -> int:
        return self._num_open

    def submit(self, handle: RequestHandle) -> None:
        """Queue ``handle``; raises ``Overloaded`` at capacity, ``Unavailable`` when stopping or dead."""
        with self._cond:
            if self._draining or not self.thread.is_alive():
                raise Unavailable("the server is shutting down" if self._draining else "the engine loop is not running")
            if self._num_open >= self.capacity:
                raise Overloaded(f"{self._num_open} requests are open (the limit is {self.capacity}); retry later")
            self._num_open += 1
            self._inbox.append(("add", handle, None))
            self._cond.notify()

    def abort(self, handle: RequestHandle, error: dict | None = None) -> None:
        """End ``handle``'s request (client gone, timeout) and free its blocks; a finished one is left alone."""
        with self._cond:
            self._inbox.append(("abort", handle, error))
            self._cond.notify()

    def stalled_for(self) -> float:
        """Seconds since the loop's last heartbeat while work was pending (0 when idle or progressing)."""
        pending = self.busy or bool(self._inbox)
        return time.monotonic() - self.heartbeat if pending else 0.0

    def drain(self) -> None:
        """Refuse new requests from now on (``Unavailable``); open ones run on."""
        with self._cond:
            self._draining = True

    def stop(self, timeout: float = 10.0) -> None:
        """Refuse new requests, end open ones with a ``server_shutdown`` error and join the thread."""
        with self._cond:
            self._draining = self._stopping = True
            self._cond.notify()
        self.thread.join(timeout)

    # ---------------------------------------------------------------- loop thread
    def _run(self) -> None:
        with gc_frozen():  # the heap alive at start-up stays out of full collections while the loop serves
            self._serve()

    def _serve(self) -> None:
        engine = self.engine
        engine.reset_clock()
        while True:
            self.heartbeat = time.monotonic()
            self._drain()
            if self._stopping:
                self._fail_all({"type": "server_error", "code": "server_shutdown", "status_code": 503,
                                "message": "the server shut down before this request finished"})
                return
            self._publish()
            self.busy = engine.has_unfinished_requests()
            if not self.busy:
                with self._cond:
                    self._cond.wait_for(lambda: self._inbox or self._stopping, timeout=0.5)
                engine.reset_clock()
                continue
            try:
                touched = engine.step()
                self.outputs.process(touched)
            except Exception as e:  # noqa: BLE001 - a failed step fails its requests, never the server
                log.exception("engine step failed")
                self._fail_all({"type": "server_error", "code": "engine_error", "status_code": 500,
                                "message": f"the engine failed while running this request: {type(e).__name__}: {e}"})
                continue
            records = list(engine.records)
            del engine.records[:]  # the loop runs forever: keep no history
            if self.metrics is not None:
                self.metrics.observe_steps(records)
            for seq in touched:
                h = self._active.get(seq.seq_id)
                if h is not None and not seq.is_finished:
                    events = h.prepared.take_events()
                    if events:
                        h.post(("events", events))
            for h in [h for h in self._active.values() if h.seq.is_finished]:
                self._finalize(h)

    def _pop(self) -> tuple | None:
        with self._cond:
            return self._inbox.popleft() if self._inbox else None

    def _drain(self) -> None:
        while (item := self._pop()) is not None:
            op, h, error = item
            if op == "add":
                self._add(h)
            elif h.seq is None:
                h.cancelled = True
            elif not h.finished:
                if not h.seq.is_finished:
                    self.engine.abort(h.seq, error or {"type": "invalid_request_error", "code": "client_disconnected",
                                                       "message": "the client disconnected"})
                self._finalize(h)

    def _add(self, h: RequestHandle) -> None:
        if h.cancelled:
            self._close(h, {"type": "invalid_request_error", "code": "client_disconnected",
                            "message": "the client disconnected"})
            return
        pc = h.prepared
        seq = self.llm._new_seq(pc.prompt_token_ids, pc.params)
        seq.arrival_time = h.submitted
        h.seq = seq
        self._active[seq.seq_id] = h
        self.outputs.add(seq, pc.push_token)
        self.engine.add_request(seq)  # a refused request is finished with seq.error: finalized below
        if seq.is_finished:
            self._finalize(h)

    def _fail_all(self, error: dict) -> None:
        self.engine.drop_in_flight()
        for h in list(self._active.values()):
            if not h.seq.is_finished:
                self.engine.abort(h.seq, dict(error))
            self._finalize(h)
        self._drain_cancelled(error)

    def _drain_cancelled(self, error: dict) -> None:
        """While stopping: answer what is still in the inbox."""
        if not self._stopping:
            return
        while (item := self._pop()) is not None:
            op, h, _ = item
            if op == "add":
                self._close(h, dict(error))

    def _finalize(self, h: RequestHandle) -> None:
        seq = h.seq
        self._active.pop(seq.seq_id, None)
        self.outputs.remove(seq)
        if seq.error is not None:
            err = dict(seq.error)
            err.setdefault("status_code", 400 if err.get("type") == "invalid_request_error" else 500)
            self._close(h, err)
            return
        try:
            result = h.prepared.finish(seq.finish_reason or "stop", seq.num_cached_tokens)
        except RequestError as e:  # an answer that breaks the request's contract (no call where one was required)
            self._close(h, dict(e.record))
            return
        except Exception as e:  # noqa: BLE001 - one request's parser failing is its own error
            self._close(h, {"type": "server_error", "code": "output_parsing_failed", "status_code": 500,
                            "message": f"output parsing failed: {e}"})
            return
        events = h.prepared.take_events()
        if events:
            h.post(("events", events))
        if self.metrics is not None:
            self.metrics.observe_request(seq)
        self._end(h, ("done", result))

    def _close(self, h: RequestHandle, error: dict) -> None:
        h.prepared.close()
        if self.metrics is not None:
            self.metrics.observe_error(error)
        self._end(h, ("error", error))

    def _end(self, h: RequestHandle, item: tuple) -> None:
        if h.finished:
            return
        h.finished = True
        with self._cond:
            self._num_open -= 1
        h.post(item)

    def _publish(self) -> None:
        if hasattr(self.engine, "snapshot"):  # the DP ranks' figures
            self.snapshot = dict(self.engine.snapshot(), waiting=self.engine.snapshot()["waiting"] + len(self._inbox))
            return
        sched, bm = self.llm.scheduler, self.llm.block_manager
        self.snapshot = {"running": len(sched.running), "waiting": len(sched.waiting) + len(self._inbox),
                         "cache_used_blocks": bm.num_blocks - bm.num_free_blocks, "cache_blocks": bm.num_blocks}
