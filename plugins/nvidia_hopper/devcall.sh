#!/bin/bash
# One full device call (H200): GPU tests and `kog bench` for the default kernel and the cp.async
# variant, diagnostics, the torch peer for the same shapes, sanitizers. Logs under $OUT.
# Carry: .whl (kog + pydantic wheels built here), .devcarry/torch_peer.py; for the SmolLM2 test
# the GGUF's first half in /root/smol/part.aa (copied by an earlier call) and .devcarry/smol/part.ab.
set -u
export PYTHONUNBUFFERED=1 KOG_CACHE=/tmp/kogcache
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >$OUT/pip.log 2>&1 || { echo "pip failed"; tail -3 $OUT/pip.log; }
export PYTHONPATH=/tmp/site
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > $OUT/env.txt
if [ -f /root/smol/part.aa ] && [ -f .devcarry/smol/part.ab ]; then
  cat /root/smol/part.aa .devcarry/smol/part.ab > /tmp/smol.gguf
  echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/smol.gguf" | sha256sum -c --quiet && export KOG_TEST_GGUF=/tmp/smol.gguf && echo "SmolLM2 GGUF reassembled"
fi
for v in 0 1; do echo "selfcheck CPASYNC=$v: $(KOG_HOPPER_CPASYNC=$v timeout 40 python3 -m kog_nvidia_hopper.selfcheck 2>&1 | tail -1)"; done
timeout 200 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu 2>&1 | tee $OUT/pytest.log | grep -E "passed|failed|FAILED|SKIPPED" | cut -c1-250
KOG_HOPPER_CPASYNC=1 timeout 150 python3 -m pytest -q -p no:cacheprovider tests/gpu -k "not smollm" 2>&1 | tee $OUT/pytest_cpasync.log | grep -E "passed|failed|FAILED" | cut -c1-250
timeout 40 python3 -m kog_nvidia_hopper.diagnose laneformer-replicate 3 > $OUT/diag.log 2>&1; head -40 $OUT/diag.log | cut -c1-160
for v in 0 1; do for m in bench-2b llama-3.2-1b laneformer-2b; do
  KOG_HOPPER_CPASYNC=$v timeout 100 python3 -m kog_core.cli bench --backend nvidia_hopper --model $m --random-weights --context-length 4096 > $OUT/kb_${m}_cp$v.log 2>&1
  echo "== $m CPASYNC=$v rc=$?"; grep -E "^(decode|bandwidth|prefill)|us/token" $OUT/kb_${m}_cp$v.log | cut -c1-160
done; done
for p in bench-2b llama-3.2-1b laneformer-2b-dense; do
  timeout 110 python3 .devcarry/torch_peer.py --preset $p --tokens 512 --modes compiled > $OUT/peer_$p.log 2>&1; tail -1 $OUT/peer_$p.log | cut -c1-400
done
for v in 0 1; do for tool in memcheck racecheck; do
  KOG_HOPPER_CPASYNC=$v timeout 45 compute-sanitizer --tool $tool --print-limit 10 python3 -m kog_nvidia_hopper.selfcheck > $OUT/san_${tool}_cp$v.log 2>&1
  echo "$tool CPASYNC=$v rc=$?: $(tail -1 $OUT/san_${tool}_cp$v.log)"
done; done
