#!/usr/bin/env bash
# Creates .venv (if missing) and installs kog with every extra the tests need. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
# setuptools/wheel first: the tests build the out-of-tree example plugin without build isolation.
python -m pip install --quiet "setuptools>=77" wheel
python -m pip install --quiet -e ".[test,serve,nvidia]"
