#!/bin/bash
# Llama 3.1 8B with the DeepSpeed backend on a cluster without SLURM, through DeepSpeed's own
# launcher (ssh to every host of a hostfile):
#   examples/deepspeed/launch-deepspeed.sh HOSTFILE LAYOUT CLUSTER [extra pretrain flags...]
#   LAYOUT: fsdp | hsdp | fl-fsdp | fl-hsdp    CLUSTER: 128x4 | 64x8 (nodes x GPUs per node)
# Run it on the first host, from a checkout and virtual environment at the same path on every host.
# FL_DRY_RUN=1 starts nothing: it runs the same pretrain arguments here with --dry-run.
# The command building is shared with the SLURM scripts: see examples/slurm/launch.sh.
set -euo pipefail

if [[ $# -lt 3 ]]; then
    echo "usage: $0 HOSTFILE LAYOUT CLUSTER [extra pretrain flags...]" >&2
    echo "  LAYOUT: fsdp, hsdp, fl-fsdp, fl-hsdp; CLUSTER: 128x4, 64x8" >&2
    exit 2
fi
[[ -f $1 ]] || { echo "fl-megatron launch: error: hostfile '$1' does not exist" >&2; exit 2; }
FL_HOSTFILE=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")  # absolute: launch.sh changes directory
LAYOUT=$2
CLUSTER=$3
shift 3
BACKEND=deepspeed
FL_LAUNCHER=deepspeed
source "$(cd "$(dirname "${BASH_SOURCE[0]}")/../slurm" && pwd)/launch.sh" "$LAYOUT" "$@"
