#!/usr/bin/env bash
# Build the learner's and the replica's images, labelled (org.opencontainers.image.version) and
# tagged with the package's version, read from its one place (service/__init__.py), and as :latest
# (what docker-compose.yml runs). Other options go to `docker build` as they are:
#   bash deploy/build.sh [--build-arg BASE_IMAGE=... --build-arg TORCH_INDEX=... ...]
set -euo pipefail
cd "$(dirname "$0")/.."
version=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' service/__init__.py)
[ -n "$version" ] || { echo "no __version__ in service/__init__.py" >&2; exit 1; }
for image in learner:aser-service replica:aser-replica; do
  target=${image%%:*} name=${image#*:}
  echo "building $name:$version ($target)"
  docker build -f deploy/Dockerfile --build-arg VERSION="$version" "$@" --target "$target" \
    -t "$name:$version" -t "$name:latest" .
done
