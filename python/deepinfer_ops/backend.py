"""Runtime backend selection: which accelerator the engine runs on.

``DEEPINFER_ACCELERATOR=nvidia|ascend|cpu`` (default ``auto``: nvidia when the extension was built with CUDA
and a GPU is visible, else cpu). Ops themselves dispatch on the device of their tensors; this decides the
device the engine puts the model on.
"""

from __future__ import annotations

import torch

from . import _C, envs

BUILT_WITH_CUDA: bool = bool(_C.WITH_CUDA)


class BackendUnavailableError(RuntimeError):
    """The requested accelerator was not built into deepinfer_ops or is not present on this machine."""


def require_cuda(what: str) -> None:
    """Raise BackendUnavailableError ``"<what> but <the missing piece>"`` unless the CUDA kernels were built and a
    CUDA device is visible. ``what``: the request that needs CUDA (an env setting, a device argument)."""
    if not BUILT_WITH_CUDA:
        raise BackendUnavailableError(
            f"{what} but deepinfer_ops was built without CUDA (rebuild with nvcc on PATH and DEEPINFER_BUILD_CUDA=1)")
    if not torch.cuda.is_available():
        raise BackendUnavailableError(f"{what} but no CUDA device is visible")


def select_accelerator(requested: str | None = None) -> str:
    """Resolve the accelerator to ``"nvidia"`` or ``"cpu"``.

    Args:
        requested: ``auto``/``nvidia``/``ascend``/``cpu``; None reads ``DEEPINFER_ACCELERATOR``.
    Raises:
        BackendUnavailableError: naming what is missing ("built without CUDA", "no CUDA device",
            "no CANN toolkit: the Ascend backend is not built").
        ValueError: for an unknown name.
    """
    name = envs.accelerator() if requested is None else requested.strip().lower()
    if name not in envs.ACCELERATORS:
        raise ValueError(f"accelerator {name!r} is not one of {', '.join(envs.ACCELERATORS)}")
    if name == "auto":
        return "nvidia" if BUILT_WITH_CUDA and torch.cuda.is_available() else "cpu"
    if name == "nvidia":
        require_cuda("DEEPINFER_ACCELERATOR=nvidia")
        return "nvidia"
    if name == "ascend":
        raise BackendUnavailableError(
            "DEEPINFER_ACCELERATOR=ascend but deepinfer_ops was built without the Ascend backend (no CANN toolkit)")
    return "cpu"


def device_for(accelerator: str) -> torch.device:
    """torch device of a resolved accelerator name."""
    return torch.device("cuda") if accelerator == "nvidia" else torch.device("cpu")
