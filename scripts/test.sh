#!/usr/bin/env bash
# The test suite on a fresh machine (CPU): GPU-marked tests skip with their reason.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
kog pull smollm2-135m   # the demo model the end-to-end tests use
python -m pytest -q -rs "$@"
