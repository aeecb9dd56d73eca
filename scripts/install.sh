#!/bin/sh
# install.sh: installs a Reploy offline bundle (made by `make bundle`) on a host that has python3
# and coreutils, and Docker to run sessions, but no network. It never reaches the network.
#
#   ./install.sh [--prefix DIR]          DIR defaults to /usr/local
#
# Nothing is written until every file matched SHA256SUMS and this host's python3 and machine
# are the ones the wheels were built for: a refusal changes nothing. Then:
#   DIR/lib/reploy/       the role files, README.md, web/, docs/, examples/ and manifest.json;
#   DIR/lib/reploy/venv/  a virtual environment (python3 -m venv) holding the bundled wheels,
#                         installed with pip --no-index by the bundle's own pip, which reads no
#                         configuration or environment (so no index can creep in);
#   the local engine      gets the bundle's image tars, if any, loaded through that venv's
#                         Docker SDK (Reploy's own code never runs the docker CLI);
#   DIR/bin/reploy        the launcher: the venv's python on reploy.py.
# An earlier installation there is replaced, and put back if this one fails. It prints one JSON
# object describing what it installed (or why not); messages go to stderr. Exit 0 when
# installed, 1 on a refusal or failure, 2 on a usage error (nothing on stdout).
set -eu

SCHEMA=reploy-offline-install-v1
bundle=$(cd "$(dirname "$0")" && pwd -P)

say() { printf 'install.sh: %s\n' "$*" >&2; }

usage() {
    say "usage error: $1"
    echo "usage: install.sh [--prefix DIR]" >&2
    exit 2
}

# A refusal or failure: the reason on stderr, and as the one JSON object on stdout.
fail() {
    say "$1"
    python3 -I -c 'import json, sys
print(json.dumps({"schema": sys.argv[1], "ok": False, "error": sys.argv[2]}))' \
        "$SCHEMA" "$1" 2>/dev/null || true
    exit 1
}

# Everything that needs JSON, run by the host's python3 (sh has no JSON parser):
#   bundle_tool check              refuse a manifest naming files SHA256SUMS does not cover, or
#                                  built for another Python minor version or machine
#   bundle_tool target APP LAUNCHER  refuse to replace what an earlier install.sh did not write
#   bundle_tool wheels             the wheel paths, one per line
#   bundle_tool installer          pip's wheel path
#   bundle_tool copy APP           copy the application files into APP
#   bundle_tool launcher APP       the launcher's text
#   bundle_tool result PREFIX APP LAUNCHER REPLACED IMAGES_JSON   the success object
bundle_tool() {
    python3 -I - "$bundle" "$@" <<'PY'
import json, platform, shlex, shutil, sys
from pathlib import Path, PurePosixPath

LAUNCHER_MARK = "# Reploy launcher, written by install.sh: the venv's python on reploy.py."
bundle, action, args = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
manifest = json.loads((bundle / "manifest.json").read_text(encoding="utf-8"))


def refuse(message):
    print(message)
    sys.exit(1)


if action == "check":
    if manifest.get("schema") != "reploy-offline-bundle-v1":
        refuse("manifest.json is not a reploy-offline-bundle-v1 manifest")
    covered = {line.split("  ", 1)[1] for line in
               (bundle / "SHA256SUMS").read_text(encoding="utf-8").splitlines()}
    named = ["manifest.json", *manifest["files"], manifest["installer"]["file"],
             *(w["file"] for w in manifest["wheels"]), *(i["file"] for i in manifest["images"])]
    unsafe = [p for p in named if PurePosixPath(p).is_absolute() or ".." in PurePosixPath(p).parts]
    if unsafe:
        refuse(f"manifest.json names paths outside the bundle: {', '.join(unsafe)}")
    uncovered = sorted(set(named) - covered)
    if uncovered:
        refuse(f"SHA256SUMS does not cover {', '.join(uncovered)}")
    built, host = manifest["python"], "%d.%d" % sys.version_info[:2]
    if built["minor"] != host:
        refuse(f"this bundle's wheels are for Python {built['minor']} (built with "
               f"{built['version']}), but this host's python3 is {platform.python_version()}: "
               f"build the bundle with Python {host} (make bundle PYTHON=python{host}) or "
               f"install Python {built['minor']} here")
    if manifest["machine"] != platform.machine():
        refuse(f"this bundle's wheels are for {manifest['machine']} machines, this host is "
               f"{platform.machine()}: build the bundle on a {platform.machine()} machine")
elif action == "target":
    app, launcher = Path(args[0]), Path(args[1])
    if app.exists() or app.is_symlink():
        try:
            earlier = json.loads((app / "manifest.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            earlier = {}
        if not app.is_dir() or app.is_symlink() or earlier.get("schema") != manifest["schema"]:
            refuse(f"{app} exists and is not a Reploy installation; remove it or choose "
                   f"another --prefix")
    if launcher.exists() or launcher.is_symlink():
        try:
            lines = launcher.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError):
            lines = []
        if launcher.is_symlink() or lines[1:2] != [LAUNCHER_MARK]:
            refuse(f"{launcher} exists and is not a Reploy launcher; remove it or choose "
                   f"another --prefix")
    if app.exists():
        print(earlier.get("version") or "unknown")  # the installation this one replaces
elif action == "wheels":
    print("\n".join(w["file"] for w in manifest["wheels"]))
elif action == "installer":
    print(manifest["installer"]["file"])
elif action == "copy":
    app = Path(args[0])
    for path in ["manifest.json", *manifest["files"]]:
        (app / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(bundle / path, app / path)
elif action == "launcher":
    app = Path(args[0])
    command = shlex.join([str(app / "venv/bin/python3"), str(app / "reploy.py")])
    print(f'#!/bin/sh\n{LAUNCHER_MARK}\nexec {command} "$@"')
elif action == "result":
    prefix, app, launcher, replaced, images = args
    print(json.dumps({
        "schema": "reploy-offline-install-v1", "ok": True, "error": None,
        "version": manifest["version"], "prefix": prefix, "app_dir": app,
        "venv": str(Path(app) / "venv"), "launcher": launcher,
        "python": platform.python_version(),
        "wheels": [{"name": w["name"], "version": w["version"]} for w in manifest["wheels"]],
        "images": json.loads(images), "replaced": replaced or None}))
PY
}

# Loads the bundle's image tars into the local engine with the venv's Docker SDK; prints the
# loaded images as a JSON list. An image must come back under the id the manifest recorded.
load_images() {
    "$venv/bin/python3" -I - "$bundle" <<'PY'
import json, sys
from pathlib import Path

import docker
import docker.errors

bundle = Path(sys.argv[1])
manifest = json.loads((bundle / "manifest.json").read_text(encoding="utf-8"))
loaded = []
try:
    client = docker.from_env(timeout=600) if manifest["images"] else None
    for entry in manifest["images"]:
        with (bundle / entry["file"]).open("rb") as tar:
            ids = {image.id for image in client.images.load(tar)}
        if entry["id"] not in ids:
            sys.exit(f"{entry['file']} loaded as {sorted(ids)}, not {entry['id']}")
        loaded.append({"file": entry["file"], "tags": entry["tags"], "id": entry["id"]})
except docker.errors.DockerException as e:
    sys.exit(f"the Docker engine did not take the bundle's images: {e}")
print(json.dumps(loaded))
PY
}

prefix=/usr/local
while [ $# -gt 0 ]; do
    case $1 in
        --prefix)
            [ $# -ge 2 ] && [ -n "$2" ] || usage "--prefix needs a directory"
            prefix=$2
            shift 2 ;;
        --prefix=*)
            prefix=${1#--prefix=}
            [ -n "$prefix" ] || usage "--prefix needs a directory"
            shift ;;
        -h|--help) echo "usage: install.sh [--prefix DIR]"; exit 0 ;;
        *) usage "unknown argument: $1" ;;
    esac
done
case $prefix in
    /*) ;;
    *) prefix=$(pwd -P)/$prefix ;;
esac
app=$prefix/lib/reploy
venv=$app/venv
launcher=$prefix/bin/reploy

command -v python3 >/dev/null 2>&1 || fail "python3 is not on PATH; Reploy needs it"

# 1. The bundle is whole, and meant for this host. Nothing has been written yet.
[ -f "$bundle/SHA256SUMS" ] || fail "$bundle/SHA256SUMS is missing: not a Reploy bundle; nothing was installed"
if ! report=$(cd "$bundle" && sha256sum --check --strict --quiet SHA256SUMS 2>&1); then
    damaged=  # the files sha256sum names (its own warnings left out), else its whole report
    while IFS= read -r line; do
        case $line in sha256sum:*) ;; *) damaged="$damaged${damaged:+, }$line" ;; esac
    done <<EOF
$report
EOF
    fail "the bundle is damaged, nothing was installed: ${damaged:-$(printf '%s' "$report" | tr '\n' ' ')}"
fi
problem=$(bundle_tool check) || fail "refusing this bundle, nothing was installed: $problem"
problem=$(bundle_tool target "$app" "$launcher") || fail "refusing to install, nothing was changed: $problem"
replaced=$problem  # the version of the installation being replaced, if any

# 2. Make the installation. On any failure (or signal), undo exactly what this run did: remove
#    what it made, and put the earlier installation back.
made=         # directories this run created, newest first
aside=        # where the earlier installation waits
app_made=
partial=      # the launcher being written
rollback() {
    [ -z "$app_made" ] || rm -rf "$app"
    [ -z "$partial" ] || rm -f "$partial"
    if [ -n "$aside" ]; then
        [ ! -e "$aside/reploy" ] || mv "$aside/reploy" "$app"
        rmdir "$aside"
    fi
    printf '%s' "$made" | while IFS= read -r dir; do rmdir "$dir" 2>/dev/null || true; done
}
trap rollback EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
for dir in "$prefix" "$prefix/lib" "$prefix/bin"; do
    if [ ! -d "$dir" ]; then
        mkdir "$dir" || fail "cannot create $dir"
        made="$dir
$made"
    fi
done
if [ -n "$replaced" ]; then
    aside=$(mktemp -d "$prefix/lib/.reploy-previous.XXXXXX") || fail "cannot write in $prefix/lib"
    mv "$app" "$aside/reploy" || fail "cannot move the earlier installation aside"
fi

mkdir "$app" || fail "cannot create $app"
app_made=1
bundle_tool copy "$app" >&2 || fail "copying the application files into $app failed"
python3 -I -m venv --without-pip "$venv" >&2 || fail "python3 -m venv could not create $venv"
set -f  # wheel paths are plain names; no globbing
wheels=$(bundle_tool wheels)
installer=$(bundle_tool installer)
(cd "$bundle" && PIP_CONFIG_FILE=/dev/null "$venv/bin/python3" -I "$installer/pip" --isolated install \
    --no-index --no-cache-dir --disable-pip-version-check --only-binary=:all: --quiet $wheels) >&2 \
    || fail "pip could not install the bundled wheels into $venv (see above)"
set +f
images=$(load_images) || fail "loading the bundle's images failed (see above); the application was not installed"
partial=$(mktemp "$prefix/bin/.reploy.XXXXXX") || fail "cannot write in $prefix/bin"
bundle_tool launcher "$app" >"$partial" && chmod 755 "$partial" && mv "$partial" "$launcher" \
    || fail "cannot write $launcher"
partial=
installed=$("$launcher" --version) || fail "the installed launcher $launcher does not run (see above)"

trap - EXIT INT TERM
[ -z "$aside" ] || rm -rf "$aside"
say "installed $installed into $prefix; run $launcher"
bundle_tool result "$prefix" "$app" "$launcher" "$replaced" "$images"
