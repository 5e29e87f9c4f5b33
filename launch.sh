#!/usr/bin/env bash
# Run a script with torchrun, one process per visible GPU:
#     bash launch.sh [--nproc N] [--heap SIZE] [--log-dir DIR] [--nnodes N --node-rank R --rdzv HOST:PORT]
#                    script.py [args...]
# --nproc    processes on this node (default: the number of visible GPUs; 2 when there is none)
# --heap     NVSHMEM symmetric heap per process (default: $NVSHMEM_SYMMETRIC_SIZE, else 4G)
# --log-dir  also keep each rank's whole stdout and stderr under DIR (torchrun's --log-dir with --tee 3)
# --nnodes, --node-rank, --rdzv   several nodes: the same command on every node, R = 0 .. N-1, HOST:PORT where
#            node 0 serves torchrun's rendezvous (node 0's address); ranks are node-major (node R holds ranks
#            R * nproc .. R * nproc + nproc - 1). One node: torchrun's --standalone, and NVSHMEM's remote
#            transport off (NVLink peers only) unless NVSHMEM_REMOTE_TRANSPORT says otherwise; several nodes:
#            NVSHMEM's transport between them is the environment's (NVSHMEM_REMOTE_TRANSPORT, IBGDA, ...).
# With no GPU the script still runs, as CPU processes on gloo (the reference path).
# More processes than GPUs (shared-GPU mode, e.g. --nproc 4 on one GPU): rank r uses GPU r % GPUs,
# the host group is gloo, and the job runs under a private CUDA MPS daemon started and stopped here
# (moe_ep/mps.py; an MPS daemon already running is used instead), each process with its share of SMs.
# NVSHMEM_DISABLE_NVLS, NCCL_NVLS_ENABLE and TORCH_SYMM_MEM_DISABLE_MULTICAST pass through untouched.
set -euo pipefail

usage() {
  echo "usage: bash launch.sh [--nproc N] [--heap SIZE] [--log-dir DIR] [--nnodes N --node-rank R --rdzv HOST:PORT]" \
       "script.py [args...]"
}
fail() { echo "launch.sh: $1" >&2; usage >&2; exit 2; }

nproc=""
heap="${NVSHMEM_SYMMETRIC_SIZE:-4G}"
logs=()
nnodes=1
node_rank=""
rdzv=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --nproc) [[ $# -ge 2 ]] || fail "--nproc needs a value"; nproc="$2"; shift 2 ;;
    --nproc=*) nproc="${1#*=}"; shift ;;
    --heap) [[ $# -ge 2 ]] || fail "--heap needs a value"; heap="$2"; shift 2 ;;
    --heap=*) heap="${1#*=}"; shift ;;
    --log-dir) [[ $# -ge 2 ]] || fail "--log-dir needs a value"; logs=(--log-dir "$2" --tee 3); shift 2 ;;
    --log-dir=*) logs=(--log-dir "${1#*=}" --tee 3); shift ;;
    --nnodes) [[ $# -ge 2 ]] || fail "--nnodes needs a value"; nnodes="$2"; shift 2 ;;
    --nnodes=*) nnodes="${1#*=}"; shift ;;
    --node-rank) [[ $# -ge 2 ]] || fail "--node-rank needs a value"; node_rank="$2"; shift 2 ;;
    --node-rank=*) node_rank="${1#*=}"; shift ;;
    --rdzv) [[ $# -ge 2 ]] || fail "--rdzv needs a value"; rdzv="$2"; shift 2 ;;
    --rdzv=*) rdzv="${1#*=}"; shift ;;
    -h|--help) usage; exit 0 ;;
    --) shift; break ;;
    -*) fail "unknown option $1" ;;
    *) break ;;
  esac
done
[[ $# -ge 1 ]] || fail "no script given"
[[ -f "$1" ]] || fail "no such script: $1"
[[ -z "$nproc" || "$nproc" =~ ^[1-9][0-9]*$ ]] || fail "--nproc must be a positive integer, got '$nproc'"
[[ "$heap" =~ ^[0-9]+[KMGT]?$ ]] || fail "--heap must look like 512M or 4G, got '$heap'"
[[ "$nnodes" =~ ^[1-9][0-9]*$ ]] || fail "--nnodes must be a positive integer, got '$nnodes'"
rendezvous=(--standalone)   # one node: the rendezvous store binds a port the system picks, so none is raced for
if (( nnodes > 1 )); then
  [[ "$node_rank" =~ ^[0-9]+$ ]] && (( node_rank < nnodes )) \
    || fail "--nnodes $nnodes needs --node-rank in 0..$(( nnodes - 1 )), got '$node_rank'"
  [[ "$rdzv" =~ ^[^:]+:[0-9]+$ ]] || fail "--nnodes $nnodes needs --rdzv HOST:PORT (node 0's address), got '$rdzv'"
  rendezvous=(--nnodes "$nnodes" --node-rank "$node_rank" --master-addr "${rdzv%:*}" --master-port "${rdzv##*:}")
elif [[ -n "$node_rank$rdzv" ]]; then
  fail "--node-rank and --rdzv go with --nnodes N (N > 1)"
fi

root="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
gpus=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
shared=()
if (( gpus == 0 )); then
  nproc="${nproc:-2}"
  echo "launch.sh: no GPU visible, running $nproc CPU processes on gloo (reference path)"
else
  nproc="${nproc:-$gpus}"
  if (( nproc > gpus )); then
    per_gpu=$(( (nproc + gpus - 1) / gpus ))
    echo "launch.sh: $nproc processes on $gpus GPU(s), $per_gpu per GPU under CUDA MPS (shared-GPU mode: checks" \
         "correctness; its timings say nothing about NVLink)"
    shared=(python3 "$root/moe_ep/mps.py" --ranks-per-gpu "$per_gpu" --)
  fi
fi

export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export NVSHMEM_SYMMETRIC_SIZE="$heap"
if (( nnodes == 1 )); then
  export NVSHMEM_REMOTE_TRANSPORT="${NVSHMEM_REMOTE_TRANSPORT:-none}"   # one node: NVLink peers only
fi
exec ${shared[@]+"${shared[@]}"} python3 -m torch.distributed.run "${rendezvous[@]}" --nproc-per-node "$nproc" \
  ${logs[@]+"${logs[@]}"} "$@"
