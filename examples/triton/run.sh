#!/usr/bin/env bash
# The whole Triton path: build an engine, write a model repository, start tritonserver, query it.
#
#   make install-triton                      # once: .venv-triton with numpy<2 and the tritonserver binary
#   bash examples/triton/run.sh
#
# ENGINE (an existing engine directory) skips the build; WORKDIR holds what the script writes.
set -euo pipefail
cd "$(dirname "$0")/../.."
PRECAST_TRITON_PYTHON=${PRECAST_TRITON_PYTHON:-.venv-triton/bin/python}
WORKDIR=${WORKDIR:-$(mktemp -d)}
PORT=${PORT:-18500}

if [ -z "${ENGINE:-}" ]; then
  ENGINE=$WORKDIR/engine
  .venv/bin/precast build --checkpoint "$(.venv/bin/python -m precast.packaged)" --output "$ENGINE" --dtype bfloat16 --quiet
fi
.venv/bin/precast triton-repo "$ENGINE" --output "$WORKDIR/repo" --kv-cache-memory 256MiB --force

"$PRECAST_TRITON_PYTHON" -m precast triton "$WORKDIR/repo" --http-port "$PORT" --grpc-port $((PORT + 1)) \
  --metrics-port $((PORT + 2)) > "$WORKDIR/tritonserver.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 120); do
  curl -sf "localhost:$PORT/v2/health/ready" > /dev/null && break
  sleep 0.5
done

.venv/bin/python examples/triton/client.py "localhost:$((PORT + 1))"
