#!/usr/bin/env bash
# The full Mini-ImageNet as the benchmark reads it, from the public repository named in
# ../shared/datasets/README.md (fetched as a bare git mirror): its train/ (500) and val/ (100)
# images of each class pooled into one folder per class (600), with the paper's class order
# (classes.txt from the shared slice). The loader then holds out 1/6 of each class for testing,
# as the paper does. Never inside the repository's tracked files: the default is .cache/.
#
#   bash scripts/prepare-mini-imagenet.sh /work/.mirror/Deo0330+split_minidataset/repo [.cache/mini-imagenet]
set -euo pipefail
cd "$(dirname "$0")/.."
MIRROR=${1:?the git directory of Deo0330/split_minidataset}
OUT=${2:-.cache/mini-imagenet}
SLICE=${SLICE:-../shared/datasets/mini-imagenet-slice.zip}
rm -rf "$OUT.partial" && mkdir -p "$OUT.partial/split"
git --git-dir "$MIRROR" archive HEAD train val | tar -x -C "$OUT.partial/split"
for split in train val; do
  for class_dir in "$OUT.partial/split/$split"/*/; do
    wnid=$(basename "$class_dir")
    mkdir -p "$OUT.partial/$wnid"
    mv "$class_dir"* "$OUT.partial/$wnid/"
  done
done
rm -rf "$OUT.partial/split"
unzip -p "$SLICE" mini-imagenet/classes.txt >"$OUT.partial/classes.txt"
classes=$(wc -l <"$OUT.partial/classes.txt")
folders=$(find "$OUT.partial" -mindepth 1 -maxdepth 1 -type d | wc -l)
images=$(find "$OUT.partial" -name '*.jpg' | wc -l)
[ "$classes" -eq 100 ] && [ "$folders" -eq 100 ] && [ "$images" -eq 60000 ] \
  || { echo "expected 100 classes, 100 folders, 60000 images; got $classes, $folders, $images" >&2; exit 1; }
rm -rf "$OUT" && mv "$OUT.partial" "$OUT"
echo "$OUT: 100 classes x 600 images"
