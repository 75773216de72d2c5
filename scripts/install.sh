#!/usr/bin/env bash
# Install the project into .venv (torch is pinned to the CPU build 2.13.0).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[bench]"
