#!/usr/bin/env bash
# Print the path of a Chromium binary for the browser tests (tests/test_ui.py), which drive
# Debian's chromium through Playwright (Playwright's own browser downloads are not used).
#
#   bash tools/get_chromium.sh     -> last line of stdout: /abs/path/to/chromium
#
# Order: $CHROMIUM_BIN; `chromium` (or `chromium-browser`) on PATH; else, as root,
# `apt-get install -y chromium` (after `apt-get update` when apt has no package lists yet);
# otherwise it says in one line what to do.
set -euo pipefail

usable() { [[ -n "$1" && -x "$1" ]] && "$1" --version >/dev/null 2>&1; }

if [[ -n "${CHROMIUM_BIN:-}" ]]; then
    if usable "$CHROMIUM_BIN"; then
        echo "$CHROMIUM_BIN"
        exit 0
    fi
    echo "get_chromium: CHROMIUM_BIN=$CHROMIUM_BIN does not run; point it at a working chromium or unset it" >&2
    exit 1
fi
for name in chromium chromium-browser; do
    if command -v "$name" >/dev/null 2>&1 && usable "$(command -v "$name")"; then
        command -v "$name"
        exit 0
    fi
done
if [[ "$(id -u)" != "0" ]] || ! command -v apt-get >/dev/null 2>&1; then
    echo "get_chromium: no chromium found; run 'sudo apt-get install -y chromium' (Debian) or set CHROMIUM_BIN" >&2
    exit 1
fi

log="$(mktemp)"
trap 'rm -f "$log"' EXIT
apt_install() { DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium >"$log" 2>&1; }
if ! apt_install; then
    apt-get update -qq >/dev/null 2>&1 || true
    apt_install || { tail -n 20 "$log" >&2; echo "get_chromium: apt-get install chromium failed (above)" >&2; exit 1; }
fi
binary="$(command -v chromium || true)"
if ! usable "$binary"; then
    echo "get_chromium: chromium was installed but does not run on this machine" >&2
    exit 1
fi
echo "$binary"
