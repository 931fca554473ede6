#!/usr/bin/env bash
# The GPU measurement of a running stack (docs/benchmarks.md, "On a GPU"), gateway vs direct
# Triton gRPC in each run, as markdown on stdout:
#   bench/gpu_bench.sh embed MODEL     text_embed, clip_text or clip_image: open loop at
#                                      $RATES req/s, then the closed loop ($CLIENTS clients in
#                                      $CLIENT_PROCESSES processes: one Python client cannot keep
#                                      a GPU busy)
#   bench/gpu_bench.sh stream          llm_synthetic: TTFT at 1/8/32 streams, /v1 cost, the relay
#                                      of $STREAMS concurrent streams
#   bench/gpu_bench.sh llm             the real LLM at $LLM_STREAMS concurrent streams
# The stack is found by GATEWAY_URL (default http://127.0.0.1:8080), TRITON_URL (127.0.0.1:8001),
# API_KEY (default: the contents of $STACK_DATA_DIR/api_key) and, for the LLM's tokenizer,
# LLM_MODEL_DIR. Start the stack with `gateway up` (STACK_DEVICE=auto puts the models on the GPU).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
GATEWAY_URL=${GATEWAY_URL:-http://127.0.0.1:8080}
TRITON_URL=${TRITON_URL:-127.0.0.1:8001}
API_KEY=${API_KEY:-$(cat "${STACK_DATA_DIR:-.stack}/api_key")}
CORES=$(nproc)
CLIENT_PROCESSES=${CLIENT_PROCESSES:-$(((CORES + 3) / 4))}

bench() {
  echo
  echo "\`python -m bench.gateway_bench --gateway-url $GATEWAY_URL --triton-url $TRITON_URL --api-key \$KEY $*\`"
  echo
  local json log
  json=$(mktemp) log=$(mktemp)
  if "$PY" -m bench.gateway_bench --gateway-url "$GATEWAY_URL" --triton-url "$TRITON_URL" --api-key "$API_KEY" \
      --json "$json" "$@" > "$log" 2>&1 && [ -s "$json" ]; then
    "$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["report"])' "$json"
  else
    echo "FAILED (rc $?):"; echo '```'; tail -30 "$log"; echo '```'
  fi
  rm -f "$json" "$log"
}

case "${1:-}" in
  embed)
    bench --model "${2:?embed MODEL}" --sections open,closed --rates "${RATES:-500,2000}" --slice "${SLICE:-3}" \
      --rounds 1 --clients "${CLIENTS:-128}" --client-processes "$CLIENT_PROCESSES" ;;
  stream)
    bench --model llm_synthetic --sections ttft,v1,relay --ttft-samples "${TTFT_SAMPLES:-15}" \
      --streams "${STREAMS:-200}" --stream-tokens 100 ;;
  llm)
    bench --model llm --sections llm --llm-streams "${LLM_STREAMS:-1,8,32,128}" --llm-tokens "${LLM_TOKENS:-64}" \
      --tokenizer-dir "${LLM_MODEL_DIR:?the LLM tokenizer directory}" ;;
  *) sed -n '2,12p' "$0"; exit 2 ;;
esac
