#!/usr/bin/env bash
# Install the project with its test dependencies into .venv and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
# the dashboard's browser tests drive Debian's headless Chromium; the image tests write progressive
# JPEGs with libjpeg-turbo's jpegtran
if ! command -v chromedriver >/dev/null || ! command -v jpegtran >/dev/null; then
  sudo=$([ "$(id -u)" -eq 0 ] || echo sudo)
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq chromium chromium-driver libjpeg-turbo-progs >/dev/null
fi
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[test]"
# two workers (pytest-xdist), one thread each (tests/conftest.py), a module to a worker: its fixtures' services start
# once; on this project's 2-core machine 54 minutes against 102 in one process (docs/benchmark.md); -n 0 runs in one
exec .venv/bin/python -m pytest -q -n 2 --dist loadscope "$@"
