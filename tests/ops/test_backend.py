"""DEEPINFER_ACCELERATOR selection and its error messages."""

import pytest
import torch

import deepinfer_ops
from deepinfer_ops import BackendUnavailableError, select_accelerator


def test_cpu_and_auto(monkeypatch):
    assert select_accelerator("cpu") == "cpu"
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "auto")
    expected = "nvidia" if deepinfer_ops.BUILT_WITH_CUDA and torch.cuda.is_available() else "cpu"
    assert select_accelerator() == expected


def test_ascend_names_the_missing_toolkit():
    with pytest.raises(BackendUnavailableError, match="CANN"):
        select_accelerator("ascend")


def test_nvidia_without_gpu_names_what_is_missing():
    if deepinfer_ops.BUILT_WITH_CUDA and torch.cuda.is_available():
        assert select_accelerator("nvidia") == "nvidia"
    else:
        with pytest.raises(BackendUnavailableError, match="without CUDA|no CUDA device"):
            select_accelerator("nvidia")


def test_unknown_accelerator_named(monkeypatch):
    monkeypatch.setenv("DEEPINFER_ACCELERATOR", "tpu")
    with pytest.raises(ValueError, match="DEEPINFER_ACCELERATOR='tpu'"):
        select_accelerator()


def test_topk_tie_rule():
    scores = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    values, idx = deepinfer_ops.topk(scores, 3)
    assert idx.tolist() == [[1, 2, 4], [0, 1, 2]]
    with pytest.raises(ValueError, match="k=6"):
        deepinfer_ops.topk(scores, 6)
