#!/bin/bash
# Device-call driver (H200). Phases given as arguments, run in order, logs under $OUT:
#   needcard   stop the call at once unless the card's name contains NEED_CARD (default H200): an A/B
#              that an H100 cannot answer costs ~30 s of device time instead of the whole call (session 25)
#   setup      install the carried wheels (.whl: kog + pydantic & co built here); always first
#   setupold   also install .whl_old's kog (a baseline build) beside it; SITE=/tmp/site_old picks it
#   smolpart1  keep the SmolLM2 GGUF's first half (.devcarry/smol/part.aa) in /root/smol for the next call
#   check      selfcheck, then the GPU tests (SmolLM2 too when both GGUF halves are there)
#   bench      `kog bench` for the three presets (MODELS), default build, with the breakdown (BENCH_ARGS:
#              more `kog bench` arguments, e.g. "--temperature 1 --top-p 0.9"; LOGTAG: a log name prefix)
#   masks      per-token time under the breakdown's skip masks (MASKS: comma-separated, e.g. 0x40,0xc0;
#              MMODEL: the preset, default bench-2b), default build
#   variants   bench-2b under tuning variants (VARIANTS: KOG_HOPPER_* settings, comma-joined per variant)
#   peer       the torch peer (.devcarry/torch_peer.py) for the same shapes
#   sanitize   compute-sanitizer memcheck and racecheck on the selfcheck model (SAN_K: on the GPU tests
#              matching this -k expression instead; SAN_TIMEOUT per tool, default 90 s)
#   pick       export the fastest of the variants just run (KOG_HOPPER_* settings) for later phases
#   trace      per-stage timestamps (trace.py) for TRACE_PRESETS under each of TRACE_ENVS (TRACE_ARGS:
#              more trace.py arguments, e.g. "--at 1100 --tokens 1200")
#   probe      the weight stream alone (stream_probe.py): ring and plain-load TB/s, pauses, load
#              latency while streaming, the ring from L2, consumer time per item, instruction
#              fetch and the instruction caches (PROBE_ARGS="--round 6 7", "--round 10 11")
#   tagbisect  bench-2b's preset GPU test (TAG_QKV's session-26 failure) with KOG_HOPPER_TAG_QKV=1, with
#              it and TAG_QKV_WAIT=1 (the counter wait kept), and with TAG_OPROJ=1: the first failure's
#              E lines each (perf notes, session 26); BISECT_VARIANTS / BISECT_K for others, and the
#              kernel's TAGCHK lines (KOG_HOPPER_DEFINES=TAG_CHECK=1)
#   pack       last: everything under $OUT into one out.tgz (a call returns at most 8 files)
# Carried paths (gitignored; rebuild them in a new checkout, python 3.12 wheels for the device):
#   .whl      kog's wheel (`.venv/bin/pip wheel --no-deps --no-build-isolation -w .whl .`, again after
#             every change) and what the device image lacks: `python3 -m pip download --no-deps
#             --only-binary=:all: --python-version 3.12 --implementation cp --platform
#             manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
#             -d .whl pydantic pydantic-core annotated-types typing-inspection gguf cuda-bindings==13.0.*
#             cuda-python==13.0.* cuda-pathfinder` (the versions the local .venv has; not nvrtc: the
#             image has it, and its wheel would exceed the 64 MiB a call carries)
#   .devcarry/torch_peer.py   a copy of ../shared/bench/torch_peer.py
#   .devcarry/smol/part.aa, part.ab   `kog pull smollm2-135m`'s GGUF cut in two (`split -n 2 FILE part.`):
#             each call carries one half (smolpart1 keeps the first on the machine for the next call).
#             A machine goes back 30 s after a call: make the second call at once, e.g. carry
#             [".whl", ".smolA", ".devcarry/torch_peer.py"] (part.aa in .smolA, listed in
#             .git/info/exclude) with `cp .smolA/part.aa /root/smol/` and a bench, then
#             [".whl", ".devcarry"] (part.ab in .devcarry/smol) with check (session 20)
set -u
export PYTHONUNBUFFERED=1 KOG_CACHE=/tmp/kogcache
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
for phase in "$@"; do case $phase in
needcard)
  card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  echo "$card" | grep -q "${NEED_CARD:-H200}" || { echo "card: $card, not ${NEED_CARD:-H200}: stopping"; exit 3; } ;;
setup)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >$OUT/pip.log 2>&1 || { echo "pip failed"; tail -3 $OUT/pip.log; }
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader ;;
setupold)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site_old .whl_old/*.whl $(ls .whl/*.whl | grep -v kog-) >$OUT/pip_old.log 2>&1 || { echo "pip (old) failed"; tail -3 $OUT/pip_old.log; } ;;
smolpart1)
  mkdir -p /root/smol && cp .devcarry/smol/part.aa /root/smol/ && echo "part.aa kept" ;;
check)
  export PYTHONPATH=${SITE:-/tmp/site}
  if [ -f /root/smol/part.aa ] && [ -f .devcarry/smol/part.ab ]; then
    cat /root/smol/part.aa .devcarry/smol/part.ab > /tmp/smol.gguf
    echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/smol.gguf" | sha256sum -c --quiet && export KOG_TEST_GGUF=/tmp/smol.gguf && echo "SmolLM2 GGUF reassembled"
  fi
  echo "selfcheck: $(timeout 60 python3 -m kog_nvidia_hopper.selfcheck 2>&1 | tail -1 | cut -c1-300)"
  # -v: each test's FAILED line as it happens, so a run cut by the timeout still names its failures;
  # --durations: the slowest tests, to keep the suite inside one call
  timeout ${CHECK_TIMEOUT:-320} python3 -m pytest -v -p no:cacheprovider -rs --durations=10 tests/gpu ${CHECK_K:+-k "$CHECK_K"} 2>&1 | tee $OUT/pytest.log | grep -E " passed| failed|FAILED|SKIPPED|Error|^[0-9.]+s (call|setup) " | cut -c1-300
  [ "${PIPESTATUS[0]}" = 124 ] && echo "pytest timed out after ${CHECK_TIMEOUT:-320} s: $(grep -c ' PASSED' $OUT/pytest.log) passed, $(grep -c ' FAILED' $OUT/pytest.log) failed so far" ;;
bench)
  export PYTHONPATH=${SITE:-/tmp/site}
  for m in ${MODELS:-bench-2b llama-3.2-1b laneformer-2b}; do
    timeout 120 python3 -m kog_core.cli bench --backend nvidia_hopper --model $m --random-weights --context-length 4096 ${BENCH_ARGS:-} > $OUT/kb_${LOGTAG:-}$m.log 2>&1
    echo "== $m rc=$?"; grep -E "^(decode|bandwidth|prefill|kernel)|us/token|Error|error" $OUT/kb_${LOGTAG:-}$m.log | cut -c1-200
  done ;;
masks)
  export PYTHONPATH=${SITE:-/tmp/site}
  timeout 150 python3 -m kog_nvidia_hopper.bench --preset ${MMODEL:-bench-2b} --tokens 512 --no-breakdown --masks "${MASKS:-0x40,0xc0,0x44,0xc4}" > $OUT/masks_${MMODEL:-bench-2b}.log 2>&1
  echo "== masks ${MMODEL:-bench-2b} rc=$?"; python3 -c "import json,sys; r=json.loads([l for l in open(sys.argv[1]) if l.startswith('{')][-1]); print(r['tok_s'], r['masks'])" $OUT/masks_${MMODEL:-bench-2b}.log 2>&1 | cut -c1-400 ;;
variants)
  export PYTHONPATH=${SITE:-/tmp/site}
  for v in ${VARIANTS:-"KOG_HOPPER_SLOT_KB=16" "KOG_HOPPER_ITEM_ROWS=16" "KOG_HOPPER_SLOT_KB=48"}; do
    env ${v//,/ } timeout 90 python3 -m kog_nvidia_hopper.bench --preset ${VMODEL:-bench-2b} --tokens 512 --no-breakdown > $OUT/var.log 2>&1
    echo "== $v rc=$?: $(tail -1 $OUT/var.log | cut -c1-200)"
    echo "$v $(tail -1 $OUT/var.log | awk '{print $2}')" >> $OUT/var_results.txt
  done
  cp $OUT/var_results.txt /root/var_results.txt ;;  # for a pick in the next call
pick)  # export the fastest variant's settings for the phases after it, if it beats the first
       # variant (the baseline) by more than PICK_MARGIN (a fraction, default 0)
  [ -f $OUT/var_results.txt ] || cp /root/var_results.txt $OUT/
  base=$(head -1 $OUT/var_results.txt | awk '{print $2}')
  read -r best val < <(sort -k2 -g -r $OUT/var_results.txt | head -1)
  awk "BEGIN{exit !($val > $base * (1 + ${PICK_MARGIN:-0}))}" || read -r best val < $OUT/var_results.txt
  for kv in ${best//,/ }; do export "$kv"; done
  echo "picked: $best ($val tok/s; first variant $base)" ;;
peer)
  export PYTHONPATH=${SITE:-/tmp/site}
  for p in ${PEERS:-bench-2b llama-3.2-1b laneformer-2b-dense}; do
    timeout ${PEER_TIMEOUT:-110} python3 .devcarry/torch_peer.py --preset $p --tokens 512 --modes compiled > $OUT/peer_$p.log 2>&1; tail -1 $OUT/peer_$p.log | cut -c1-400
  done ;;
sanitize)
  export PYTHONPATH=${SITE:-/tmp/site}
  for tool in ${SAN_TOOLS:-memcheck racecheck}; do
    if [ -n "${SAN_K:-}" ]; then  # the GPU tests matching SAN_K instead of the selfcheck
      timeout ${SAN_TIMEOUT:-90} compute-sanitizer --tool $tool --print-limit 10 python3 -m pytest -q -p no:cacheprovider tests/gpu -k "$SAN_K" > $OUT/san_$tool.log 2>&1
    else
      timeout ${SAN_TIMEOUT:-90} compute-sanitizer --tool $tool --print-limit 10 python3 -m kog_nvidia_hopper.selfcheck > $OUT/san_$tool.log 2>&1
    fi
    echo "$tool rc=$?: $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|selfcheck ok|passed|failed" $OUT/san_$tool.log | tr '\n' ' ' | cut -c1-300)"
  done ;;
trace)
  export PYTHONPATH=${SITE:-/tmp/site}
  for m in ${TRACE_PRESETS:-bench-2b}; do for v in ${TRACE_ENVS:-"KOG_HOPPER_PREFETCH=0"}; do
    f=$OUT/trace_${m}_${v//[^A-Za-z0-9]/_}${TRACE_SKIP:+_skip$TRACE_SKIP}  # a second trace phase must not overwrite the first
    env ${v//,/ } timeout 120 python3 -m kog_nvidia_hopper.trace --preset $m ${TRACE_SKIP:+--skip $TRACE_SKIP} ${TRACE_ARGS:-} --save $f.npz > $f.log 2>&1
    echo "== trace $m $v rc=$?"; head -1 $f.log | cut -c1-200; grep -A12 "^token:" $f.log | cut -c1-120
  done; done ;;
probe)
  export PYTHONPATH=${SITE:-/tmp/site}
  timeout ${PROBE_TIMEOUT:-120} python3 -m kog_nvidia_hopper.stream_probe ${PROBE_ARGS:-} --json $OUT/probe.json 2>&1 | tee $OUT/probe.log | cut -c1-200 ;;
tagbisect)
  export PYTHONPATH=${SITE:-/tmp/site}
  # TAG_CHECK=1: each value taken by its parity compared with a read after the counter wait (TAGCHK lines)
  for v in ${BISECT_VARIANTS:-"KOG_HOPPER_TAG_QKV=1" "KOG_HOPPER_TAG_QKV=1,KOG_HOPPER_DEFINES=TAG_QKV_WAIT=1" "KOG_HOPPER_TAG_OPROJ=1"}; do
    env ${v//,/ } timeout ${BISECT_TIMEOUT:-60} python3 -m pytest -x -q -s -p no:cacheprovider tests/gpu \
      -k "${BISECT_K:-test_benchmark_preset_matches_reference and bench-2b}" > $OUT/bisect.log 2>&1
    echo "== $v: $(tail -1 $OUT/bisect.log | cut -c1-120)"; grep -E "^E " $OUT/bisect.log | head -4 | cut -c1-200
    grep -E "^TAGCHK " $OUT/bisect.log | head -${BISECT_LINES:-12}; echo "TAGCHK lines: $(grep -c '^TAGCHK' $OUT/bisect.log)"
  done ;;
pack)
  tar czf /tmp/out.tgz -C $OUT . && find $OUT -type f -delete && mv /tmp/out.tgz $OUT/out.tgz && echo "packed: out.tgz" ;;
esac; done
