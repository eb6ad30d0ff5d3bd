#!/usr/bin/env bash
# Thin torchrun wrapper: ./launch.sh [key=value ...]
#
#   NPROC      processes (GPUs) on this node   (default: all visible GPUs, or 1)
#   NNODES     nodes                           (default: 1)
#   NODE_RANK  this node's rank                (default: 0)
#   MASTER     host:port of node 0 for multi-node rendezvous
#
# Every rank runs with the same Hydra overrides; outputs go to one output_dir.
# --virtual-local-rank gives each rank only its own GPU, as cuda:0, so every rank
# compiles for the same device index and ranks can share compiled code.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
if [ -z "${NPROC:-}" ]; then
  NPROC=$("$PY" -c 'import torch; print(max(1, torch.cuda.device_count()))')
fi
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}
args=(--nproc_per_node="$NPROC" --nnodes="${NNODES:-1}" --virtual-local-rank)
if [ "${NNODES:-1}" -gt 1 ]; then
  args+=(--node_rank="${NODE_RANK:?set NODE_RANK}" --rdzv_backend=c10d --rdzv_endpoint="${MASTER:?set MASTER=host:port}" --rdzv_id="${RUN_ID:-dflash}")
else
  args+=(--standalone)
fi
exec "$PY" -m torch.distributed.run "${args[@]}" -m dflash.train "$@"
