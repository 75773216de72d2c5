#!/usr/bin/env bash
# The GPU path, checked and measured in one command: the suite's GPU tests (tests marked `gpu`),
# step times per method on the GPU in fp32, bf16 and bf16 + torch.compile, and with FULL=1 one
# full Split CIFAR-10 run of ER and of ASER_mu timed end to end. Figures go to
# results/gpu-<device>.json (and the speed files beside it). Without CUDA it says so and exits 0.
#
#   bash scripts/gpu-check.sh            # after scripts/install.sh (or with PYTHON=...)
#   FULL=1 bash scripts/gpu-check.sh
#
# The data: ../shared/datasets beside the checkout, else DATASETS (a folder holding
# cifar10-jpeg.zip; on the GPU machine a carried, git-ignored copy such as .cache/gpu-data).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu-check: no CUDA device on this machine (torch.cuda.is_available() is False): nothing to check"
  exit 0
fi
DATASETS=${DATASETS:-../shared/datasets}
[ -f "$DATASETS/cifar10-jpeg.zip" ] || DATASETS=.cache/gpu-data
[ -f "$DATASETS/cifar10-jpeg.zip" ] || { echo "gpu-check: no cifar10-jpeg.zip in ../shared/datasets or $DATASETS" >&2; exit 2; }
slug=$("$PY" -c 'import re, torch; print(re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-"))')
work=.cache/gpu-check && mkdir -p "$work" results
echo "gpu-check on $slug, data in $DATASETS"

ASER_TEST_DATASETS=$DATASETS "$PY" -m pytest -m gpu -q -p no:cacheprovider --junitxml "$work/junit.xml" tests/test_gpu.py \
  2>&1 | tee "$work/pytest.log"
for mode in "" "--bf16" "--bf16 --compile"; do
  name=speed-cuda-$slug$(echo "$mode" | tr -d ' ' | sed 's/--/-/g')
  "$PY" -m clients.bench.benchmark speed --device cuda $mode --out "results/$name.json" 2>&1 | tail -3
done
if [ "${FULL:-0}" = 1 ]; then
  for method in er aser-mu; do
    "$PY" -m clients.bench.benchmark run --dataset cifar10 --data "$DATASETS/cifar10-jpeg.zip" --method "$method" \
      --device cuda --seed 0 --quiet --out "results/gpu/$slug/$method-m1000-seed0.json" 2>&1 | tail -8
  done
fi
"$PY" - "$slug" "$work/junit.xml" <<'PYEOF'
import glob, json, subprocess, sys, time
import xml.etree.ElementTree as ET
import torch

slug, junit = sys.argv[1], sys.argv[2]
cases = [{"test": c.get("classname", "") + "::" + c.get("name", ""), "seconds": float(c.get("time", 0)),
          "outcome": "failed" if c.find("failure") is not None or c.find("error") is not None
          else "skipped" if c.find("skipped") is not None else "passed"} for c in ET.parse(junit).iter("testcase")]
count = {o: sum(c["outcome"] == o for c in cases) for o in ("passed", "failed", "skipped")}
speed = {p: json.load(open(p)) for p in sorted(glob.glob(f"results/speed-cuda-{slug}*.json"))}
full = {p: {k: json.load(open(p))[k] for k in ("method", "average_accuracy", "train_seconds", "steps")}
        for p in sorted(glob.glob(f"results/gpu/{slug}/*.json"))}
record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
          "tests": count, "test_cases": cases,
          "step_ms": {p: {k: v["median_ms"] for k, v in s["cases"].items()} for p, s in speed.items()},
          "full_runs": full, "command": "bash scripts/gpu-check.sh",
          "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
          "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
out = f"results/gpu-{slug}.json"
open(out, "w").write(json.dumps(record, indent=2) + "\n")
print(f"wrote {out}: {count['passed']} passed, {count['failed']} failed, {count['skipped']} skipped")
sys.exit(1 if count["failed"] or not count["passed"] else 0)
PYEOF
