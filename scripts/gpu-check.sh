#!/usr/bin/env bash
# The GPU path, checked and measured in one command: the suite's GPU tests (tests marked `gpu`),
# step times per method on the GPU in fp32, bf16 and bf16 + torch.compile, and with FULL=1 one full Split
# CIFAR-10 run of the best configuration, of the class-balanced ASER memory and of the same with a replay batch of 20
# (what the service runs on a GPU), and of the pretrained backbone's default and hand-over, timed end to end.
# Figures go to results/gpu/<device>/gpu-check.json (and the speed files beside it). Without CUDA it says so and exits 0.
#
#   bash scripts/gpu-check.sh            # after scripts/install.sh (or with PYTHON=...)
#   FULL=1 bash scripts/gpu-check.sh    # and one full-length run each of the best, cb-sv-duel and cb-sv-duel + rb20
#   FULL=1 SPEED=0 bash scripts/gpu-check.sh    # the tests and the runs, keeping the speed files in results/
#
# Each stage has its own time limit (STAGE_SECONDS, default 240), so that the record is written even when one
# stage runs long on a lent machine; torch.compile costs ~30 s a model, so the compiled mode times COMPILE_CASES.
#
# The data: ../shared/datasets beside the checkout, else DATASETS (a folder holding
# cifar10-jpeg.zip; on the GPU machine a carried, git-ignored copy such as .cache/gpu-data).
# On a lent machine: `bash scripts/gpu-bundle.sh` here, then this script there, carrying .whl and .cache/gpu-data.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu-check: no CUDA device on this machine (torch.cuda.is_available() is False): nothing to check"
  exit 0
fi
if compgen -G ".whl/*.whl" >/dev/null && ! "$PY" -c 'import fastapi, sqlite_utils, pydantic_settings' 2>/dev/null; then
  # a lent image without this project's packages: the wheels scripts/gpu-bundle.sh made, first on the path (the
  # test servers and the sweep's runs inherit it)
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/aser-site .whl/*.whl \
    || exit 2
  export PYTHONPATH=/tmp/aser-site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
DATASETS=${DATASETS:-../shared/datasets}
[ -f "$DATASETS/cifar10-jpeg.zip" ] || DATASETS=.cache/gpu-data
[ -f "$DATASETS/cifar10-jpeg.zip" ] || { echo "gpu-check: no cifar10-jpeg.zip in ../shared/datasets or $DATASETS" >&2; exit 2; }
slug=$("$PY" -c 'import re, torch; print(re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-"))')
work=.cache/gpu-check && mkdir -p "$work" results
echo "gpu-check on $slug, data in $DATASETS"

stage="timeout ${STAGE_SECONDS:-240}"
COMPILE_CASES=${COMPILE_CASES:-default-step,bare-step,er,er-ace-aug-it2-ema,cb-sv-duel-ace-aug-it2-ema}
ASER_TEST_DATASETS=$DATASETS $stage "$PY" -m pytest -m gpu -q -p no:cacheprovider --junitxml "$work/junit.xml" \
  tests/test_gpu.py \
  2>&1 | tee "$work/pytest.log"
for mode in "" "--bf16" "--bf16 --compile"; do
  [ "${SPEED:-1}" = 0 ] && break  # SPEED=0: keep the speed files already in results/
  name=speed-cuda-$slug$(echo "$mode" | tr -d ' ' | sed 's/--/-/g')
  cases=""; [[ $mode == *compile* ]] && cases="--cases $COMPILE_CASES"
  $stage "$PY" -m clients.bench.benchmark speed --device cuda $mode $cases --out "results/speed/$name.json" 2>&1 | tail -3
done
if [ "${FULL:-0}" = 1 ]; then
  # the best reservoir, the class-balanced ASER memory and what the service runs on a GPU (the same with a replay
  # batch of 20), under the options, side by side on the one GPU
  full_run() {  # method, replay batch
    local name="$1-ace-aug-it2-ema0.99$([ "$2" = 10 ] || echo "-rb$2")-m1000-seed0"
    $stage "$PY" -m clients.bench.benchmark run --dataset cifar10 --data "$DATASETS/cifar10-jpeg.zip" --method "$1" \
      --mem-size 1000 --loss ace --iterations 2 --augment --ema 0.99 --replay-batch "$2" --device cuda --seed 0 \
      --quiet --out "results/gpu/$slug/$name.json" 2>&1 | tail -4
  }
  mkdir -p "results/gpu/$slug"
  full_run er 10 & full_run cb-sv-duel 10 & full_run cb-sv-duel 20 & wait
  # the pretrained backbone (EfficientNet-Lite0): the service's default (streaming LDA serving at 160 px, the duel memory
  # training the linear top) and the hand-over on cut 11 at 128 px, one after the other (each encodes the set first)
  lite0_run() {  # name, options
    $stage "$PY" -m clients.bench.benchmark run --dataset cifar10 --data "$DATASETS/cifar10-jpeg.zip" --method cb-sv-duel \
      --mem-size 1000 --loss ace --ema 0.99 --backbone lite0 --lr 0.01 --serving-head slda $2 --device cuda --seed 0 \
      --quiet --cache-dir "$work/latents" --out "results/gpu/$slug/$1-m1000-seed0.json" 2>&1 | tail -4
  }
  lite0_run cb-sv-duel-ace-ema0.99-lite0-160px-cut17-serveslda-lr0.01 "--input-size 160"
  lite0_run cb-sv-duel-ace-ema0.99-lite0-128px-cut11-serveslda-from1000-lr0.01 "--input-size 128 --cut 11 --trained-head-from 1000"
fi
"$PY" - "$slug" "$work/junit.xml" <<'PYEOF'
import glob, json, os, subprocess, sys, time
import xml.etree.ElementTree as ET
import torch

slug, junit = sys.argv[1], sys.argv[2]
cases = [{"test": c.get("classname", "") + "::" + c.get("name", ""), "seconds": float(c.get("time", 0)),
          "outcome": "failed" if c.find("failure") is not None or c.find("error") is not None
          else "skipped" if c.find("skipped") is not None else "passed"}
         for c in (ET.parse(junit).iter("testcase") if os.path.exists(junit) else [])]  # none: the stage ran out
count = {o: sum(c["outcome"] == o for c in cases) for o in ("passed", "failed", "skipped")}
speed = {p: json.load(open(p)) for p in sorted(glob.glob(f"results/speed/speed-cuda-{slug}*.json"))}
keys = ("method", "average_accuracy", "anytime", "train_seconds", "frozen_forward_cpu_seconds", "steps")
full = {p: {k: r[k] for k in keys if k in r}
        for p in sorted(glob.glob(f"results/gpu/{slug}/*.json")) if "average_accuracy" in (r := json.load(open(p)))}
record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
          "tests": count, "test_cases": cases,
          "step_ms": {p: {k: v["median_ms"] for k, v in s["cases"].items()} for p, s in speed.items()},
          "full_runs": full, "command": "bash scripts/gpu-check.sh",
          "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip(),
          "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
out = f"results/gpu/{slug}/gpu-check.json"
os.makedirs(os.path.dirname(out), exist_ok=True)
open(out, "w").write(json.dumps(record, indent=2) + "\n")
print(f"wrote {out}: {count['passed']} passed, {count['failed']} failed, {count['skipped']} skipped")
sys.exit(1 if count["failed"] or not count["passed"] else 0)
PYEOF
