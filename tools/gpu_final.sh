python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/python:$PWD/engine:$PWD PYTHONUNBUFFERED=1
DEEPINFER_BUILD_CUDA=1 DEEPINFER_BUILD_DIR=/tmp/deepinfer-build MAX_JOBS=16 python3 setup.py -q build_ext --inplace > $OUT/build.log 2>&1 || { tail -50 $OUT/build.log; exit 1; }
DEEPINFER_REQUIRE_CUDA=1 timeout 120 python3 -m pytest -q -rs -m cuda tests/engine/test_engine_core.py tests/engine/test_sampler.py tests/engine/test_deepseek_v4_cuda.py > $OUT/pytest.log 2>&1; tail -3 $OUT/pytest.log
timeout 200 python3 bench/bench_engine.py --sweep --num-layers 43 --num-experts 8 --max-num-batched-tokens 65536 --core-modes graphs+async --work-dir /tmp --out-dir $OUT --decode-batches 1,2,4,8,16,32,64,128,256 --prefill-tokens 1024,2048,4096,8192,16384,32768,65536 --results-name bench_engine_curves > $OUT/curves.log 2>&1; echo curves rc=$?; grep -c '"op"' $OUT/curves.log
timeout 200 python3 bench/bench_serve.py --work-dir /tmp --out-dir $OUT > $OUT/serve.log 2>&1; echo serve rc=$?; tail -5 $OUT/serve.log | cut -c1-300
