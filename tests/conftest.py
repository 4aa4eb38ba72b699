"""Shared test setup: the `device` fixture runs a test on the CPU and, where available, on CUDA.

CUDA cases carry the `cuda` marker. Without a usable GPU they skip, saying why -- unless
DEEPINFER_REQUIRE_CUDA=1 (set by tools/gpu_check.sh), where they fail instead: a skipped GPU test is not a pass.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_ops import BUILT_WITH_CUDA, envs


def cuda_unavailable_reason() -> str | None:
    if not BUILT_WITH_CUDA:
        return "deepinfer_ops was built without CUDA"
    if not torch.cuda.is_available():
        return "no CUDA device on this machine (run tools/gpu_check.sh on the GPU machine)"
    return None


def pytest_generate_tests(metafunc):
    if "device" in metafunc.fixturenames:
        metafunc.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])


def pytest_collection_modifyitems(config, items):
    reason = cuda_unavailable_reason()
    if reason is None:
        return
    if envs.require_cuda():
        raise pytest.UsageError(f"DEEPINFER_REQUIRE_CUDA=1 but {reason}")
    skip = pytest.mark.skip(reason=f"CUDA test skipped: {reason}")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
