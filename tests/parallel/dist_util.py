"""Run a test body in ``world`` gloo processes (torch.multiprocessing spawn), never hanging.

``run_distributed(fn, world, tmp_path, *args)`` spawns ``world`` processes; each initialises the default process
group with the ``gloo`` backend from a file store in ``tmp_path`` (no ports to race for) and a collective timeout,
runs ``fn(rank, world, *args)``, and destroys the group. The parent joins with a deadline: a process that is still
running then is killed and the test fails naming the ranks; an exception in a rank fails the test with its
traceback.
"""

from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 60
JOIN_TIMEOUT_S = 240


def _entry(rank: int, world: int, store: str, fn, args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world: int, tmp_path, *args, timeout_s: float = JOIN_TIMEOUT_S) -> None:
    store = os.path.join(str(tmp_path), f"store-{time.monotonic_ns()}")
    ctx = mp.start_processes(_entry, args=(world, store, fn, args), nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
        if time.monotonic() > deadline:
            alive = [i for i, p in enumerate(ctx.processes) if p.is_alive()]
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            for p in ctx.processes:
                p.join(10)
            raise AssertionError(f"distributed test did not finish within {timeout_s} s; ranks still running: {alive}")
