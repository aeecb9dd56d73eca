#!/usr/bin/env bash
# One-time, idempotent host set-up for Reploy on a Debian machine, run as root by `make setup`
# (and therefore by `make demo` and `make test`). It installs what the project needs, starts a
# Docker engine when none answers, and builds the offline base images, each cached by its tag.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf 'setup: %s\n' "$*" >&2; }

BUSYBOX_IMAGE=reploy-base/busybox:1
PYTHON_IMAGE=reploy-base/python:bookworm-1
DOCKERD_LOG=/var/log/reploy-dockerd.log
# debootstrap's Debian mirror: REPLOY_DEBIAN_MIRROR, else the archive this machine's apt uses.
DEBIAN_MIRROR=${REPLOY_DEBIAN_MIRROR:-$(python3 scripts/debian_mirror.py 2>/dev/null || true)}

apt_packages_missing() {
  local missing=()
  command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
  command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
  [ -x /bin/busybox ] || missing+=(busybox-static)
  command -v chromium >/dev/null 2>&1 || missing+=(chromium)  # the web UI's browser tests
  printf '%s\n' "${missing[@]}"
}

install_python_requirements() {
  # pip answers from the installed set without touching the network when every pin is met.
  python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore -r requirements.txt
}

install_debian_packages() {
  mapfile -t missing < <(apt_packages_missing)
  if [ "${#missing[@]}" -gt 0 ] && [ -n "${missing[0]}" ]; then
    log "installing Debian packages: ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

engine_answers() { timeout 10 docker info >/dev/null 2>&1; }

start_engine() {
  if engine_answers; then return; fi
  # A dockerd killed with an earlier session can leave its pid file behind.
  if [ -f /var/run/docker.pid ] && ! kill -0 "$(cat /var/run/docker.pid)" 2>/dev/null; then
    log "removing stale /var/run/docker.pid"
    rm -f /var/run/docker.pid
  fi
  if [ -f /run/containerd/containerd.pid ] && ! kill -0 "$(cat /run/containerd/containerd.pid)" 2>/dev/null; then
    rm -f /run/containerd/containerd.pid
  fi
  log "starting dockerd in the background (log: $DOCKERD_LOG)"
  nohup setsid dockerd >>"$DOCKERD_LOG" 2>&1 </dev/null &
  for _ in $(seq 1 120); do
    if engine_answers; then return; fi
    sleep 0.5
  done
  log "dockerd did not answer within 60 s; last log lines:"
  tail -n 20 "$DOCKERD_LOG" >&2 || true
  exit 1
}

image_exists() { docker image inspect "$1" >/dev/null 2>&1; }

require_debian_mirror() {
  [ -n "$DEBIAN_MIRROR" ] && return
  python3 scripts/debian_mirror.py >/dev/null || true  # says why there is none
  log "no Debian mirror to debootstrap from: set REPLOY_DEBIAN_MIRROR"
  exit 1
}

build_busybox_image() {
  image_exists "$BUSYBOX_IMAGE" && return
  log "building $BUSYBOX_IMAGE from Debian's busybox-static"
  local root; root=$(mktemp -d)
  trap 'rm -rf "$root"' RETURN
  mkdir -p "$root"/{bin,etc,tmp,proc,sys,dev,home,root}
  chmod 1777 "$root/tmp"
  cp /bin/busybox "$root/bin/busybox"
  for applet in $("$root/bin/busybox" --list); do
    [ -e "$root/bin/$applet" ] || ln -s busybox "$root/bin/$applet"
  done
  printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/home:/bin/sh\n' >"$root/etc/passwd"
  printf 'root:x:0:\nnogroup:x:65534:\n' >"$root/etc/group"
  tar -C "$root" -c . | docker import -c 'ENV PATH=/bin' -c 'CMD ["/bin/sh"]' - "$BUSYBOX_IMAGE" >/dev/null
}

build_python_image() {
  image_exists "$PYTHON_IMAGE" && return
  require_debian_mirror
  log "building $PYTHON_IMAGE with debootstrap from $DEBIAN_MIRROR (about a minute)"
  local root; root=$(mktemp -d)
  trap 'rm -rf "$root"' RETURN
  debootstrap --variant=minbase --include=python3,bsdextrautils,asciinema \
    bookworm "$root" "$DEBIAN_MIRROR" >/dev/null
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" -c . | docker import \
    -c 'ENV PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8' -c 'CMD ["/bin/sh"]' \
    - "$PYTHON_IMAGE" >/dev/null
}

install_debian_packages
install_python_requirements
start_engine
build_busybox_image
build_python_image
log "ready: engine up, base images $BUSYBOX_IMAGE and $PYTHON_IMAGE present"
