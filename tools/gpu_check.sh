#!/usr/bin/env bash
# One device call: build deepinfer_ops on the GPU machine from the working tree, run the test suite with CUDA
# required (a skipped GPU test fails the run), run the benchmarks, and leave logs + JSON under $OUT.
#
# It also runs the main job (deepinfer generate over examples/requests.jsonl) on the GPU.
# Usage (from the repository root, on a machine with an NVIDIA GPU):
#   tools/gpu_check.sh [bench_name ...]        # default: every bench/bench_*.py; "none": no benchmark
# Environment:
#   OUT                 where logs and results go (default ./gpu_out)
#   PYTEST_ARGS         extra pytest arguments (default: the whole tests/ folder); split on spaces, so leave out
#                       -k expressions with spaces ("not x") and use --deselect NODE_ID instead
#   DEEPINFER_COMMIT    commit id recorded in the results (the tree may travel without .git)
#   BENCH_ARGS_<bench>  extra arguments for one benchmark script (e.g. BENCH_ARGS_bench_engine=--profile)
#   DEEPINFER_CUDA_ARCHS  default 90a
#   DEEPINFER_SKIP_BUILD=1  keep a deepinfer_ops/_C*.so that imports (one carried from an earlier call's build)
# Wheels for packages missing on the GPU machine (nvidia-cutlass, ...) are installed from .whl/ if present:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl nvidia-cutlass==4.2.0.0
# then carry .whl with the device call.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT/results"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  # .whl/serve/: the server stack for bench_serve (docs/serving.md)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    $(compgen -G ".whl/serve/*.whl") || { echo "wheel install failed"; exit 1; }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/python:$PWD/engine:$PWD${PYTHONPATH:+:$PYTHONPATH}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"

echo "== build" | tee "$OUT/build.log"
t0=$(date +%s)
if [ "${DEEPINFER_SKIP_BUILD:-0}" = 1 ] && python3 -c "import deepinfer_ops._C" 2>>"$OUT/build.log"; then
  echo "build skipped: deepinfer_ops._C imports" | tee -a "$OUT/build.log"
else
DEEPINFER_BUILD_CUDA=1 DEEPINFER_BUILD_DIR=/tmp/deepinfer-build MAX_JOBS=${MAX_JOBS:-16} \
  python3 setup.py -q build_ext --inplace >>"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; echo "BUILD FAILED"; exit 1; }
echo "build took $(( $(date +%s) - t0 )) s" | tee -a "$OUT/build.log"
fi

echo "== tests"
DEEPINFER_REQUIRE_CUDA=1 python3 -m pytest -q -rs ${PYTEST_ARGS:-tests} >"$OUT/pytest.log" 2>&1
test_rc=$?
tail -25 "$OUT/pytest.log"
echo "== main job on the GPU: deepinfer generate over examples/requests.jsonl (built-in tiny model)"
DEEPINFER_ACCELERATOR=nvidia DEEPINFER_CACHE_DIR=/tmp/deepinfer-cache timeout ${GENERATE_TIMEOUT:-240} \
  python3 -m deepinfer.cli generate --input examples/requests.jsonl --output "$OUT/generate.jsonl" \
  >"$OUT/generate.log" 2>&1
gen_rc=$?
tail -c 600 "$OUT/generate.log" | tr '\r' '\n' | tail -3
echo "generate rc=$gen_rc: $(wc -l <"$OUT/generate.jsonl" 2>/dev/null || echo 0) result lines for $(wc -l <examples/requests.jsonl) requests"

echo "== benchmarks"
benches=("$@")
if [ "${benches[*]}" = none ]; then
  benches=()
elif [ ${#benches[@]} -eq 0 ]; then
  for f in bench/bench_*.py; do benches+=("$(basename "$f" .py)"); done
fi
bench_rc=0
for b in "${benches[@]}"; do
  echo "-- $b" | tee -a "$OUT/bench.log"
  extra="BENCH_ARGS_$b"
  python3 "bench/$b.py" --out-dir "$OUT/results" ${!extra:-} >>"$OUT/bench.log" 2>&1 || { bench_rc=1; echo "$b FAILED" | tee -a "$OUT/bench.log"; }
done
[ ${#benches[@]} -eq 0 ] || grep -E "^(--|geomean|wrote)|FAILED|Error" "$OUT/bench.log" | tail -40
echo "tests rc=$test_rc generate rc=$gen_rc bench rc=$bench_rc"
exit $(( test_rc != 0 || gen_rc != 0 || bench_rc != 0 ))
