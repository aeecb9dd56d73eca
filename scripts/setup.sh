#!/usr/bin/env bash
# One-time, idempotent host set-up for Reploy on a Debian machine, run as root by `make setup`
# (and therefore by `make test` and `make bench`) and, limited to what the demo needs, by
# `make demo`. It installs what the project needs, starts a Docker engine when none answers,
# and builds the offline base images, each cached by its tag.
#
#   setup.sh        everything: the run-time and test requirements, Chromium (the web UI's
#                   browser tests), the busybox, Python and browser base images, and the
#                   pinned Claude Code CLI the real-model tests run (a machine cache, once)
#   setup.sh demo   only what `make demo` needs: the run-time requirements, the engine, the
#                   busybox and Python base images (no Chromium, no 1 GB browser image)
set -euo pipefail
cd "$(dirname "$0")/.."

MODE=${1:-all}
case "$MODE" in
  all|demo) ;;
  *) printf 'usage: %s [demo]\n' "$0" >&2; exit 2 ;;
esac

log() { printf 'setup: %s\n' "$*" >&2; }

BUSYBOX_IMAGE=reploy-base/busybox:1
PYTHON_IMAGE=reploy-base/python:bookworm-1
BROWSER_IMAGE=reploy-base/browser:bookworm-1
# Bookworm's Node.js is 18; later playwright-core releases refuse it.
PLAYWRIGHT_CORE_VERSION=1.48.2
# What the Python image holds beyond minbase; the browser image holds these too.
PYTHON_IMAGE_PACKAGES=python3,bsdextrautils,asciinema
DOCKERD_LOG=/var/log/reploy-dockerd.log
# The real Claude Code CLI of tests/test_real_claude_cli.py, pinned in scripts/claude-code.version
# (2.1.197 is the last release whose install runs under Node 20), kept in a machine cache so
# that every checkout and CI clone shares one copy (a native binary of about 245 MB).
CLAUDE_CODE_VERSION=$(<scripts/claude-code.version)
CLAUDE_CODE_DIR=${REPLOY_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/reploy}/claude-code-$CLAUDE_CODE_VERSION
# debootstrap's Debian mirror: REPLOY_DEBIAN_MIRROR, else the archive this machine's apt uses.
DEBIAN_MIRROR=${REPLOY_DEBIAN_MIRROR:-$(python3 scripts/debian_mirror.py 2>/dev/null || true)}

apt_packages_missing() {
  local missing=()
  command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
  command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
  [ -x /bin/busybox ] || missing+=(busybox-static)
  if [ "$MODE" = all ]; then
    command -v chromium >/dev/null 2>&1 || missing+=(chromium)  # the web UI's browser tests
    command -v npm >/dev/null 2>&1 || missing+=(npm)  # installs the pinned Claude Code CLI
  fi
  printf '%s\n' "${missing[@]}"
}

install_python_requirements() {
  # pip answers from the installed set without touching the network when every pin is met.
  local requirements=requirements.txt
  [ "$MODE" = demo ] && requirements=requirements-runtime.txt
  python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore -r "$requirements"
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

# Runs a command with its output kept aside, shown only when it fails.
quietly() {
  local output status=0
  output=$("$@" 2>&1) || status=$?
  if [ "$status" -ne 0 ]; then printf '%s\n' "$output" >&2; fi
  return "$status"
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
  debootstrap --variant=minbase --include="$PYTHON_IMAGE_PACKAGES" \
    bookworm "$root" "$DEBIAN_MIRROR" >/dev/null
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" -c . | docker import \
    -c 'ENV PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8' -c 'CMD ["/bin/sh"]' \
    - "$PYTHON_IMAGE" >/dev/null
}

build_browser_image() {
  # The recording example's controller: the Python image's tools plus Debian's Chromium and
  # Node.js, and playwright-core under /opt/playwright (on NODE_PATH).
  image_exists "$BROWSER_IMAGE" && return
  require_debian_mirror
  log "building $BROWSER_IMAGE with debootstrap from $DEBIAN_MIRROR: Chromium, Node.js, playwright-core $PLAYWRIGHT_CORE_VERSION (a few minutes, once)"
  (
    root=$(mktemp -d)
    chmod 755 "$root"  # apt's sandbox user must reach its download directory
    # --one-file-system: never follow a mount left in the root into the host's /proc.
    trap 'umount "$root/proc" 2>/dev/null || true; rm -rf --one-file-system "$root"' EXIT
    # dbus-x11 provides the session bus Chromium's dconf-service depends on; without it
    # debootstrap cannot configure Chromium (and apt would repair that with systemd).
    quietly debootstrap --variant=minbase \
      --include="$PYTHON_IMAGE_PACKAGES",chromium,nodejs,dbus-x11 \
      bookworm "$root" "$DEBIAN_MIRROR"
    mount -t proc proc "$root/proc"
    # npm is needed only here: it installs the one pinned package, then leaves with its
    # dependencies. It uses the machine's npm registry and CA bundle when it has them.
    local npm_options=(--no-audit --no-fund --cache /tmp/npm-cache --prefix /opt/playwright)
    if command -v npm >/dev/null 2>&1; then
      npm_options+=(--registry "$(npm config get registry)")
    fi
    if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
      cp /etc/ssl/certs/ca-certificates.crt "$root/tmp/host-ca.crt"
      npm_options+=(--cafile /tmp/host-ca.crt)
    fi
    quietly chroot "$root" env DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -q --no-install-recommends npm
    quietly chroot "$root" env HOME=/tmp/npm-home \
      npm install "${npm_options[@]}" "playwright-core@$PLAYWRIGHT_CORE_VERSION"
    quietly chroot "$root" env DEBIAN_FRONTEND=noninteractive \
      apt-get purge -y -q --autoremove npm
    umount "$root/proc"
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    find "$root/tmp" -mindepth 1 -delete
    tar -C "$root" -c . | docker import \
      -c 'ENV PATH=/usr/local/bin:/usr/bin:/bin LANG=C.UTF-8 NODE_PATH=/opt/playwright/node_modules' \
      -c 'CMD ["/bin/sh"]' - "$BROWSER_IMAGE" >/dev/null
  )
}

claude_code_installed() {
  [ "$("$CLAUDE_CODE_DIR/bin/claude" --version 2>/dev/null)" = "$CLAUDE_CODE_VERSION (Claude Code)" ]
}

install_claude_code() {
  # npm installs the native binary through the package's optional dependency for this
  # platform, from the registry this machine's npm is configured with. Installed beside the
  # cache dir first and renamed into place, so a half-finished install is never taken as done.
  claude_code_installed && return
  log "installing @anthropic-ai/claude-code@$CLAUDE_CODE_VERSION into $CLAUDE_CODE_DIR (once)"
  local staging; staging=$(mktemp -d "$CLAUDE_CODE_DIR.XXXXXX" 2>/dev/null) \
    || { mkdir -p "$(dirname "$CLAUDE_CODE_DIR")"; staging=$(mktemp -d "$CLAUDE_CODE_DIR.XXXXXX"); }
  trap 'rm -rf "$staging"' RETURN
  quietly npm install --no-audit --no-fund --no-save --prefix "$staging" \
    "@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION"
  mkdir "$staging/bin"
  ln -s ../node_modules/@anthropic-ai/claude-code/bin/claude.exe "$staging/bin/claude"
  chmod 755 "$staging"  # mounted read-only into sessions, whose runtime user is not root
  rm -rf "$CLAUDE_CODE_DIR"
  mv "$staging" "$CLAUDE_CODE_DIR"
  claude_code_installed || { log "the installed CLI does not say $CLAUDE_CODE_VERSION"; exit 1; }
}

install_debian_packages
install_python_requirements
start_engine
build_busybox_image
build_python_image
if [ "$MODE" = demo ]; then
  log "ready for the demo: engine up, base images $BUSYBOX_IMAGE and $PYTHON_IMAGE present"
  exit 0
fi
build_browser_image
install_claude_code
log "ready: engine up, base images $BUSYBOX_IMAGE, $PYTHON_IMAGE and $BROWSER_IMAGE present, Claude Code $CLAUDE_CODE_VERSION in $CLAUDE_CODE_DIR"
