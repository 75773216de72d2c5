#!/usr/bin/env bash
# Install the project with its test dependencies into .venv and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[test]"
exec .venv/bin/python -m pytest -q "$@"
