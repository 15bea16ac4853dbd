#!/bin/bash
# One full device call: environment, GPU tests, benchmark + torch peer. Logs under $OUT.
# usage: bash plugins/nvidia_hopper/devrun.sh [tests|bench|all|sanitize] [presets...]
set -u
what=${1:-all}; shift || true
presets=${*:-bench-2b llama-3.2-1b}
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1
mkdir -p /tmp/kogpath
for d in nvidia_hopper moe_standard_tp laneformer kccl amd_cdna3; do ln -sfn $PWD/plugins/$d /tmp/kogpath/kog_$d; done
export PYTHONPATH=/tmp/site:/tmp/kogpath:$PWD
export KOG_CACHE=/tmp/kogcache
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
if [ "$what" = env ] || [ "$what" = all ]; then
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee $OUT/env.txt
  python3 -m pip show cuda-bindings nvidia-cuda-nvrtc 2>/dev/null | grep -E "^(Name|Version)" | tee -a $OUT/env.txt
fi
if [ "$what" = tests ] || [ "$what" = all ]; then
  timeout 300 python3 -m pytest -x -q -p no:cacheprovider tests/gpu ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 | tee $OUT/pytest.log | tail -40
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
  for p in $presets; do
    timeout 240 python3 -m kog_nvidia_hopper.bench --preset $p --tokens 512 --json $OUT/bench_$p.json 2>&1 | tee -a $OUT/bench.log | tail -5
  done
fi
if [ "$what" = peer ] || [ "$what" = all ]; then
  for p in $presets; do
    pp=$p; [ $p = laneformer-2b ] && pp=laneformer-2b-dense
    timeout 200 python3 .devcarry/torch_peer.py --preset $pp --tokens 512 --modes compiled 2>&1 | tee -a $OUT/peer.log | tail -2
  done
fi
if [ "$what" = sanitize ]; then
  for tool in memcheck racecheck; do
    timeout 200 compute-sanitizer --tool $tool --print-limit 20 python3 -m kog_nvidia_hopper.selfcheck 2>&1 | tee $OUT/sanitize_$tool.log | tail -8
  done
fi
