#!/bin/bash
# The same as kimi-k2.5-data.sbatch without Slurm: run this script on every host, node 0 last (it waits for the others).
#   PHASE=serve    bash params/launch/kimi-k2.5-data-multihost.sh         # every host but node 0: a vLLM server
#   PHASE=generate HOSTS="host0 host1" RUN_DIR=/shared/runs/kimi bash ... # node 0: its own server + the generate stage
#   then stop the servers, and on every host (node 0 with NODE_RANK=0):
#   PHASE=extract NODE_RANK=1 HEAD=host0 NNODES=2 RUN_DIR=/shared/runs/kimi bash params/launch/kimi-k2.5-data-multihost.sh
# Extra arguments go to the stage (e.g. --set generate.max_samples=1000). Hosts reach each other on $PORT (vLLM) and HEAD:29400 (torchrun's c10d rendezvous). RUN_DIR on shared storage.
# HOSTS entries may carry a port (host:port). Tried here with PROFILE=tiny on one host (a second server on port 8001,
# HOSTS="127.0.0.1 127.0.0.1:8001"; extraction as two agents on 127.0.0.1); not tested: real hosts, GPUs, Kimi-K2.5.
set -euo pipefail
: "${PHASE:?serve, generate or extract}"
REPO=${REPO:-$(cd "$(dirname "$0")/../.." && pwd)}
PROFILE=${PROFILE:-kimi-k2.5}  # a profile name in params/ (tiny: how this script was tried on one host)
PORT=${PORT:-8000}
PY="$REPO/.venv/bin/python"
cd "$REPO"
case "$PHASE" in
serve)
  exec "$PY" -m eagle3lib serve --profile "$PROFILE" --host "${BIND:-0.0.0.0}" --port "$PORT" ;;
generate)
  : "${HOSTS:?the hosts serving, node 0 included}" "${RUN_DIR:?}"
  mkdir -p "$RUN_DIR"
  "$PY" -m eagle3lib serve --profile "$PROFILE" --host "${BIND:-0.0.0.0}" --port "$PORT" > "$RUN_DIR/vllm-generate-node0.log" 2>&1 &
  OWN=$!
  trap 'kill $OWN 2> /dev/null || true' EXIT
  URLS=""
  for h in $HOSTS; do  # host, or host:port
    case "$h" in *:*) url="http://$h" ;; *) url="http://$h:$PORT" ;; esac
    URLS+="\"$url\","
    until curl -sf "$url/health" > /dev/null; do
      kill -0 "$OWN" 2> /dev/null || { echo "this host's vLLM server exited; see $RUN_DIR/vllm-generate-node0.log"; exit 1; }
      sleep 5
    done
  done
  "$PY" -m eagle3lib run --profile "$PROFILE" --run-dir "$RUN_DIR" --stages generate --set "verifier.server_url=[${URLS%,}]" "$@" ;;
extract)
  : "${NODE_RANK:?}" "${HEAD:?}" "${NNODES:?}" "${RUN_DIR:?}"
  ENDPOINT="$HEAD:${RDZV_PORT:-29400}"
  JOB=${JOB:-eagle3-kimi-extract}
  SETS=(--set extract.backend="${BACKEND:-vllm}" --set extract.nnodes="$NNODES" --set extract.nproc_per_node=1
        --set extract.rdzv_endpoint="$ENDPOINT" --set extract.rdzv_id="$JOB")
  if [ "$NODE_RANK" = 0 ]; then
    exec "$PY" -m eagle3lib run --profile "$PROFILE" --run-dir "$RUN_DIR" --stages extract "${SETS[@]}" "$@"
  fi
  mkdir -p "$RUN_DIR/extract" && cd "$RUN_DIR/extract"  # not the repository: its kernels/ would shadow HF kernels
  exec "$PY" -m torch.distributed.run --nnodes="$NNODES" --nproc-per-node=1 --rdzv-backend=c10d \
    --rdzv-endpoint="$ENDPOINT" --rdzv-id="$JOB" --module eagle3lib.stages.extract --profile "$PROFILE" \
    --run-dir "$RUN_DIR" "${SETS[@]}" "$@" ;;
*) echo "PHASE must be serve, generate or extract" >&2; exit 2 ;;
esac
