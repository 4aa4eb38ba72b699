"""Engine tests: a deterministic fake model stands in for DeepSeek-V4 (see fake_model.py)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture(scope="module")
def one_cpu_thread():
    """Run a module single-threaded and restore the setting after: the tiny model's small CPU ops and GEMMs are far
    slower with 2 threads on a shared 2-core box (thread hand-off dominates); results hold for any fixed thread
    count. Use with ``pytestmark = pytest.mark.usefixtures("one_cpu_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def cpu_accelerator():
    """Run a module's engines on the CPU also where CUDA is present (``DEEPINFER_ACCELERATOR=cpu``): its checks are
    of the CPU path's behaviour (the default step cost, bitwise repeats). Use with ``pytest.mark.usefixtures``."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_ACCELERATOR", "cpu")
        yield
