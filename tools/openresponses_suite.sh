#!/usr/bin/env bash
# The Open Responses compliance suite (openresponses/openresponses, bin/compliance-test.ts:
# 17 tests, WebSocket mode and /responses/compact included) against a running gateway, with
# node instead of Bun: tsx runs the TypeScript, `ws` gives node the WebSocket client the
# suite expects (tools/openresponses/node_websocket.mjs).
#
#   tools/openresponses_suite.sh                       # the local stack: localhost:8080, .stack/api_key, llm
#   tools/openresponses_suite.sh --filter tool-calling --verbose
#   OPENRESPONSES_MODEL=llm_echo tools/openresponses_suite.sh  # a model that always stops: the protocol alone
#   OPENRESPONSES_BASE_URL=http://host:8080/v1 OPENRESPONSES_API_KEY=... tools/openresponses_suite.sh
#
# The suite's source: OPENRESPONSES_DIR (a checkout of openresponses/openresponses), else a
# clone at OPENRESPONSES_REF (the commit the shared specification was taken from). Its
# files and node packages go to OPENRESPONSES_CACHE (~/.cache/openresponses-suite), never
# into this repository. Needs git, npm and node >= 20.6 (`--import`); exit status 1 when a
# test fails. The suite runs its 17 tests at once whatever --filter says (--filter picks what
# it prints); each WebSocket turn must end within 30 s.
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
ref=${OPENRESPONSES_REF:-92c12d96d7b61d6d15e2214daa5e9c6000ab6e1c}
cache=${OPENRESPONSES_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/openresponses-suite}
base_url=${OPENRESPONSES_BASE_URL:-http://localhost:8080/v1}
model=${OPENRESPONSES_MODEL:-llm}
key=${OPENRESPONSES_API_KEY:-}
if [ -z "$key" ] && [ -f "$here/.stack/api_key" ]; then
    key=$(cat "$here/.stack/api_key")
fi
if [ -z "$key" ]; then
    echo "no API key: set OPENRESPONSES_API_KEY (or start the local stack: make up)" >&2
    exit 2
fi

mkdir -p "$cache"
source_dir=${OPENRESPONSES_DIR:-$cache/openresponses}
if [ ! -f "$source_dir/bin/compliance-test.ts" ]; then
    if [ -n "${OPENRESPONSES_DIR:-}" ]; then
        echo "OPENRESPONSES_DIR=$OPENRESPONSES_DIR has no bin/compliance-test.ts" >&2
        exit 2
    fi
    git clone --quiet https://github.com/openresponses/openresponses "$source_dir"
    git -C "$source_dir" checkout --quiet "$ref"
fi

# The suite's own files only (its tsconfig extends Astro's, which is not installed here).
suite=$cache/suite
rm -rf "$suite"
mkdir -p "$suite/src"
cp -R "$source_dir/bin" "$suite/bin"
cp -R "$source_dir/src/lib" "$source_dir/src/generated" "$suite/src/"

deps=$cache/node
if [ ! -d "$deps/node_modules/tsx" ] || [ ! -d "$deps/node_modules/zod" ] || [ ! -d "$deps/node_modules/ws" ]; then
    mkdir -p "$deps"
    [ -f "$deps/package.json" ] || echo '{"name": "openresponses-suite-deps", "private": true}' >"$deps/package.json"
    (cd "$deps" && npm install --silent --no-audit --no-fund zod@3.25.76 tsx@4 ws@8)
fi
ln -sfn "$deps/node_modules" "$suite/node_modules"
cp "$here/tools/openresponses/node_websocket.mjs" "$suite/node_websocket.mjs"

cd "$suite"
exec node --import tsx --import ./node_websocket.mjs bin/compliance-test.ts \
    --base-url "$base_url" --api-key "$key" --model "$model" "$@"
