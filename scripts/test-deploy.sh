#!/usr/bin/env bash
# The production topology, built and run for real: the image from deploy/Dockerfile, then
# docker-compose.yml with the learner and two inference replicas on loopback. It streams real
# CIFAR-10 JPEGs through the learner, checks that both replicas answer from the learner's latest
# snapshot with the learner's labels, SIGKILLs the learner container and starts it again, checks
# that nothing acknowledged was lost, and removes every container, volume and network it made,
# whether the checks pass or not.
#
#   bash scripts/test-deploy.sh [--out results/deploy/deploy-compose.json]
#
# On a machine that reaches no image registry it makes what the build needs locally: a Docker
# engine from Debian's docker.io (dockerd started when none answers), a python:3.11-slim
# stand-in made by debootstrap from this machine's own apt mirror, and the CPU torch wheel that
# this machine's pip finds, served to the build as a package index on loopback.
set -euo pipefail
# dockerd, debootstrap and chroot need root
[ "$(id -u)" -eq 0 ] || exec sudo --preserve-env bash "$0" "$@"
cd "$(dirname "$0")/.."
OUT=""
[ "${1:-}" = "--out" ] && OUT=$2
PYTHON=${PYTHON:-.venv/bin/python}
DATA=${ASER_DEPLOY_DATA:-../shared/datasets/cifar10-jpeg.zip}
BASE_IMAGE=${BASE_IMAGE:-python:3.11-slim}
WORK=$(mktemp -d /tmp/aser-deploy.XXXXXX)
PROJECT=aserdeploy$$
started=$(date +%s)
say() { echo "[test-deploy $(($(date +%s) - started))s] $*"; }
free_port() { "$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

ensure_engine() {
  if ! command -v dockerd >/dev/null || ! command -v docker-compose >/dev/null || ! command -v debootstrap >/dev/null; then
    say "installing docker.io, docker-compose and debootstrap"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io docker-compose debootstrap >/dev/null
  fi
  if ! docker info >/dev/null 2>&1; then
    say "starting dockerd"
    nohup dockerd >"$WORK/dockerd.log" 2>&1 &
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && return; sleep 1; done
    cat "$WORK/dockerd.log"; exit 1
  fi
}

# The mirror of this machine's apt sources that serves the release it runs (read, never stored).
apt_mirror() {
  local suite=$1
  { cat /etc/apt/sources.list.d/*.sources 2>/dev/null || true; } | awk -v suite="$suite" 'BEGIN { RS = "" }
    { uri = ""; hit = 0; n = split($0, line, "\n")
      for (i = 1; i <= n; i++) {
        m = split(line[i], f, /[ \t]+/)
        if (f[1] == "URIs:") uri = f[2]
        if (f[1] == "Suites:") for (j = 2; j <= m; j++) if (f[j] == suite) hit = 1 }
      if (uri != "" && hit) { print uri; exit } }'
  { cat /etc/apt/sources.list 2>/dev/null || true; } | awk -v suite="$suite" '$1 == "deb" {
      i = 2; if ($i ~ /^\[/) { while ($i !~ /\]$/) i++; i++ }
      if ($(i + 1) == suite) { print $i; exit } }'
}

# python:3.11-slim as pulled, or else made here: Debian's python3 in a venv on a minimal rootfs, with
# the learner's jemalloc from the same mirror (the image's build then needs no apt of its own).
ensure_base_image() {
  docker image inspect "$BASE_IMAGE" >/dev/null 2>&1 && return
  timeout 60 docker pull -q "$BASE_IMAGE" >/dev/null 2>&1 && return
  . /etc/os-release
  local mirror rootfs=$WORK/rootfs
  mirror=$(apt_mirror "$VERSION_CODENAME" | head -1)
  [ -n "$mirror" ] || { echo "no apt mirror for $VERSION_CODENAME in this machine's sources" >&2; exit 1; }
  say "no $BASE_IMAGE to pull: debootstrap $VERSION_CODENAME from $mirror"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates,libjemalloc2 \
    "$VERSION_CODENAME" "$rootfs" "$mirror" >"$WORK/debootstrap.log" 2>&1 || { tail -20 "$WORK/debootstrap.log"; exit 1; }
  # the build's downloads go through whatever TLS this machine trusts
  cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"
  chroot "$rootfs" python3 -m venv /opt/python
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -c . | docker import \
    --change 'ENV PATH=/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8 PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    --change 'CMD ["python3"]' - "$BASE_IMAGE" >/dev/null
  rm -rf "$rootfs"
}

# torch==2.13.0 and its dependencies as this machine's pip resolves them (here: the local CPU
# wheel), as a PEP 503 index on a loopback port; echoes the index URL.
serve_torch_index() {
  local index=$WORK/index port
  "$PYTHON" -m pip download -q -d "$index/files" torch==2.13.0 >"$WORK/pip-download.log" 2>&1 \
    || { cat "$WORK/pip-download.log" >&2; exit 1; }
  "$PYTHON" - "$index" <<'EOF'
import pathlib, re, sys
index = pathlib.Path(sys.argv[1])
for wheel in (index / "files").iterdir():
    project = re.sub(r"[-_.]+", "-", wheel.name.split("-")[0]).lower()
    page = index / "simple" / project / "index.html"
    page.parent.mkdir(parents=True, exist_ok=True)
    with page.open("a") as f:
        f.write(f'<a href="../../files/{wheel.name}">{wheel.name}</a><br>\n')
EOF
  port=$(free_port)
  nohup "$PYTHON" -m http.server --bind 127.0.0.1 --directory "$index" "$port" >"$WORK/index.log" 2>&1 &
  echo $! >"$WORK/index.pid"
  echo "http://127.0.0.1:$port/simple"
}

compose() { docker-compose -p "$PROJECT" --env-file "$WORK/env" -f docker-compose.yml "$@"; }

teardown() {
  local rc=$?
  if [ $rc -ne 0 ] && [ -f "$WORK/env" ]; then
    compose ps || true
    compose logs --no-color --tail 60 || true
  fi
  docker rm -f -v "${PROJECT}_port9000" >/dev/null 2>&1 || true
  [ -f "$WORK/env" ] && compose down --volumes --remove-orphans --timeout 20 >/dev/null 2>&1 || true
  [ -f "$WORK/index.pid" ] && kill "$(cat "$WORK/index.pid")" 2>/dev/null || true
  rm -rf "$WORK"
  say "$([ $rc -eq 0 ] && echo passed || echo "FAILED ($rc)"); containers, volumes and networks removed"
}
trap teardown EXIT

wait_healthy() {  # the container's HEALTHCHECK (readiness on its own port) passes
  local cid=$1 state
  for _ in $(seq 120); do
    state=$(docker inspect -f '{{.State.Health.Status}}' "$cid")
    [ "$state" = healthy ] && return
    sleep 1
  done
  echo "container $cid is $state" >&2; return 1
}

ensure_engine
[ -x "$PYTHON" ] || { echo "no $PYTHON: run bash scripts/test.sh (or scripts/install.sh) first" >&2; exit 1; }
base_started=$(date +%s)
ensure_base_image
base_image_seconds=$(($(date +%s) - base_started))  # 0 when the image was there already
torch_index=$(serve_torch_index)
version=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' service/__init__.py)  # the one place
say "building aser-service and aser-replica $version on $BASE_IMAGE (torch from $torch_index)"
build_started=$(date +%s)
DOCKER_BUILDKIT=0 bash deploy/build.sh --network host --build-arg BASE_IMAGE="$BASE_IMAGE" \
  --build-arg TORCH_INDEX="$torch_index" --build-arg APT_OPTIONS="-o Acquire::Check-Valid-Until=false" \
  >"$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log"; exit 1; }
for image in aser-service aser-replica; do  # labelled with the package's version, and tagged with it
  label=$(docker image inspect -f '{{index .Config.Labels "org.opencontainers.image.version"}}' "$image:$version")
  [ "$label" = "$version" ] || { echo "$image:$version is labelled '$label', the package is $version" >&2; exit 1; }
done
build_seconds=$(($(date +%s) - build_started))
image_bytes=$(docker image inspect -f '{{.Size}}' aser-service:latest)
replica_image_bytes=$(docker image inspect -f '{{.Size}}' aser-replica:latest)
say "built in ${build_seconds}s: learner $((image_bytes / 1000000)) MB, replica $((replica_image_bytes / 1000000)) MB"

say "the healthcheck follows ASER_PORT"
docker run -d --name "${PROJECT}_port9000" -e ASER_PORT=9000 -e ASER_ADMIN_TOKEN=probe aser-service:latest >/dev/null
wait_healthy "${PROJECT}_port9000"
docker rm -f -v "${PROJECT}_port9000" >/dev/null

learner_port=$(free_port)
{
  for role in WRITE READ ADMIN; do echo "ASER_${role}_TOKEN=$("$PYTHON" -c 'import secrets; print(secrets.token_urlsafe(24))')"; done
  echo "ASER_BIND=127.0.0.1"
  echo "ASER_LEARNER_PORT=$learner_port"
  echo "ASER_REPLICA_PORTS=$((learner_port + 1))-$((learner_port + 9))"
  echo "ASER_REPLICA_POLL_S=2"
} >"$WORK/env"
set -a; . "$WORK/env"; set +a
say "docker-compose up: the learner on 127.0.0.1:$learner_port and two replicas"
compose up -d --no-build --scale replica=2 >"$WORK/up.log" 2>&1 || { cat "$WORK/up.log"; exit 1; }
replicas=()
for i in 1 2; do replicas+=(--replica "http://$(compose port --index "$i" replica 8000)"); done
for cid in $(compose ps -q); do  # "8000/tcp -> 127.0.0.1:PORT", nothing on other interfaces
  if docker port "$cid" | grep -v -- '-> 127\.0\.0\.1:'; then echo "published beyond loopback" >&2; exit 1; fi
done

api_version=$("$PYTHON" -c "import json, urllib.request as u; print(json.load(u.urlopen('http://127.0.0.1:$learner_port/openapi.json', timeout=10))['info']['version'])")
[ "$api_version" = "$version" ] || { echo "the learner's /openapi.json says $api_version, the image $version" >&2; exit 1; }
say "version $version: the images' label, their tags and the learner's /openapi.json"

smoke=("$PYTHON" -m clients.bench.live.smoke --learner "http://127.0.0.1:$learner_port" "${replicas[@]}"
       --data "$DATA" --ledger "$WORK/ledger.json")
"${smoke[@]}" stream
learner=$(compose ps -q learner)
memory() { docker stats --no-stream --format '{{.MemUsage}}' "$1" | cut -d' ' -f1; }  # "694MiB / 23GiB"
# the learner runs on jemalloc (the image's LD_PRELOAD), not glibc's heap that grows under overload
allocator=$(docker exec "$learner" sh -c 'grep -o "libjemalloc[^ ]*" /proc/1/maps | head -1')
[ -n "$allocator" ] || { echo "the learner's process has no jemalloc mapped" >&2; exit 1; }
say "the learner's allocator: $allocator"
memory_learner=$(memory "$learner")
memory_replica=$(memory "$(compose ps -q replica | head -1)")
say "memory in use: learner $memory_learner, one replica $memory_replica"
say "SIGKILL the learner container, then start it again"
docker kill --signal KILL "$learner" >/dev/null
restart_started=$(date +%s)
compose start learner >/dev/null 2>&1
wait_healthy "$learner"
restart_seconds=$(($(date +%s) - restart_started))
"${smoke[@]}" verify ${OUT:+--out "$OUT"} --note "command=bash scripts/test-deploy.sh${OUT:+ --out $OUT}" \
  --note "machine=$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(nproc) cores" \
  --note "docker=$(docker version -f '{{.Server.Version}}')" --note "base_image=$BASE_IMAGE" --note "base_image_seconds=$base_image_seconds" \
  --note "version=$version" --note "image_bytes=$image_bytes" --note "replica_image_bytes=$replica_image_bytes" \
  --note "build_seconds=$build_seconds" --note "allocator=$allocator" --note "memory_learner=$memory_learner" \
  --note "memory_replica=$memory_replica" --note "restart_to_healthy_seconds=$restart_seconds" \
  --note "total_seconds=$(($(date +%s) - started))"
