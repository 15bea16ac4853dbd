#!/bin/bash
# One full device call (H200): GPU tests, diagnostics, `kog bench` on the three presets (and the
# opt-in weight ring on bench-2b), sanitizers, then the torch peer for the same shapes.
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
timeout 40 python3 -m kog_nvidia_hopper.selfcheck 2>&1 | tail -1
timeout 220 python3 -m pytest -q -p no:cacheprovider -rs tests/gpu 2>&1 | tee $OUT/pytest.log | grep -E "passed|failed|FAILED|SKIPPED|Error" | cut -c1-250
timeout 40 python3 -m kog_nvidia_hopper.diagnose laneformer-replicate 3 > $OUT/diag.log 2>&1; grep -E "pos |x |part" $OUT/diag.log | head -12
KOG_HOPPER_RING=1 timeout 40 python3 -m kog_nvidia_hopper.diagnose laneformer-replicate 3 > $OUT/diag_ring.log 2>&1; grep "pos " $OUT/diag_ring.log
for m in bench-2b llama-3.2-1b laneformer-2b; do
  timeout 100 python3 -m kog_core.cli bench --backend nvidia_hopper --model $m --random-weights --context-length 4096 > $OUT/kb_$m.log 2>&1
  echo "== $m rc=$?"; grep -E "^(decode|bandwidth|prefill)|us/token" $OUT/kb_$m.log | cut -c1-200
done
KOG_HOPPER_RING=1 KOG_HOPPER_SLOT_KB=64 timeout 80 python3 -m kog_core.cli bench --backend nvidia_hopper --model bench-2b \
  --random-weights --context-length 4096 > $OUT/kb_ring64.log 2>&1; echo "== bench-2b ring 64KB"; grep -E "^decode|MBU" $OUT/kb_ring64.log
for tool in memcheck racecheck; do
  timeout 90 compute-sanitizer --tool $tool --print-limit 10 python3 -m kog_nvidia_hopper.selfcheck > $OUT/sanitize_$tool.log 2>&1
  echo "$tool rc=$?"; tail -2 $OUT/sanitize_$tool.log
done
for p in bench-2b llama-3.2-1b laneformer-2b-dense; do
  timeout 110 python3 .devcarry/torch_peer.py --preset $p --tokens 512 --modes compiled > $OUT/peer_$p.log 2>&1; tail -1 $OUT/peer_$p.log | cut -c1-400
done
