#!/usr/bin/env bash
# Print the path of an nginx binary for the tests, getting Debian's without installing it.
#
#   bash tools/get_nginx.sh        -> last line of stdout: /abs/path/to/nginx
#
# Order: $NGINX_BIN; `nginx` on PATH; .venv/nginx/usr/sbin/nginx (extracted earlier);
# else `apt-get download nginx` + `dpkg-deb -x` into .venv/nginx. Nothing is installed
# system-wide: the package is only unpacked (Debian's nginx binary links only base
# libraries: libc, libcrypt, libpcre2, libssl, zlib). When apt has no package lists yet,
# it runs `apt-get update` if it is root, and otherwise says what to do.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
dest="$root/.venv/nginx"
binary="$dest/usr/sbin/nginx"

if [[ -n "${NGINX_BIN:-}" && -x "${NGINX_BIN}" ]]; then
    echo "$NGINX_BIN"
    exit 0
fi
if command -v nginx >/dev/null 2>&1; then
    command -v nginx
    exit 0
fi
if [[ -x "$binary" ]]; then
    echo "$binary"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1 || ! command -v dpkg-deb >/dev/null 2>&1; then
    echo "get_nginx: no nginx on PATH and no apt-get/dpkg-deb to fetch Debian's; install nginx or set NGINX_BIN" >&2
    exit 1
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
download() { (cd "$work" && apt-get download -q nginx >/dev/null 2>"$work/apt.err"); }
if ! download; then
    if [[ "$(id -u)" == "0" ]]; then
        apt-get update -qq >/dev/null
        download || { cat "$work/apt.err" >&2; exit 1; }
    else
        cat "$work/apt.err" >&2
        echo "get_nginx: apt-get download nginx failed; run 'sudo apt-get update' once, or install nginx, or set NGINX_BIN" >&2
        exit 1
    fi
fi
mkdir -p "$dest"
dpkg-deb -x "$work"/nginx_*.deb "$dest"
if ! "$binary" -v >/dev/null 2>&1; then
    echo "get_nginx: extracted $binary does not run on this machine" >&2
    exit 1
fi
echo "$binary"
