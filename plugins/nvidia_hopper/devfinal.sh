#!/bin/bash
# The last device call of the 2026-12-02 session: tests, benchmark, sanitizers, variants, peer.
set -u
export PYTHONUNBUFFERED=1
bash plugins/nvidia_hopper/devrun.sh tests
bash plugins/nvidia_hopper/devrun.sh bench bench-2b llama-3.2-1b
export PYTHONPATH=/tmp/site:/tmp/kogpath:$PWD KOG_CACHE=/tmp/kogcache
for tool in memcheck racecheck; do
  timeout 60 compute-sanitizer --tool $tool --print-limit 10 python3 -m kog_nvidia_hopper.selfcheck > $OUT/sanitize_$tool.log 2>&1; echo "$tool rc=$?"; tail -3 $OUT/sanitize_$tool.log
done
for v in "8 0" "4 1"; do set -- $v
  KOG_HOPPER_UNROLL=$1 KOG_HOPPER_PRELOAD=$2 timeout 45 python3 -m kog_nvidia_hopper.bench --preset bench-2b --no-breakdown 2>&1 | grep '^{' | tee -a $OUT/variants.log | cut -c1-200
done
timeout 95 python3 .devcarry/torch_peer.py --preset bench-2b --tokens 512 --modes compiled 2>&1 | tee -a $OUT/peer.log | tail -1
