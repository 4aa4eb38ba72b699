"""Launching DP / EP engines: one process per rank (torch.multiprocessing spawn), driven from the caller's process.

:class:`DataParallelGroup` (the caller's side) spawns the ranks; each (:func:`_rank_main`) joins one
torch.distributed group, builds its own ``LLM`` and serves calls (``generate`` / ``chat`` on its share of the
requests) or, once asked, its serve loop (``parallel.serve``). Failures and their handling:
``docs/expert-parallel.md`` ("Launching").
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue
import shutil
import signal
import tempfile
import traceback
import weakref

#: seconds a rank gets to exit after a stop message before it is killed
STOP_TIMEOUT_S = 30.0
#: how often the caller checks its ranks are alive while it waits (seconds)
POLL_S = 0.2
#: seconds the caller waits for a dead rank's last message before it reports the death itself
DEAD_GRACE_S = 1.0


class DataParallelError(RuntimeError):
    """A DP rank failed (an exception, or its process died); every rank of the group was stopped."""


def assign_requests(costs: list[int], world: int) -> list[list[int]]:
    """Share requests out over ``world`` ranks by their cost (prompt + output tokens): largest first, each to the
    rank with the least cost so far (ties: the lower rank). Returns per rank its request indices, ascending.
    Deterministic; a rank may get none."""
    load = [0] * world
    out: list[list[int]] = [[] for _ in range(world)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(world), key=lambda k: (load[k], k))
        load[r] += costs[i]
        out[r].append(i)
    return [sorted(x) for x in out]


def _rank_device(device: str | None, rank: int) -> str | None:
    """The device of ``rank``: ``cuda`` / ``cuda:N`` become ``cuda:<rank>`` (one GPU per rank)."""
    if device is not None and device.split(":")[0] == "cuda":
        return f"cuda:{rank}"
    return device


def _rank_main(rank: int, world: int, store: str, model, llm_kwargs: dict, inboxes, outbox) -> None:
    """A rank's process: init the group, build the engine, serve calls from ``inboxes[rank]`` until told to
    stop."""
    import multiprocessing

    import torch
    import torch.distributed as dist

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    cfg = llm_kwargs["config"]
    cfg.device = _rank_device(cfg.device, rank)
    if cfg.device is None or cfg.device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    else:
        torch.cuda.set_device(torch.device(cfg.device))
    pc = cfg.parallel
    try:
        from deepinfer_ops import select_accelerator, device_for

        device = torch.device(cfg.device) if cfg.device else device_for(select_accelerator())
        dist.init_process_group(pc.resolved_backend(device), init_method=f"file://{store}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=pc.timeout_s))
        from deepinfer.llm import LLM

        llm = LLM(model, parallel_rank=rank, **llm_kwargs)
        outbox.put(("ready", 0, rank, pickle.dumps(_ready_info(llm))))
    except BaseException as e:  # noqa: BLE001 - reported to the caller, which stops the group
        outbox.put(("error", 0, rank, pickle.dumps(_error_info(e))))
        return
    parent = multiprocessing.parent_process()
    inbox = inboxes[rank]
    try:
        while True:
            try:
                msg = inbox.get(timeout=1.0)
            except queue.Empty:
                if parent is not None and not parent.is_alive():
                    return
                continue
            if msg is None:
                return
            call_id, method, args = pickle.loads(msg)
            if method == "serve":  # until the stop message; then this rank is done
                from deepinfer.engine import gc_frozen

                from .serve import rank_serve_loop

                try:
                    with gc_frozen():  # as the single-process loops: no full collection walks the engine
                        rank_serve_loop(llm, rank, inbox, outbox, parent)
                except BaseException as e:  # noqa: BLE001
                    outbox.put(("error", 0, rank, pickle.dumps(_error_info(e))))
                return
            try:
                result = getattr(llm, method)(*args)
                outbox.put(("done", call_id, rank, pickle.dumps((result, llm.last_stats, llm.dp_stats()))))
            except BaseException as e:  # noqa: BLE001
                outbox.put(("error", call_id, rank, pickle.dumps(_error_info(e))))
                return  # the group's collectives are in an unknown state: this rank is done
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _ready_info(llm) -> dict:
    keys = ("max_model_len", "vocab_size", "eos_token_ids", "eos_token_id", "tokenizer_json", "served_model_name",
            "model_aliases", "model_version", "startup")
    return {k: getattr(llm, k) for k in keys} | {"device": str(llm.device)}


def _error_info(e: BaseException) -> tuple[str, str, str]:
    return type(e).__name__, str(e), "".join(traceback.format_exception(type(e), e, e.__traceback__))


def _stop(procs, inboxes, store_dir: str) -> None:
    """Stop every rank: a stop message, a join with a deadline, then a kill. Idempotent."""
    import time

    for q in inboxes:
        try:
            q.put(None)
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(5.0)
    shutil.rmtree(store_dir, ignore_errors=True)


class DataParallelGroup:
    """The caller's side of ``data_parallel_size`` engine processes (see the module docstring).

    Args:
        model: a preset name or a checkpoint folder (each rank loads it).
        llm_kwargs: the rank ``LLM``'s keyword arguments (``config``: the ``EngineConfig``, ``tokenizer``, ...).
    Raises:
        DataParallelError (or the rank's ValueError / OSError / TypeError, naming the rank) when a rank fails to
        start; every rank is stopped first.
    """

    def __init__(self, model, llm_kwargs: dict) -> None:
        import torch.multiprocessing as mp

        cfg = llm_kwargs["config"]
        self.world = cfg.data_parallel_size
        self._store_dir = tempfile.mkdtemp(prefix="deepinfer-dp-")
        ctx = mp.get_context("spawn")
        self._inboxes = [ctx.Queue() for _ in range(self.world)]
        self._outbox = ctx.Queue()
        self._next_call = 1
        self._dead_since = None  # when a dead rank was first seen
        self.serving = False  # the ranks run their serve loops (``start_serving``)
        self.error: str | None = None  # why the group stopped, once it has
        pctx = mp.start_processes(_rank_main, nprocs=self.world, join=False, start_method="spawn",
                                  args=(self.world, os.path.join(self._store_dir, "store"), model, llm_kwargs,
                                        self._inboxes, self._outbox))
        self._procs = pctx.processes
        self._finalizer = weakref.finalize(self, _stop, self._procs, self._inboxes, self._store_dir)
        self.infos = self._gather(0, "start-up")  # per rank: its limits, names and start-up report

    def pids(self) -> list[int]:
        """The ranks' process ids, by rank."""
        return [p.pid for p in self._procs]

    def close(self) -> None:
        """Stop every rank (idempotent)."""
        self._finalizer()
        if self.error is None:
            self.error = "the data-parallel group was closed"

    def _fail(self, message: str, kind: str = "") -> None:
        self.error = message
        for p in self._procs:  # the ranks' collectives are in an unknown state: no graceful exit to wait for
            if p.is_alive():
                p.kill()
        self._finalizer()
        exc = {"ValueError": ValueError, "TypeError": TypeError, "OSError": OSError,
               "FileNotFoundError": OSError}.get(kind, DataParallelError)
        raise exc(message)

    def _recv(self, timeout: float, what: str, done=()):
        """The next message ``(tag, call_id, rank, payload)`` within ``timeout`` seconds, or None. Raises (after
        stopping every rank) for a rank's error message, or a rank not in ``done`` whose process is gone."""
        import time

        try:
            tag, cid, rank, payload = self._outbox.get(timeout=timeout)
        except queue.Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(self._procs) if p.exitcode is not None and r not in done]
            if dead and self._dead_since is None:  # its last message may still be on the way: give it a moment
                self._dead_since = time.monotonic()
            elif dead and time.monotonic() - self._dead_since > DEAD_GRACE_S:
                r, code = dead[0]
                self._fail(f"data-parallel rank {r} exited with code {code} during {what} (killed or crashed); "
                           f"every rank was stopped")
            return None
        if tag == "error":
            kind, msg, tb = pickle.loads(payload)
            if kind in ("ValueError", "TypeError", "OSError", "FileNotFoundError", "CheckpointError") \
                    and what == "start-up":
                self._fail(f"data-parallel rank {rank}: {msg}", "ValueError" if kind == "CheckpointError" else kind)
            self._fail(f"data-parallel rank {rank} failed during {what}: {kind}: {msg}\n{tb}")
        return tag, cid, rank, payload

    def _gather(self, call_id: int, what: str) -> list:
        """Every rank's reply to ``call_id``, by rank."""
        got: dict[int, object] = {}
        while len(got) < self.world:
            msg = self._recv(POLL_S, what, got)
            if msg is None or msg[1] != call_id:
                continue  # nothing yet, or a late reply to an abandoned call
            got[msg[2]] = pickle.loads(msg[3])
        return [got[r] for r in range(self.world)]

    # serving (``parallel.serve``) ----------------------------------------------------------------------------
    def start_serving(self) -> None:
        """Start every rank's serve loop; from now on the group takes ``send`` / ``poll``, not ``call``."""
        if self.error is not None:
            raise DataParallelError(f"the data-parallel ranks are stopped: {self.error}")
        for q in self._inboxes:
            q.put(pickle.dumps((0, "serve", ())))
        self.serving = True  # ``call`` refuses from now on

    def send(self, rank: int, msg: tuple) -> None:
        self._inboxes[rank].put(pickle.dumps(msg))

    def poll(self, timeout: float) -> list[tuple[int, object]]:
        """``[(rank, payload)]`` of the serve loops' messages within ``timeout`` (then whatever else is queued)."""
        out = []
        msg = self._recv(timeout, "serving")
        while msg is not None:
            out.append((msg[2], pickle.loads(msg[3])))
            msg = self._recv(0.0, "serving")
        return out

    def call(self, method: str, shares: list[tuple]) -> list:
        """Run ``LLM.<method>(*shares[rank])`` on every rank; returns ``[(result, stats, dp_stats)]`` by rank.

        Raises:
            DataParallelError: a rank failed or died (the group is then stopped), or the group was stopped before.
            TypeError: a share cannot be pickled.
        """
        if self.error is not None:
            raise DataParallelError(f"the data-parallel ranks are stopped: {self.error}")
        if self.serving:
            raise RuntimeError("the data-parallel ranks are serving: generate / chat are not available")
        call_id = self._next_call
        self._next_call += 1
        msgs = [pickle.dumps((call_id, method, share)) for share in shares]  # fails here, before anything is sent
        for q, m in zip(self._inboxes, msgs):
            q.put(m)
        try:
            return self._gather(call_id, method)
        except KeyboardInterrupt:
            self.error = "interrupted"
            self._finalizer()
            raise
