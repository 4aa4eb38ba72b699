"""Every environment variable deepinfer reads, declared in one place (prefix ``DEEPINFER_``).

Build time (read by setup.py / CMakeLists.txt, listed here for reference):
    DEEPINFER_BUILD_CUDA   ``auto`` (default), ``1`` or ``0``
    DEEPINFER_CUDA_ARCHS   CUDA archs, default ``90a`` (e.g. ``90a;100a``)
    DEEPINFER_BUILD_DIR    CMake build folder
Run time:
    DEEPINFER_ACCELERATOR  ``auto`` (default), ``nvidia``, ``ascend`` or ``cpu``: the backend the engine runs on.
    DEEPINFER_REQUIRE_CUDA ``1`` makes the test suite fail, instead of skip, when no CUDA device is usable
                           (tools/gpu_check.sh sets it: a skipped GPU test is not a passed one).
    DEEPINFER_DEBUG        ``1``: the ``deepinfer`` CLI re-raises errors with their traceback instead of one line.
    DEEPINFER_CACHE_DIR    where generated artefacts (the built-in tiny checkpoint) are kept;
                           default ``$XDG_CACHE_HOME/deepinfer`` or ``~/.cache/deepinfer``.
A/B switch (read by the CUDA op at each call, so that one process can time both kernels; another value makes the
op raise, naming the variable):
    DEEPINFER_HC_MIX_MMA   ``1`` (default) or ``0``: ``0`` runs bf16 hc_mix on the FMA kernel instead of the
                           tensor-core one (bench/NOTES-engine.md section 8).
"""

from __future__ import annotations

import os
from pathlib import Path

ACCELERATORS = ("auto", "nvidia", "ascend", "cpu")


def accelerator() -> str:
    """``DEEPINFER_ACCELERATOR``, lower-cased; raises ValueError naming the variable if it is not one of ACCELERATORS."""
    value = os.environ.get("DEEPINFER_ACCELERATOR", "auto").strip().lower() or "auto"
    if value not in ACCELERATORS:
        raise ValueError(f"DEEPINFER_ACCELERATOR={value!r} is not one of {', '.join(ACCELERATORS)}")
    return value


def cache_dir() -> Path:
    """``DEEPINFER_CACHE_DIR`` or the XDG cache folder for deepinfer."""
    env = os.environ.get("DEEPINFER_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "deepinfer"


def require_cuda() -> bool:
    """``DEEPINFER_REQUIRE_CUDA=1``: CUDA tests must run (fail rather than skip)."""
    return os.environ.get("DEEPINFER_REQUIRE_CUDA", "0").strip() in ("1", "true", "yes")


def debug() -> bool:
    """``DEEPINFER_DEBUG=1``: show tracebacks instead of one-line CLI errors."""
    return os.environ.get("DEEPINFER_DEBUG", "0").strip() in ("1", "true", "yes")
