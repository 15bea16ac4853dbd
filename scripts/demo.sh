#!/usr/bin/env bash
# The main job on a fresh machine: install, fetch the demo model, answer a question on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
kog pull smollm2-135m
kog run --model smollm2-135m --verbose "${1:-What is the capital of France?}"
