#!/usr/bin/env bash
# Set up (or refresh) the project's virtualenv .venv and build deepinfer into it. Idempotent.
#   - torch: reused if .venv already has it, else `pip install torch==2.14.1` (DEEPINFER_TORCH_SPEC overrides).
#   - deepinfer: `pip install --no-build-isolation -e .[test,cuda]`, which compiles deepinfer_ops._C with CMake +
#     ninja against that torch (CPU kernels always; CUDA kernels too when nvcc is found, see README).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
# build requirements first: --no-build-isolation builds against what is already installed
"$VPY" -m pip install -q --upgrade pip "setuptools>=77" wheel ninja "cmake>=3.24" numpy "nvidia-cutlass==4.2.0.0"
if ! "$VPY" -c "import torch" 2>/dev/null; then
  "$VPY" -m pip install -q "${DEEPINFER_TORCH_SPEC:-torch==2.14.1}"
fi
MAX_JOBS=${MAX_JOBS:-$(nproc)} "$VPY" -m pip install -q --no-build-isolation -e ".[test,cuda]"
# status to stderr: stdout stays clean for the command chained after this one (e.g. JSONL on --output -)
"$VPY" -c "import deepinfer_ops, sys, torch; print('deepinfer_ops ready: torch', torch.__version__, '| CUDA kernels built:', deepinfer_ops.BUILT_WITH_CUDA, file=sys.stderr)"
