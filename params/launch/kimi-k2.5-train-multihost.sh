#!/bin/bash
# The same as kimi-k2.5-train.sbatch without Slurm: run this script on every host, node 0 first.
#   NODE_RANK=0 HEAD=host0 NNODES=2 RUN_DIR=/shared/runs/kimi bash params/launch/kimi-k2.5-train-multihost.sh  # host0
#   NODE_RANK=1 HEAD=host0 NNODES=2 RUN_DIR=/shared/runs/kimi bash params/launch/kimi-k2.5-train-multihost.sh  # host1
# HEAD:29400 must be reachable from every host (torchrun's c10d rendezvous runs there). RUN_DIR on shared storage.
# Tested here: the torchrun part on 127.0.0.1 (tests/test_multinode.py). Not tested: real hosts, GPUs.
set -euo pipefail
: "${NODE_RANK:?}" "${HEAD:?}" "${NNODES:?}" "${RUN_DIR:?}"
REPO=${REPO:-$(cd "$(dirname "$0")/../.." && pwd)}
NPROC=${NPROC:-4}
PROFILE=${PROFILE:-kimi-k2.5}  # a profile name in params/ (tiny: how this script was tried on one host)
ENDPOINT="$HEAD:${RDZV_PORT:-29400}"
JOB=${JOB:-eagle3-kimi}
cd "$REPO"
if [ "$NODE_RANK" = 0 ]; then
  exec .venv/bin/python -m eagle3lib run --profile "$PROFILE" --run-dir "$RUN_DIR" --stages train \
    --set train.nnodes="$NNODES" --set train.nproc_per_node="$NPROC" --set train.rdzv_endpoint="$ENDPOINT" \
    --set train.rdzv_id="$JOB"
fi
OVERRIDES="{\"train.nnodes\": $NNODES, \"train.nproc_per_node\": $NPROC, \"train.rdzv_endpoint\": \"$ENDPOINT\", \"train.rdzv_id\": \"$JOB\"}"
mkdir -p "$RUN_DIR/train" && cd "$RUN_DIR/train"  # not the repository: its kernels/ would shadow HF kernels
exec "$REPO/.venv/bin/python" -m torch.distributed.run --nnodes="$NNODES" --nproc-per-node="$NPROC" \
  --rdzv-backend=c10d --rdzv-endpoint="$ENDPOINT" --rdzv-id="$JOB" --module eagle3lib.stages.train \
  --profile "$PROFILE" --run-dir "$RUN_DIR" --overrides-json "$OVERRIDES"
