"""Server tests: a real uvicorn server on 127.0.0.1 at a free port, in a thread of the test process."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "engine"))  # fake_model
sys.path.insert(0, os.path.dirname(__file__))  # server_util

from server_util import RunningServer  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def one_cpu_thread():
    """Single-threaded torch for the module (the tiny model's small ops are slower with 2 threads on 2 cores)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def start_server():
    """``start_server(llm, config=None) -> RunningServer``; every server is shut down after the test."""
    servers = []

    def start(llm, config=None):
        s = RunningServer(llm, config)
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.close()
