#!/usr/bin/env bash
# Mini-ImageNet in chunks small enough to travel to the GPU machine one call at a time (a call
# carries at most 64 MiB of the checkout), and back together on the other side.
#
#   bash scripts/mini-imagenet-chunks.sh pack   [.cache/mini-imagenet] [.cache/mini-chunks]
#   bash scripts/mini-imagenet-chunks.sh status [.cache/mini-chunks]
#   bash scripts/mini-imagenet-chunks.sh unpack [.cache/mini-chunks] [.cache/mini-imagenet]
#
# pack: the pooled folder (scripts/prepare-mini-imagenet.sh) as one tar, cut into part-NN files of
# CHUNK_MIB (default 60) MiB, with SHA256SUMS naming every part and the whole. Carry the parts over
# consecutive calls (each in its own path, e.g. .cache/mini-chunks/part-03 plus SHA256SUMS): a warm
# machine keeps what earlier calls carried. status: which parts are there and intact (exit 3 while
# some are missing or damaged). unpack: checks every part and the whole, then extracts.
set -euo pipefail
cd "$(dirname "$0")/.."
cmd=${1:?pack, status or unpack}

check_parts() {  # prints what is missing or damaged; returns 3 if anything is
  local dir=$1 bad=0 name sum
  [ -f "$dir/SHA256SUMS" ] || { echo "$dir/SHA256SUMS is missing" >&2; return 3; }
  while read -r sum name; do
    [ "$name" = "whole.tar" ] && continue
    if [ ! -f "$dir/$name" ]; then echo "missing: $name"; bad=3
    elif [ "$(sha256sum "$dir/$name" | cut -d' ' -f1)" != "$sum" ]; then echo "damaged: $name"; bad=3
    fi
  done <"$dir/SHA256SUMS"
  return $bad
}

case $cmd in
  pack)
    src=${2:-.cache/mini-imagenet}; out=${3:-.cache/mini-chunks}
    [ -f "$src/classes.txt" ] || { echo "$src is not a pooled Mini-ImageNet (no classes.txt)" >&2; exit 2; }
    rm -rf "$out" && mkdir -p "$out"
    tar -C "$(dirname "$src")" -cf - "$(basename "$src")" | split -b "${CHUNK_MIB:-60}M" -d -a 2 - "$out/part-"
    (cd "$out" && sha256sum part-* && cat part-* | sha256sum | sed 's/-$/whole.tar/') >"$out/SHA256SUMS"
    echo "$out: $(ls "$out" | grep -c '^part-') parts of at most ${CHUNK_MIB:-60} MiB, $(du -sh "$out" | cut -f1) in all"
    ;;
  status)
    dir=${2:-.cache/mini-chunks}
    if check_parts "$dir"; then echo "$dir: every part is here and intact"; else exit 3; fi
    ;;
  unpack)
    dir=${2:-.cache/mini-chunks}; dest=${3:-.cache/mini-imagenet}
    check_parts "$dir" || { echo "not every part is here yet" >&2; exit 3; }
    whole=$(grep ' whole.tar$' "$dir/SHA256SUMS" | cut -d' ' -f1)
    [ "$(cat "$dir"/part-* | sha256sum | cut -d' ' -f1)" = "$whole" ] || { echo "the parts do not make the whole" >&2; exit 1; }
    tmp="$dest.partial" && rm -rf "$tmp" && mkdir -p "$tmp"
    cat "$dir"/part-* | tar -C "$tmp" -xf -
    rm -rf "$dest" && mv "$tmp"/* "$dest" && rmdir "$tmp"
    echo "$dest: $(find "$dest" -name '*.jpg' | wc -l) images in $(find "$dest" -mindepth 1 -maxdepth 1 -type d | wc -l) classes"
    ;;
  *) echo "unknown command $cmd: pack, status or unpack" >&2; exit 2 ;;
esac
