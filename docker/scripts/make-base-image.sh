#!/usr/bin/env bash
# Make an offline Debian base image for `cudadoctor build` with debootstrap + `docker import`.
#
#   docker/scripts/make-base-image.sh [--suite bookworm] [--mirror URL] [--tag NAME] [--print-tag]
#
# The image holds Debian (minbase) plus the host-side build tools a torch extension needs:
# python3 (+venv, headers), g++, ninja, ca-certificates. No CUDA and no torch: with
# `--toolkit pip` those come from pip wheels at build time. The tag is derived from the
# suite and the package list, so a rerun with an existing tag returns at once.
# Needs root (debootstrap) and a running Docker daemon. Prints the tag on its last line.
set -euo pipefail

SUITE=bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PACKAGES="python3,python3-venv,python3-dev,python3-pip,g++,make,ninja-build,ca-certificates,ccache"
TAG=""
PRINT_ONLY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --suite) SUITE=$2; shift 2 ;;
    --mirror) MIRROR=$2; shift 2 ;;
    --tag) TAG=$2; shift 2 ;;
    --print-tag) PRINT_ONLY=1; shift ;;
    -h|--help) sed -n '2,12p' "$0"; exit 0 ;;
    *) echo "make-base-image: unknown argument: $1" >&2; exit 2 ;;
  esac
done

if [ -z "$TAG" ]; then
  sum=$(printf '%s\n%s\n' "$SUITE" "$PACKAGES" | sha256sum | cut -c1-12)
  TAG="cudadoctor/base:${SUITE}-${sum}"
fi
if [ "$PRINT_ONLY" = 1 ]; then echo "$TAG"; exit 0; fi

if docker image inspect "$TAG" >/dev/null 2>&1; then
  echo "make-base-image: $TAG already exists" >&2
  echo "$TAG"
  exit 0
fi

command -v debootstrap >/dev/null || { echo "make-base-image: debootstrap not found (apt-get install debootstrap)" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "make-base-image: debootstrap needs root" >&2; exit 2; }

work=$(mktemp -d /tmp/cudadoctor-base.XXXXXX)
cleanup() { rm -rf --one-file-system "$work"; }
trap cleanup EXIT
root="$work/rootfs"

echo "make-base-image: debootstrap $SUITE from $MIRROR into $root" >&2
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$root" "$MIRROR" >"$work/debootstrap.log" 2>&1 || {
  tail -n 40 "$work/debootstrap.log" >&2
  echo "make-base-image: debootstrap failed (log above)" >&2
  exit 1
}
# Trim what a build container never needs.
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* \
       "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/locale/*
# pip refuses to install into the system interpreter on bookworm (PEP 668); builds use a venv,
# but let plain `pip install` work too inside throwaway containers.
rm -f "$root"/usr/lib/python3*/EXTERNALLY-MANAGED
mkdir -p "$root/tmp" && chmod 1777 "$root/tmp"

echo "make-base-image: importing as $TAG" >&2
tar -C "$root" -c . | docker import \
  --change 'ENV LANG=C.UTF-8' \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["/bin/bash"]' \
  --message "cudadoctor offline base: debian $SUITE minbase + $PACKAGES" \
  - "$TAG" >/dev/null
echo "$TAG"
