#!/usr/bin/env bash
# What a lent GPU machine needs from here, made ready to carry (both paths git-ignored):
#   .whl/                    Python 3.12 wheels of this project's dependencies that the lent image lacks
#   .cache/gpu-data/         a copy of cifar10-jpeg.zip (../shared does not travel)
# Then, on the device: FULL=1 bash scripts/gpu-check.sh, carrying [".whl", ".cache/gpu-data"] (over 64 MiB since the
# Lite0 weights' wheel: two calls back to back, as the script's last line says); gpu-check.sh puts the wheels on
# PYTHONPATH. The lent image's own packages (torch, numpy, pillow, httpx, onnx, onnxruntime,
# prometheus-client, ...: /work/.library/device/KINDS.md) stay as they are; ON_IMAGE overrides that list.
#
#   bash scripts/gpu-bundle.sh     # after scripts/install.sh
set -euo pipefail
cd "$(dirname "$0")/.."
ON_IMAGE=${ON_IMAGE:-"torch numpy pillow httpx httpcore h11 anyio idna certifi onnx onnxruntime onnxscript onnx-ir
  prometheus-client protobuf typing-extensions packaging click tabulate python-dateutil six pluggy ml-dtypes sympy
  mpmath filelock fsspec jinja2 markupsafe networkx flatbuffers coloredlogs humanfriendly triton setuptools pip
  annotated-doc"}
wanted=$(ON_IMAGE="$ON_IMAGE" .venv/bin/python - <<'PY'
"""The installed dependency closure of aser-service (no extras), less what the lent image has: name==version."""
import os
import re
from importlib.metadata import PackageNotFoundError, distribution

from packaging.requirements import Requirement

norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
on_image = {norm(n) for n in os.environ["ON_IMAGE"].split()}
seen, todo, out = set(), ["aser-service"], []
while todo:
    name = norm(todo.pop())
    if name in seen:
        continue
    seen.add(name)
    try:
        dist = distribution(name)
    except PackageNotFoundError:
        continue
    if name != "aser-service" and name not in on_image:
        out.append(f"{dist.metadata['Name']}=={dist.version}")
    for spec in dist.requires or []:
        req = Requirement(spec)
        if req.marker is None or req.marker.evaluate({"extra": "", "python_version": "3.12"}):
            todo.append(req.name)
print(" ".join(sorted(out)))
PY
)
echo "wheels: $wanted"
rm -rf .whl && mkdir -p .whl .cache/gpu-data
# shellcheck disable=SC2086
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d .whl $wanted
cp "${DATASETS:-../shared/datasets}/cifar10-jpeg.zip" .cache/gpu-data/
du -sh .whl .cache/gpu-data
.venv/bin/python - <<'PY'
"""What a call carrying both sends: the device tool takes at most 64 MiB."""
import os
import subprocess

listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                        capture_output=True, check=True).stdout.split(b"\0")
tree = sum(os.path.getsize(f) for f in listed if f and os.path.isfile(f))
carried = sum(os.path.getsize(os.path.join(d, f)) for top in (".whl", ".cache/gpu-data") for d, _, fs in os.walk(top)
              for f in fs)
print(f"a call sends {(tree + carried) / 2**20:.1f} MiB of at most 64 (the checkout {tree / 2**20:.1f}, carried "
      f"{carried / 2**20:.1f})")
if tree + carried > 64 * 2**20:
    # a warm device machine keeps ignored paths between calls: the data first, then the wheels and the check
    print("over the limit: move the in-flight results/*/*.resume.pt aside for the calls (they are in git), back "
          "after, and carry in two calls back to back (the machine keeps what a call carried while it stays warm): "
          "first `ls .cache/gpu-data` carrying [\".cache/gpu-data\"], then `FULL=1 bash scripts/gpu-check.sh` "
          "carrying [\".whl\"]")
PY
