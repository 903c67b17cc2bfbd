#!/usr/bin/env bash
# Build Raven's container image with Debian's podman, from a base image made here from Debian packages
# (debootstrap: a minimal bookworm with python3), so that no registry is needed. Prints the image's tag and
# size. Safe to run again: the base is remade only when its recipe changes, and podman's layer cache keeps
# the dependencies' layer when only Raven's code changed. Needs root (podman and debootstrap do).
#
#   bash scripts/image.sh                 # builds localhost/raven-tunnel:<version>
#   RAVEN_IMAGE=raven-tunnel:dev bash scripts/image.sh
#
# Environment: RAVEN_IMAGE (the tag), RAVEN_DEBIAN_MIRROR (default http://deb.debian.org/debian),
# RAVEN_PODMAN_ARGS (extra arguments to `podman build`, e.g. --no-cache). docs/image.md explains it all.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PATH:/usr/sbin:/sbin"

version="$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' raven/__init__.py | head -n1)"  # the one place the release is written
[ -n "$version" ] || { echo "image: cannot read __version__ from raven/__init__.py" >&2; exit 1; }
image="${RAVEN_IMAGE:-localhost/raven-tunnel:${version}}"
mirror="${RAVEN_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
suite=bookworm

if [ "$(id -u)" != 0 ]; then
    echo "image: needs root (podman builds as root here, and debootstrap needs it)" >&2
    exit 1
fi

# ---------------------------------------------------------------- tools (Debian packages)
need=()
command -v podman >/dev/null 2>&1 || need+=(podman)
command -v buildah >/dev/null 2>&1 || need+=(buildah)
command -v debootstrap >/dev/null 2>&1 || need+=(debootstrap)
command -v runc >/dev/null 2>&1 || need+=(runc)
if [ ${#need[@]} -gt 0 ]; then
    echo "image: installing Debian packages: ${need[*]}"
    flock /tmp/raven-apt.lock apt-get update -qq
    flock /tmp/raven-apt.lock env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# podman's defaults ask for more open files and processes than this sandbox lets runc set (runc then
# fails: "error setting rlimits"): ask for this process's own limits instead, processes no more than the
# kernel's pid_max, in a configuration of our own that leaves /etc/containers alone. runc, not crun: crun
# refuses hosts with hybrid (v1 + v2) cgroups. The tests use the same file (CONTAINERS_CONF).
conf_dir=/tmp/raven-podman
mkdir -p "$conf_dir"
nofile="$(ulimit -Hn)"; nproc="$(ulimit -Hu)"; pid_max="$(cat /proc/sys/kernel/pid_max)"
[ "$nofile" = unlimited ] && nofile=1048576
{ [ "$nproc" = unlimited ] || [ "$nproc" -gt "$pid_max" ]; } && nproc="$pid_max"
conf="$conf_dir/containers.conf"
printf '[containers]\ndefault_ulimits = ["nofile=%s:%s", "nproc=%s:%s"]\n[engine]\nruntime = "runc"\n' \
    "$nofile" "$nofile" "$nproc" "$nproc" > "$conf.$$"
mv "$conf.$$" "$conf"
export CONTAINERS_CONF="$conf"

# One build at a time on this machine (two would debootstrap twice and race for the tags).
exec 9>/tmp/raven-image.lock
flock 9

# ---------------------------------------------------------------- the base, from Debian packages
# Two images from one debootstrap: the build base is the whole tree (minbase, python3, python3-venv for
# pip, python3-dev and gcc for mypyc's build of Raven's compiled modules, binutils to strip shared objects);
# the runtime base keeps only what python3 needs at run time (scripts/image-rootfs.py: no compiler, no shell,
# no package manager, no documentation). Neither has apt lists.
make_base() {  # $1 = the build base's tag, $2 = the runtime base's tag
    local work root
    work="$(mktemp -d /var/tmp/raven-base.XXXXXX)"
    root="$work/root"
    # shellcheck disable=SC2064
    trap "rm -rf '$work'" EXIT
    debootstrap --variant=minbase --include=python3,python3-venv,python3-dev,gcc,binutils,netbase \
        "$suite" "$root" "$mirror" >"$work/debootstrap.log" 2>&1 || {
        tail -n 30 "$work/debootstrap.log" >&2
        echo "image: debootstrap $suite from $mirror failed" >&2
        exit 1
    }
    chroot "$root" apt-get clean
    rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/* "$root"/var/log/* "$root"/usr/share/doc/* \
        "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/usr/share/locale/* "$root"/root/.cache
    tar -C "$root" --numeric-owner -c . | podman import --quiet \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' --change 'CMD ["/bin/sh"]' \
        --message "debootstrap $suite minbase + python3, python3-venv, python3-dev, gcc, binutils" - "$1" >/dev/null
    python3 scripts/image-rootfs.py "$root" "$work/runtime"
    tar -C "$work/runtime" --numeric-owner -c . | podman import --quiet \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'CMD ["/usr/bin/python3"]' \
        --message "python3 and its run-time dependencies from debootstrap $suite" - "$2" >/dev/null
    rm -rf "$work"
    trap - EXIT
}
# The tag names the recipe (this function's text and the suite): a changed recipe makes a new base.
recipe="$( (echo "$suite"; declare -f make_base; cat scripts/image-rootfs.py) | sha256sum | cut -c1-12)"
base_build="localhost/raven-base-build:$suite-$recipe"
base_run="localhost/raven-base:$suite-$recipe"
if podman image exists "$base_build" && podman image exists "$base_run"; then
    echo "image: base $base_run (reused)"
else
    start=$SECONDS
    echo "image: making the base from Debian packages (debootstrap $suite, minbase + python3) ..."
    make_base "$base_build" "$base_run"
    echo "image: base $base_run made in $((SECONDS - start)) s"
    # Bases of earlier recipes: no longer used (podman keeps any that an image still needs).
    for old in $(podman images --format '{{.Repository}}:{{.Tag}}' | grep -E '^localhost/raven-base(-build)?:' \
                 | grep -v -e "^$base_build\$" -e "^$base_run\$"); do
        podman rmi "$old" >/dev/null 2>&1 || true
    done
fi

# ---------------------------------------------------------------- the wheels
# Downloaded here, with this machine's own pip and its configuration (index, proxy CA, constraints: the
# same that scripts/setup.sh installs with), for the image's Python (CPython 3.11, glibc 2.36, x86_64),
# wheels only. The build itself is then offline: the builder stage installs from these and nothing else.
start=$SECONDS
[ -x .venv/bin/python ] || bash scripts/setup.sh >/dev/null
wheels=build/image-wheels
platforms=()  # what bookworm's glibc (2.36) runs: every manylinux tag up to it
for minor in $(seq 36 -1 17); do platforms+=(--platform "manylinux_2_${minor}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64)
reqs="$(python3 -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))')"
if [ -f "$wheels/complete" ] && [ "$reqs" = "$(cat "$wheels/requirements.txt")" ] && [ -z "${RAVEN_REFRESH_WHEELS:-}" ]; then
    echo "image: wheels in $wheels (reused: pyproject.toml's dependencies are unchanged; RAVEN_REFRESH_WHEELS=1 refreshes)"
else
    rm -rf "$wheels.new"
    mkdir -p "$wheels" "$wheels.new"
    printf '%s\n' "$reqs" > "$wheels.new/requirements.txt"
    .venv/bin/python -m pip download --quiet --disable-pip-version-check --only-binary=:all: \
        "${platforms[@]}" --python-version 3.11 --implementation cp --abi cp311 --find-links "$wheels" \
        --dest "$wheels.new" -r "$wheels.new/requirements.txt" "pip>=23.1" "setuptools>=68" wheel "mypy>=1.10" "types-PyYAML>=6.0" \
        2>"$wheels.log" \
        || { cat "$wheels.log" >&2; echo "image: could not download the dependencies' wheels" >&2; exit 1; }
    touch "$wheels.new/complete"
    # The same set as last time: keep the old folder (and with it podman's cached layer).
    if [ "$(cd "$wheels" && ls | sort | sha256sum)" != "$(cd "$wheels.new" && ls | sort | sha256sum)" ] \
        || ! cmp -s "$wheels/requirements.txt" "$wheels.new/requirements.txt"; then
        rm -rf "$wheels" && mv "$wheels.new" "$wheels"
    else
        rm -rf "$wheels.new"
    fi
    echo "image: $(ls "$wheels" | grep -c '\.whl$') wheels downloaded to $wheels ($((SECONDS - start)) s)"
fi

# ---------------------------------------------------------------- the image
start=$SECONDS
# No network for the build: everything it needs is in the context. RUN steps run under runc too.
# shellcheck disable=SC2086
podman build --runtime runc --network none --layers \
    --build-arg "BASE_IMAGE=$base_run" --build-arg "BUILD_IMAGE=$base_build" \
    --label "org.opencontainers.image.version=$version" \
    ${RAVEN_PODMAN_ARGS:-} -t "$image" -f Dockerfile . >"$conf_dir/build.log" 2>&1 || {
    tail -n 40 "$conf_dir/build.log" >&2
    echo "image: podman build failed (whole log: $conf_dir/build.log)" >&2
    exit 1
}
size="$(podman image inspect --format '{{.Size}}' "$image")"
echo "image: $image built in $((SECONDS - start)) s, size $size bytes ($((size / 1000000)) MB)"
