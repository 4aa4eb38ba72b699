"""Shared test setup: the `device` fixture runs a test on the CPU and, where available, on CUDA.

CUDA cases carry the `cuda` marker. Without a usable GPU they skip, saying why -- unless
DEEPINFER_REQUIRE_CUDA=1 (set by tools/gpu_check.sh), where they fail instead: a skipped GPU test is not a pass.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest
import torch

from deepinfer_ops import BUILT_WITH_CUDA, envs


def cuda_unavailable_reason() -> str | None:
    if not BUILT_WITH_CUDA:
        return "deepinfer_ops was built without CUDA"
    if not torch.cuda.is_available():
        return "no CUDA device on this machine (run tools/gpu_check.sh on the GPU machine)"
    return None


def pytest_configure(config):
    """Under pytest-xdist (``-n N``, as ``.ci/run`` runs) each worker and the processes it starts use one torch
    thread: N workers on N cores, not N x cores threads."""
    if hasattr(config, "workerinput"):
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def pytest_generate_tests(metafunc):
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])


_RAISE_TWICE = """
import torch, deepinfer_ops
for _ in range(2):
    try:
        deepinfer_ops.rms_norm(torch.zeros(2, 4), torch.ones(3), 1e-6)
    except RuntimeError:
        pass
"""


@functools.lru_cache(maxsize=None)
def native_errors_crash() -> bool:
    """True where a C++ exception thrown through an extension's frames kills the process (seen on the GPU
    machine's torch 2.11 image: the second such exception segfaults, for any extension, torch's own
    load_inline ones included). Probed once in a subprocess."""
    proc = subprocess.run([sys.executable, "-c", _RAISE_TWICE], capture_output=True, timeout=300)
    return proc.returncode != 0


def pytest_collection_modifyitems(config, items):
    native = [item for item in items if "native_errors" in item.keywords]
    if native and native_errors_crash():
        skip_native = pytest.mark.skip(
            reason="this machine's torch crashes when an extension raises a C++ exception twice; the error "
                   "messages are checked on machines where raising works (CI)")
        for item in native:
            item.add_marker(skip_native)
    reason = cuda_unavailable_reason()
    if reason is None:
        return
    if envs.require_cuda():
        raise pytest.UsageError(f"DEEPINFER_REQUIRE_CUDA=1 but {reason}")
    skip = pytest.mark.skip(reason=f"CUDA test skipped: {reason}")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
